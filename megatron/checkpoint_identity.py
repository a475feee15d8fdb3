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
"""
from __future__ import annotations

from typing import Dict, List, Optional

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
            f"(another iteration or run copied in,). {_fix(path)}")


__all__ = ["file_identity", "rank_file_problem"]
