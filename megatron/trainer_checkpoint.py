"""Checkpoints of a live `megatron.training.Trainer`: its payload, saving, loading.

checkpointing.py holds the on-disk format and the collective save / load of one rank's
payload and knows nothing of the Trainer; this module decides what a Trainer's payload
is (model chunks, optimizer, scheduler, RNG, counters, arguments), honours the
--no-save-* / --no-load-* / --finetune / --async-save flags, and on load reshards a
checkpoint saved with another parallel layout (megatron/checkpoint_reshard.py).
"""
from __future__ import annotations

import contextlib
import os
import re
import time
import traceback
from typing import Dict, NamedTuple, Optional, Set, Tuple, Union

import torch

from megatron.agreed_exit import agree, exit_message, exit_on_every_rank, from_rank_0
from megatron.async_save import AsyncSaver, agreed_wait
from megatron.checkpoint_args import (
    data_order_warning,
    norm_epsilon_warning,
    seq_length_warning,
    tokenizer_warning,
)
from megatron.checkpoint_dirs import checkpoint_name, model_file, same_dir
from megatron.checkpoint_identity import (
    distrib_file_problem,
    file_identity,
    rank_file_problem,
    split_distrib_identity,
    with_distrib_identity,
)
from megatron.checkpoint_model_args import checkpoint_args_message
from megatron.checkpoint_preflight import (
    LoadStates,
    no_weights_message,
    past_the_run_note,
    rounded_weights_note,
    run_goal,
    states_to_load,
)
from megatron.checkpoint_reshard import (
    Layout,
    RankPlan,
    build_rank_payload,
    inspect_checkpoint,
    live_optimizer_kind,
    needs_resharding,
    plan_rank,
)
from megatron.checkpoint_source import SourceCheckpoint
from megatron.checkpointing import (
    args_to_plain,
    get_rng_state,
    iteration_dir_name,
    load_extra_file,
    load_rank_file,
    read_tracker,
    resolve_checkpoint,
    save_checkpoint,
    save_checkpoint_async,
    set_rng_state,
)
from megatron.core.models.gpt.stages import stage_layout
from megatron.core.optimizer.lr_scheduler import mismatch_message
from megatron.logging_utils import print_rank_0
from megatron.microbatches import update_micro_batches
from megatron.oom_report import out_of_memory_kind
from megatron.resume_samples import assumed_counters, sample_budget_warning
from megatron.step_graph import settle
from megatron.watchdog import watching


def _chunk_models(model) -> list:
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
    return [getattr(c, "module", c) for c in chunks]


def model_state_dicts(model) -> dict:
    """`{"model": sd}` for one model chunk, `{"model0": sd0, "model1": sd1, ...}` for
    virtual pipeline chunks (Megatron's keys). `model` is a ModelChunks or one module."""
    chunks = _chunk_models(model)
    if len(chunks) == 1:
        return {"model": chunks[0].state_dict()}
    return {f"model{i}": c.state_dict() for i, c in enumerate(chunks)}


def load_model_state_dicts(model, state: dict, iter_dir: Optional[str] = None) -> None:
    """Load the keys written by `model_state_dicts` (strict); SystemExit when the
    checkpoint (`iter_dir`, where known) holds no weights, or when its number of virtual
    pipeline chunks or its tensors differ from this run's."""
    chunks = _chunk_models(model)
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    missing = [k for k in keys if k not in state]
    if missing:
        found = sorted(k for k in state if k == "model" or re.fullmatch(r"model\d+", k))
        if not found:
            raise SystemExit(no_weights_message(iter_dir, state))
        raise SystemExit(
            f"checkpoint has model entries {found} but this run has {len(chunks)} model "
            f"chunk(s) per pipeline rank (needs {keys}); run with the checkpoint's "
            "--num-layers-per-virtual-pipeline-stage")
    for key, chunk in zip(keys, chunks):
        try:
            chunk.load_state_dict(state[key], strict=True)
        except RuntimeError as exc:  # a checkpoint whose args did not tell (an older writer)
            if out_of_memory_kind(exc):
                raise  # the out-of-memory report names it
            raise SystemExit(f"error: the checkpoint's model does not fit this run's: {exc}\n"
                             "Run with the model flags the checkpoint was saved with") from None


def trainer_state_dict(tr) -> dict:
    """This rank's checkpoint payload from a `megatron.training.Trainer`."""
    cfg = tr.config
    args = dict(cfg.args)
    args.update(consumed_train_samples=tr.state.consumed_train_samples,
                consumed_valid_samples=tr.state.consumed_valid_samples)
    state = {
        "args": args_to_plain(args),
        "checkpoint_version": 3.0,
        "iteration": tr.state.iteration,
        **model_state_dicts(tr.model),
        "train_state": tr.state.state_dict(),
    }
    if not cfg.checkpoint.no_save_optim:
        state["optimizer"] = tr.optimizer.state_dict()
        state["opt_param_scheduler"] = tr.scheduler.state_dict()
    if not cfg.checkpoint.no_save_rng:
        state["rng_state"] = _rng_states(tr)
    return state


def _rng_states(tr) -> list:
    """Megatron's `rng_state` list: this rank's states, or with --data-parallel-random-init
    at dp > 1 those of every data-parallel rank in DP-rank order (each replica draws its own
    dropout masks; a resume gives each its own back). Collective over the DP group then."""
    own = get_rng_state(tr.rt.rng_tracker)
    ps = tr.rt.ps
    if not (tr.config.training.data_parallel_random_init and ps.dp_size > 1):
        return [own]
    states = [None] * ps.dp_size
    with watching("all-gather of the RNG states (data-parallel group)", ps.dp_group):
        torch.distributed.all_gather_object(states, own, group=ps.dp_group)
    return states


def _saved_rng_state(tr, states: list) -> Tuple[Optional[dict], Optional[str]]:
    """(this rank's entry of a checkpoint's `rng_state` list, a note): Megatron's rule, the
    entry of this DP rank with --data-parallel-random-init, else the first. A list without
    this DP rank's entry (saved at a smaller dp, or without the flag) leaves this rank's
    seeded states (Megatron stops with an IndexError)."""
    if not tr.config.training.data_parallel_random_init:
        return states[0], None
    ps = tr.rt.ps
    note = None
    if len(states) < ps.dp_size:  # the same on every rank: printed once
        note = (f"--data-parallel-random-init: the checkpoint holds the RNG states of "
                f"{len(states)} data-parallel rank(s), this run has {ps.dp_size}; ranks from "
                f"{len(states)} on keep their seeded states")
    return (states[ps.dp_rank] if ps.dp_rank < len(states) else None), note


def save_trainer_checkpoint(tr) -> float:
    """Save the trainer at its current iteration to --save; returns the seconds training
    was blocked: the whole save, or with --async-save the CPU copy only (the files are
    written in the background by `tr.async_saver`; `wait_for_async_save(tr)` finishes it).

    Collective over the world (barriers; with the distributed optimizer a gather over DP).
    An async save is finished by the next one or by `wait_for_async_save`."""
    started = time.perf_counter()
    if tr.rt.device.type == "cuda":
        torch.cuda.synchronize()
    settle(tr)  # an fp16 replay's unread flag: the step counts saved must be exact
    ck = tr.config.checkpoint
    param_state = None
    if not ck.no_save_optim and hasattr(tr.optimizer, "get_parameter_state"):
        gathered = tr.rt.ps.dp_group is not None  # else: no collective
        with watching("gather of the distributed optimizer's state (data-parallel group)",
                      tr.rt.ps.dp_group) if gathered else contextlib.nullcontext():
            param_state = tr.optimizer.get_parameter_state()
    state = trainer_state_dict(tr)  # references to live tensors: cheap; copied if async
    extra = None if param_state is None else {  # with its model file's step: checked on load
        "distrib_optim.pt": with_distrib_identity(param_state, state)}
    tr.own_checkpoints[tr.state.iteration] = "saved"
    if not ck.async_save:
        progress = getattr(tr, "progress", None)  # told of a save Ctrl-C stopped midway
        return save_checkpoint(ck.save, tr.state.iteration, state, tr.rt.ps, extra_files=extra,
                               group=_control_group(tr),
                               on_stop=None if progress is None else progress.save_stopped)
    if getattr(tr, "async_saver", None) is None:
        tr.async_saver = AsyncSaver()
    blocking = save_checkpoint_async(
        ck.save, tr.state.iteration, state, tr.rt.ps, tr.async_saver, extra_files=extra,
        timeout_s=60.0 * (tr.config.parallel.distributed_timeout_minutes + 1), started=started,
        group=_control_group(tr))
    return blocking


def report_async_failure(tr) -> None:
    """Where the run goes on (before each training step): global rank 0 prints the failure
    of the background save in flight once it is known, not only at the next save or at
    the end, where every rank exits with it (`wait_for_async_save`). Local: a failure the
    run ends before printing here is reported by that wait alone, once."""
    saver = getattr(tr, "async_saver", None)
    if saver is not None:
        saver.report_failure()


def wait_for_async_save(tr) -> None:
    """Wait until this rank's background save (if any) is written -- and on global rank 0
    published -- when the run ends (the loop reached --train-iters, or an exit condition
    every rank agreed on). With --async-save a collective (`async_save.agreed_wait` over
    the control group: every rank must call it together): when the save failed on any
    rank, rank 0 removes its temporary directory and every rank exits with one report,
    printed by rank 0."""
    if tr.config.checkpoint.async_save:
        agreed_wait(getattr(tr, "async_saver", None), tr.rt.ps.rank == 0, _control_group(tr))


def nothing_to_train(tr) -> bool:
    """Whether the run starts from a checkpoint whose iteration already reaches the last one
    (--train-iters, or the iterations of --train-samples), so the loop trains nothing; says
    so on rank 0. Megatron-LM then saves the loaded state again at the same iteration, which
    costs a save and for a moment leaves no complete copy of the only good checkpoint: when
    --save is the --load directory (it holds that state already) the caller skips the final
    save, and the line says so. First a sample-based run resumed at another global batch
    size is warned when it will not end at --train-samples (`sample_budget_warning`)."""
    t, ck, it = tr.config.training, tr.config.checkpoint, tr.state.iteration
    warning = sample_budget_warning(tr)
    if warning is not None:
        print_rank_0(warning)
    if it == 0 or it < t.train_iters:
        return False
    text = f"checkpoint at iteration {it} already reaches {run_goal(t)}: nothing to train"
    same = same_dir(ck.load, ck.save)
    if same:
        text += f"; not saving it again (--save {ck.save} holds it)"
    print_rank_0(text)
    return same


# ---------------------------------------------------------------------- resharding on load
def trainer_layout(tr) -> Layout:
    """The layout of a live `megatron.training.Trainer`."""
    ps = tr.rt.ps
    return Layout(ps.tp_size, ps.pp_size, len(tr.model), live_optimizer_kind(tr.optimizer))


def plan_trainer_rank(tr) -> RankPlan:
    """The RankPlan of this process's chunks in a live Trainer."""
    cfg, ps = tr.config, tr.rt.ps
    specs = stage_layout(cfg.model.num_layers, ps.pp_size, ps.pp_rank,
                         cfg.parallel.virtual_pp_size, cfg.parallel.standalone_embedding_stage)

    def grad_dtype(prm):
        bucket = getattr(prm, "grad_bucket", None)
        return prm.dtype if bucket is None else bucket.grad_data.dtype

    return plan_rank(tr.model.unwrapped(), [s.layer_offset for s in specs], ps.tp_size,
                     ps.tp_rank, (ps.pp_size, ps.pp_rank), grad_dtype_of=grad_dtype)


def reshard_for_trainer(tr, iter_dir: str, with_optimizer: bool,
                        saved: Optional[Layout] = None, saved_args: Optional[dict] = None,
                        identity: Optional[dict] = None) -> Tuple[dict, Optional[dict], str]:
    """This rank's payloads for a live Trainer from a checkpoint saved with another layout.

    No communication: each rank memory-maps the shard files that hold parts of its own
    parameters (the saved stages of its layers, the saved tp ranks of its slices) and
    builds only those. `saved`, `saved_args`: the checkpoint's layout and arguments when
    known (read by rank 0), sparing every rank the first rank's file; `identity`: that
    file's `file_identity`, which every shard file read must share. Returns
    (model_optim_rng payload, distrib_optim payload or None, a one-line description of
    the conversion)."""
    plan = plan_trainer_rank(tr)
    notes: Set[str] = set()
    kind = live_optimizer_kind(tr.optimizer) if with_optimizer else None
    try:
        src = SourceCheckpoint(iter_dir, saved, saved_args, identity)
        payload, distrib = build_rank_payload(src, plan, kind, notes)
    except ValueError as exc:  # shapes or parameters the checkpoint's args did not tell
        raise SystemExit(f"error: cannot reshard {iter_dir} for this run: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- a damaged shard only this rank reads
        if out_of_memory_kind(exc):
            raise  # the out-of-memory report names it
        raise SystemExit(
            f"error: cannot reshard {iter_dir} for this run: a shard file this rank reads "
            f"holds unexpected contents: {type(exc).__name__}: {exc} ({_raised_at(exc)}). "
            "Copy the checkpoint's files again, or point --load at another checkpoint"
        ) from None
    what = "model and optimizer" if "optimizer" in payload else "model"
    text = (f"resharded {iter_dir} on load: saved with {src.layout.describe()}, this run has "
            f"{trainer_layout(tr).describe()}; {what} state converted from {len(src.files)} of "
            f"{src.layout.tp * src.layout.pp} shard file(s) ({plan.num_params} parameters on "
            "this rank)")
    if "rng_state" not in payload:
        text += "; RNG states start fresh (they are per rank)"
    if notes:
        text += "; " + "; ".join(sorted(notes))
    return payload, distrib, text


class _Loaded(NamedTuple):
    """What `_load_trainer_payload` found under --load."""

    iteration: int  # 0 for a release checkpoint
    release: bool
    state: Dict  # this rank's model_optim_rng.pt payload
    param_state: Optional[Dict]  # its distrib_optim.pt payload, when already built
    converted: Optional[str]  # the description of a resharding, else None
    with_optimizer: bool  # load the optimizer and scheduler states
    with_rng: bool  # restore the RNG states (when the payload has them)
    iter_dir: str
    error: Optional[str] = None  # this rank's file or resharding failed: its message
    path: Optional[str] = None  # this rank's file (None: resharded from several)


def _rank_file(root: str, iteration: int, release: bool, ps) -> str:
    """The path of this rank's model file in the checkpoint (`load_rank_file` reads it)."""
    return model_file(os.path.dirname(
        checkpoint_name(root, iteration, ps.tp_rank, ps.pp_rank, ps.pp_size, release)))


def _control_group(tr):
    """The run's CPU group for host-side agreements (None: the default group, gloo)."""
    return getattr(tr.rt, "control_group", None)


def _check_first_file(tr, iter_dir: str, release: bool
                      ) -> Tuple[Optional[Tuple[Layout, Dict, LoadStates, Dict]], Optional[str]]:
    """((saved layout, first rank's payload, states to load, its `file_identity`), None)
    when the first rank's
    file fits the run, else (None, the first problem): the file cannot be read, its
    arguments differ from the run's (`checkpoint_args_message`), states to load are not
    in it (`states_to_load`: every one named), its learning-rate schedule contradicts the command line.
    Local: no collective."""
    ck = tr.config.checkpoint
    try:
        saved, first_path, first = inspect_checkpoint(iter_dir)
    except SystemExit as exc:
        return None, exit_message(exc)
    states = states_to_load(ck, release, first, first_path, tr.config.training.skip_train)
    problem = (checkpoint_args_message(first.get("args"), tr.config.args, iter_dir,
                                       finetune=ck.finetune)
               or "\n".join(states.problems) or None)  # both missing states at once
    if problem is None and states.with_optimizer:
        errors = tr.scheduler.check_state_dict(first["opt_param_scheduler"])[1]
        if errors:
            problem = (f"error: loading {iter_dir}: {mismatch_message(errors)}"
                       + past_the_run_note(tr.config.training, first.get("iteration"), release))
    if problem:
        return None, problem
    return (saved, first, states, file_identity(first, first_path)), None


def _first_file_checked_once(tr, iter_dir: str, release: bool
                             ) -> Tuple[Optional[Tuple[Layout, Optional[dict], LoadStates,
                                                        Dict]], Optional[str]]:
    """`_check_first_file` on global rank 0, its result -- the first file's arguments
    instead of its payload -- sent to every rank (`from_rank_0` over the control group):
    every rank listing the iteration directory and reading that file was thousands of
    reads of one file and of its directory on the shared file system at once."""
    result = None
    if tr.rt.ps.rank == 0:
        try:
            checked, problem = _check_first_file(tr, iter_dir, release)
        except Exception as exc:  # rank 0 alone would stop: the others would wait for it
            checked, problem = None, (f"error: cannot check the first rank's file of "
                                       f"{iter_dir}: {type(exc).__name__}: {exc}")
        if checked is not None:
            saved, first, states, identity = checked
            checked = (saved, first.get("args"), states, identity)
        result = (checked, problem)
    return from_rank_0(result, _control_group(tr))


def _load_trainer_payload(tr) -> Optional[_Loaded]:
    """This rank's payload from --load, checked against the run; None without a checkpoint.

    The first rank's file (memory-mapped) is checked first, on global rank 0, which tells
    the others (`_first_file_checked_once`). When the checkpoint's tp,
    pp or chunks per rank differ from the run's -- or, with the optimizer state to load, its
    optimizer kind (distributed or not, fp32 or mixed) -- each rank reads the shard files
    holding parts of its own parameters and takes its slice (megatron.checkpoint_reshard); a failure there is left in
    `_Loaded.error` for `load_trainer_checkpoint`'s agreement. Collective: the tracker
    agreement and barrier, rank 0's check of the first file sent to all; the missing- and
    unreadable-file checks otherwise. A failure exits every rank, printed once."""
    ck, ps, group = tr.config.checkpoint, tr.rt.ps, _control_group(tr)
    found = resolve_checkpoint(ck.load, ps, ck.exit_on_missing_checkpoint, group)
    if found is None:
        return None
    iteration, release = found
    iter_dir = os.path.join(ck.load, iteration_dir_name(iteration, release))
    checked, problem = _first_file_checked_once(tr, iter_dir, release)
    if problem is not None:
        raise exit_on_every_rank(problem, group)  # every rank has rank 0's problem
    saved, first_args, states, identity = checked
    tr.checkpoint_args = first_args  # for the resume's train-order check
    training = tr.optimizer is not None  # evaluation-only: the tokenizer warning alone
    warnings = [tokenizer_warning(first_args, tr.config.args, iter_dir, not training),
                norm_epsilon_warning(first_args, tr.config.args, iter_dir)]
    if training:
        warnings = [seq_length_warning(first_args, tr.config.args, iter_dir),
                    data_order_warning(first_args, tr.config.args, iter_dir)] + warnings
    for warning in warnings:
        if warning is not None:
            print_rank_0(warning)
    if not isinstance(first_args, dict):  # Megatron-LM says so too
        print_rank_0(f" > the checkpoint in {iter_dir} stores no arguments: this run's model "
                     "flags are not checked against it (tensor shapes still are)")
    for note in states.notes:
        print_rank_0(note)
    loaded = _Loaded(0 if release else iteration, release, {}, None, None,
                     states.with_optimizer, states.with_rng, iter_dir)
    if not needs_resharding(saved, trainer_layout(tr), states.with_optimizer):
        state = load_rank_file(ck.load, iteration, release, ps, group)
        path = _rank_file(ck.load, iteration, release, ps)
        return loaded._replace(state=state, path=path,
                               error=rank_file_problem(state, path, identity))
    print_rank_0(f" loading checkpoint from {ck.load} at iteration {iteration} "
                 f"(resharding: each rank reads the shards of its own parameters)")
    try:
        payload, distrib, text = reshard_for_trainer(tr, iter_dir, states.with_optimizer,
                                                     saved, first_args, identity)
    except SystemExit as exc:
        return loaded._replace(error=exit_message(exc))
    print_rank_0(f" > {text}")
    return loaded._replace(state=payload, param_state=distrib, converted=text)


def _restore_counters(tr, loaded: _Loaded) -> None:
    """Iteration and sample counters: all from the checkpoint on a resume (counters it
    lacks assumed as Megatron does: `assumed_counters`); with --finetune none; from a
    release checkpoint only the consumed samples (from its args, as Megatron). With
    --rampup-batch-size the current global batch then follows the consumed samples, as
    Megatron's load sets its micro-batch count: an evaluation before any step (--skip-train)
    draws batches of the size the ramp had reached."""
    if tr.config.checkpoint.finetune:
        return
    args = loaded.state.get("args") or {}
    from_args = {"consumed_train_samples": args.get("consumed_train_samples", 0),
                 "consumed_valid_samples": args.get("consumed_valid_samples", 0)}
    st = tr.state
    if loaded.release:
        st.load_state_dict(from_args)
    else:
        st.load_state_dict(loaded.state.get("train_state",
                                            {"iteration": loaded.iteration, **from_args}))
        st.consumed_train_samples, st.consumed_valid_samples, note = assumed_counters(
            tr.config, st.iteration, st.consumed_train_samples, st.consumed_valid_samples)
        if note:
            print_rank_0(note)
    update_micro_batches(tr.config.data, st.consumed_train_samples, tr.rt.ps.dp_size)


class _FileRejected(SystemExit):
    """A state of this rank's file its loader rejected: `variants` is the pair of messages
    for the load's agreement (megatron/agreed_exit.py `agreed_report`): when every rank
    rejects its file the run's flags differ from the checkpoint's (the loader's advice);
    when the other ranks loaded theirs, this file alone is bad and no flag fixes it."""

    def __init__(self, loaded: _Loaded, path: Optional[str], exc: ValueError):
        every = f"error: loading {path or loaded.iter_dir}: {exc}"
        what = path or f"the shard files of {loaded.iter_dir} this rank read"
        alone = (f"error: {what} does not fit this run, while the other ranks loaded their "
                 f"files of the same checkpoint: {exc}. This file alone is bad (copied in "
                 "from another checkpoint or damaged), so no flag fixes it: copy it again "
                 "from the checkpoint it belongs to, or point --load at another checkpoint")
        super().__init__(every)
        self.variants = (every, alone)


def _load_distrib_shards(tr, loaded: _Loaded) -> None:
    """The distributed optimizer's shards: those resharding built, or this rank's
    distrib_optim.pt, checked against its model file (`distrib_file_problem`)."""
    param_state, path = loaded.param_state, None
    if param_state is None:
        ck, ps = tr.config.checkpoint, tr.rt.ps
        param_state = load_extra_file(ck.load, loaded.iteration, ps, "distrib_optim.pt",
                                      release=loaded.release)
        path = os.path.join(os.path.dirname(loaded.path), "distrib_optim.pt")
        param_state, record = split_distrib_identity(param_state)
        problem = distrib_file_problem(record, path, loaded.state, loaded.path)
        if problem:
            raise SystemExit(problem)
    try:  # shards of another model, precision or virtual-pipeline layout
        tr.optimizer.load_parameter_state(param_state)
    except ValueError as exc:
        raise _FileRejected(loaded, path, exc) from None


def _load_optimizer(tr, loaded: _Loaded) -> None:
    """Optimizer (and the distributed optimizer's shards) and scheduler states; SystemExit
    when they do not fit the run (the scheduler's saved values contradict the command line,
    the optimizer's groups differ, the distributed optimizer's file is missing, from another
    step, or holds shards of another model, precision or virtual-pipeline layout)."""
    state = loaded.state
    try:
        optimizer_notes = tr.optimizer.load_state_dict(state["optimizer"]) or []
    except ValueError as exc:
        raise _FileRejected(loaded, loaded.path, exc) from None
    if hasattr(tr.optimizer, "load_parameter_state"):  # the distributed optimizer's shards
        _load_distrib_shards(tr, loaded)
    try:
        notes = tr.scheduler.load_state_dict(state["opt_param_scheduler"])
    except ValueError as exc:
        raise _FileRejected(loaded, loaded.path, exc) from None
    for note in notes:  # a value one of the two scheduler flags settled
        print_rank_0(f" > learning-rate schedule: {note}")
    for note in optimizer_notes:  # a hyper-parameter changed since the checkpoint
        print_rank_0(f" > optimizer: {note}")


def load_trainer_checkpoint(tr, rollback: bool = False) -> Optional[str]:
    """Restore model, optimizer, scheduler, RNG and counters from --load, if present.

    Megatron's rules: --finetune and release checkpoints start at iteration 0 with fresh
    optimizer, scheduler and RNG (a release keeps its consumed samples); --no-load-optim /
    --no-load-rng skip those states. A checkpoint saved with another layout is resharded on
    load (see `_load_trainer_payload`); returns the description of that conversion, else
    None. A checkpoint that does not fit the run exits every rank (collective: the
    ranks agree on each step's failures, megatron/agreed_exit.py), printed once.
    `rollback`: --nan-loss-policy rollback reloads a checkpoint of the live trainer (its
    --no-load-optim stands for the run's --no-save-optim)."""
    ck = tr.config.checkpoint
    loaded = _load_trainer_payload(tr)
    if loaded is None:
        return None
    agree(loaded.error or _restore_states(tr, loaded), _control_group(tr))
    if tr.optimizer is not None and not loaded.with_optimizer and ck.no_load_optim \
            and not (ck.finetune or loaded.release):
        print_rank_0(_optimizer_not_loaded_note(loaded.iteration, rollback))
    note = rounded_weights_note(loaded.state.get("args"), tr.config.args, ck,
                                loaded.with_optimizer)
    if tr.optimizer is not None and note:
        print_rank_0(note)
    if ck.finetune or loaded.release:
        what = "--finetune" if ck.finetune else "a release checkpoint"
        print_rank_0(f" > loaded weights from {ck.load} ({what}: iteration 0, optimizer, "
                     f"scheduler and RNG start fresh; consumed samples "
                     f"{tr.state.consumed_train_samples})")
    if not (ck.finetune or loaded.release) and same_dir(ck.load, ck.save):
        tr.own_checkpoints.setdefault(loaded.iteration, "resumed from")
    start = 0 if ck.finetune or loaded.release else loaded.iteration  # Megatron's line
    print_rank_0(f"  successfully loaded checkpoint from {ck.load} at iteration {start}")
    return loaded.converted


def _optimizer_not_loaded_note(iteration: int, rollback: bool) -> str:
    """What a load without the optimizer state does to the optimizer and the schedule: a
    --no-load-optim resume starts both fresh; a rollback to a --no-save-optim checkpoint
    leaves the live ones as they are (nothing resets them)."""
    if rollback:
        return (" > the checkpoint holds no optimizer state (--no-save-optim): the rollback "
                f"restores the weights of iteration {iteration}; the optimizer state and the "
                "learning-rate schedule go on as they were before the NaN (neither reset "
                "nor the checkpoint's)")
    return (" > --no-load-optim: the optimizer state and the learning-rate schedule start "
            "fresh; the schedule counts samples from 0 again (warmup first) while the run "
            f"goes on from iteration {iteration}, as in Megatron-LM")


def _restore_states(tr, loaded: _Loaded) -> Union[None, str, Tuple[str, str]]:
    """Weights, counters, optimizer and scheduler, RNG from `loaded` into the trainer; the
    message of this rank's failure (a checkpoint that does not fit; any other exception
    but running out of memory: its file holds something its loaders do not expect,
    `_unexpected_content_message`; a state its loader rejects: the pair of messages of
    `_FileRejected`), else None. Local: the caller's agreement decides for
    every rank -- raising here left the other ranks waiting in it."""
    try:
        load_model_state_dicts(tr.model, loaded.state, loaded.iter_dir)
        _restore_counters(tr, loaded)
        if loaded.with_optimizer:
            _load_optimizer(tr, loaded)
        elif tr.optimizer is not None:  # None: an evaluation-only trainer (no main params)
            tr.optimizer.reload_model_params()
        if loaded.with_rng and "rng_state" in loaded.state:  # not kept when tp or pp changed
            rng, note = _saved_rng_state(tr, loaded.state["rng_state"])
            other_device = set_rng_state(rng, tr.rt.rng_tracker) if rng is not None else None
            for text in (note, other_device):
                if text:
                    print_rank_0(f" > {text}")
    except SystemExit as exc:
        return getattr(exc, "variants", None) or exit_message(exc)
    except Exception as exc:  # noqa: BLE001 -- one rank alone: reported in the agreement
        if out_of_memory_kind(exc):
            raise  # the out-of-memory report names it
        return _unexpected_content_message(loaded, exc)
    return None


def _unexpected_content_message(loaded: _Loaded, exc: Exception) -> str:
    """The message for an exception restoring this rank's states: the file (or the
    checkpoint directory, when resharded from several), the error and where it was raised
    (an error of this program's own is told from a damaged file by it), and the fix."""
    what = loaded.path or f"the shard files of {loaded.iter_dir}"
    fix = (f"Copy {loaded.path} again from the checkpoint it belongs to" if loaded.path
           else f"Check the files of {loaded.iter_dir}")
    return (f"error: cannot restore the states held in {what}: {type(exc).__name__}: {exc} "
            f"({_raised_at(exc)}): its contents are not what a checkpoint of this layout "
            f"holds. {fix}, or point --load at another checkpoint")


def _raised_at(exc: BaseException) -> str:
    """'raised at FILE:LINE in FUNCTION' of `exc`'s innermost frame: a damaged file and an
    error of this program's own are told apart by it."""
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return f"raised at {os.path.basename(where.filename)}:{where.lineno} in {where.name}"


def rollback_iteration(tr, iteration: int) -> Tuple[int, str]:
    """(iteration, origin) of the checkpoint `--nan-loss-policy rollback` reloads after the
    NaN loss at `iteration`: the last one in --save (its tracker), which must be one this
    run saved or resumed from (`tr.own_checkpoints`, kept by this process). Another run's
    checkpoint in --save -- beyond the NaN or below it -- would continue that run's
    training, possibly with other flags or data: SystemExit naming it. Limit: only this
    process's own saves and its resume count, so a job relaunched with --load elsewhere
    does not own the checkpoints its earlier launch left in --save."""
    ck = tr.config.checkpoint
    wait_for_async_save(tr)  # the checkpoint being written may be the last one
    tracker = read_tracker(ck.save)[0] if ck.save else None
    if not tracker:
        raise SystemExit(f"error: NaN/Inf loss at iteration {iteration} and no checkpoint in "
                         f"--save to roll back to; stopping")
    if tracker in tr.own_checkpoints:
        what = tr.own_checkpoints[tracker]
        return tracker, f"the checkpoint this run {what}, in --save {ck.save}"
    head = (f"error: NaN/Inf loss at iteration {iteration}, and the last checkpoint in --save "
            f"{ck.save} is iteration {tracker}, which this run ")
    fix = f"Resume with --load {ck.save}, or train with another --save directory"
    if tracker >= iteration:
        raise SystemExit(head + "has not reached: an earlier run saved it there (this one did "
                         "not resume from it), so there is no checkpoint of this run to roll "
                         f"back to; stopping. {fix}")
    start = ("started from scratch" if not tr.start_iteration
             else f"started at iteration {tr.start_iteration} from --load {ck.load}")
    raise SystemExit(head + f"neither saved nor resumed from: an earlier run saved it there "
                     f"(this run {start}), and rolling back to it "
                     "would continue that run's training; stopping. " + fix
                     + " (a --save-interval that saves before a NaN gives a rollback "
                     "this run's own checkpoint)")
