"""Does a rank's checkpoint file belong with the checkpoint's first file?

On load, global rank 0 checks the first rank's file (mp_rank_00[_000]) against the run and
tells every rank; each other rank then reads only its own file. A file copied from another
checkpoint (another iteration of the run, another run, another tensor-parallel size) into
the directory would otherwise load on its rank alone: the ranks resume at different
iterations and sample counts, then wait for each other in a collective that never matches
(a hang until the timeout), or a rank fails alone with a KeyError on a state its file
lacks. `file_identity` is what every rank's file must share with the first one (rank 0
sends the first file's to all); `rank_file_problem` is a rank's local check of its own
file, whose message goes into the load's agreement (megatron/agreed_exit.py), which names
the rank. Local: no collective.

A distrib_optim.pt (the distributed optimizer's shards, beside each model file) holds
nothing of its own that tells its step: one copied from another iteration of the run
(same shapes) loaded the optimizer moments (and, for an fp32 model, the weights) of
another step. Saves now put a small record under DISTRIB_IDENTITY_KEY into it
(`with_distrib_identity`: the iteration and consumed samples of its model file), which
`distrib_file_problem` checks on load; a file of an older save without the record is not
checked. Megatron-LM reads a distrib_optim.pt by chunk index and ignores the extra key.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

# (key, how the message names it)
_SHARED = (("iteration", "iteration"),
           ("consumed_train_samples", "consumed training samples"),
           ("tensor_model_parallel_size", "tensor-parallel size"),
           ("pipeline_model_parallel_size", "pipeline-parallel size"),
           ("optimizer", "optimizer state"),
           ("opt_param_scheduler", "learning-rate schedule state"))


def file_identity(state, path: str) -> Dict:
    """What every rank's file of one checkpoint holds alike, from a file's payload read
    from `path`: its iteration, consumed training samples, the tp and pp sizes of its
    arguments, which of the optimizer and schedule states it has. None for a value the
    file does not tell (not compared)."""
    if not isinstance(state, dict):
        return {"path": path}
    args = state.get("args") if isinstance(state.get("args"), dict) else {}
    counters = state.get("train_state") if isinstance(state.get("train_state"), dict) else {}
    consumed = counters.get("consumed_train_samples", args.get("consumed_train_samples"))
    return {"path": path,
            "iteration": state.get("iteration"),
            "consumed_train_samples": consumed,
            "tensor_model_parallel_size": args.get("tensor_model_parallel_size"),
            "pipeline_model_parallel_size": args.get("pipeline_model_parallel_size"),
            "optimizer": "present" if "optimizer" in state else "absent",
            "opt_param_scheduler": "present" if "opt_param_scheduler" in state else "absent"}


def _fix(path: str) -> str:
    return (f"Copy {path} again from the checkpoint it belongs to, or point --load at "
            "another checkpoint")


def rank_file_problem(state, path: str, first: Optional[Dict]) -> Optional[str]:
    """The message when this rank's payload `state`, read from `path`, is not a checkpoint
    payload, or differs from the first file's identity `first` (`file_identity`, None when
    unknown): it comes from another checkpoint. None when it fits."""
    if not isinstance(state, dict):
        return (f"error: {path} holds a {type(state).__name__}, not a checkpoint's "
                f"dictionary of states. {_fix(path)}")
    if not first or first.get("path") == path:
        return None
    mine = file_identity(state, path)
    diffs: List[str] = []
    for key, what in _SHARED:
        a, b = mine.get(key), first.get(key)
        if a is not None and b is not None and a != b:
            diffs.append(f"{what} {a} (the first file: {b})")
    if not diffs:
        return None
    return (f"error: {path} does not belong with {first['path']}, the first rank's file "
            f"of the same checkpoint: {'; '.join(diffs)}. It comes from another checkpoint "
            f"(another iteration or run copied in). {_fix(path)}")


DISTRIB_IDENTITY_KEY = "checkpoint_identity"
_DISTRIB_SHARED = _SHARED[:2]  # iteration, consumed training samples


def with_distrib_identity(param_state: Dict, state) -> Dict:
    """`param_state` (a distrib_optim.pt payload) with the identity record of its model
    file's payload `state` added (a new dict; the shards are not copied)."""
    ident = file_identity(state, "")
    record = {key: ident.get(key) for key, _ in _DISTRIB_SHARED}
    return {**param_state, DISTRIB_IDENTITY_KEY: record}


def split_distrib_identity(param_state) -> Tuple[Dict, Optional[Dict]]:
    """(the distrib_optim.pt payload without its identity record, the record or None: a
    file of an older save, or converted by a tool that wrote none)."""
    if not isinstance(param_state, dict) or DISTRIB_IDENTITY_KEY not in param_state:
        return param_state, None
    rest = {k: v for k, v in param_state.items() if k != DISTRIB_IDENTITY_KEY}
    record = param_state[DISTRIB_IDENTITY_KEY]
    return rest, record if isinstance(record, dict) else None


def distrib_file_problem(record: Optional[Dict], path: str, state,
                         model_path: str) -> Optional[str]:
    """The message when the identity `record` of the distrib_optim.pt at `path` differs
    from its model file's payload `state` (read from `model_path`): it holds the optimizer
    state of another step. None when it fits or tells nothing (`record` None)."""
    if record is None:
        return None
    mine = file_identity(state, model_path)
    diffs = [f"{what} {record.get(key)} (its model file: {mine.get(key)})"
             for key, what in _DISTRIB_SHARED
             if record.get(key) is not None and mine.get(key) is not None
             and record.get(key) != mine.get(key)]
    if not diffs:
        return None
    return (f"error: {path} does not belong with {model_path}, the model file beside it: "
            f"{'; '.join(diffs)}. It holds the optimizer state of another step (copied in "
            f"from another checkpoint). Copy {path} again from the checkpoint it belongs "
            "to, pass --no-load-optim (the optimizer state left out: a fresh optimizer), or "
            "point --load at another checkpoint")


__all__ = ["DISTRIB_IDENTITY_KEY", "distrib_file_problem", "file_identity",
           "rank_file_problem", "split_distrib_identity", "with_distrib_identity"]
