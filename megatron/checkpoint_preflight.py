"""What `--load` would do, found without building the model: `--dry-run`'s checkpoint part.

The real load (megatron/trainer_checkpoint.py) goes: tracker file -> iteration directory ->
the first rank's file (its arguments against the run's, the states to load being there) ->
every rank's file (or resharding, when tp / pp / chunks per rank / optimizer kind differ)
-> weights -> counters -> optimizer and learning-rate schedule; it stops at the first
problem. `preflight_load` walks the same steps with the same checks and messages, reading
only the tracker, the directory listings and the rank files' structure (memory-mapped: no
tensor is read), and collects every problem. One process, no collective; nothing on disk
changes (an interrupted re-save the real run would restore is only reported).

Not checked: what needs the weights themselves -- a checkpoint whose stored arguments do
not describe its tensors (an older writer) fails in the real load only.
"""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Dict, List, NamedTuple, Optional, Tuple

from megatron.arguments_inputs import vocab_assumed
from megatron.checkpoint_args import (
    data_order_warning,
    norm_epsilon_warning,
    seq_length_warning,
    tokenizer_warning,
)
from megatron.checkpoint_dirs import (
    incomplete_checkpoint_message,
    is_legacy_model_file,
    legacy_optimizer_message,
    model_file,
    other_checkpoints_hint,
    refuse_untracked_checkpoints,
)
from megatron.checkpoint_model_args import checkpoint_args_message
from megatron.checkpoint_reshard import (
    DISTRIB_FILENAME,
    Layout,
    inspect_checkpoint,
    load_shard,
    model_keys,
    needs_resharding,
)
from megatron.checkpointing import (
    exit_on_missing_message,
    iteration_dir_name,
    malformed_tracker_message,
    missing_iteration_dir_message,
    rank_dir_name,
    read_tracker,
    tracker_path,
)
from megatron.config import CheckpointConfig, Config


class LoadStates(NamedTuple):
    """Which states a load restores, and what stops it or is worth a word."""

    with_optimizer: bool  # the optimizer and the learning-rate schedule
    with_rng: bool
    problems: List[str]  # each one stops the real load (its message)
    notes: List[str]


def states_to_load(ck: CheckpointConfig, release: bool, first: dict, path: str,
                   skip_train: bool = False) -> LoadStates:
    """(load the optimizer + scheduler, load the RNG) as Megatron decides: neither for
    --finetune or a release checkpoint, nor what --no-load-optim / --no-load-rng exclude.
    Neither for `skip_train` (--skip-train: the run only evaluates and saves nothing, so
    those states are never used; Megatron loads them, and a schedule that differs from the
    command line, e.g. no --train-iters given, or a checkpoint saved without them, stopped
    the evaluation).
    A problem when a state to load is not in the checkpoint (saved with --no-save-optim /
    --no-save-rng), naming the flag that skips it, or when the optimizer state is in
    Megatron-LM 23.04's per-data-parallel files, which are not read; RNG states that an
    offline resharding dropped start fresh (a note). `first` is the first rank's payload,
    read from `path`."""
    fresh = ck.finetune or release or skip_train
    with_optimizer = not (fresh or ck.no_load_optim)
    with_rng = not (fresh or ck.no_load_rng)
    problems, notes = [], []
    if with_optimizer and is_legacy_model_file(path):
        problems.append(legacy_optimizer_message(path))
    elif with_optimizer and ("optimizer" not in first or "opt_param_scheduler" not in first):
        problems.append(f"error: unable to load optimizer from checkpoint {path}: it holds no "
                        "optimizer state (saved with --no-save-optim, or converted from a "
                        "checkpoint that had none). Specify --no-load-optim "
                        "or --finetune to prevent attempting to load the optimizer state")
    if with_rng and "rng_state" not in first:
        saved_without = (first.get("args") or {}).get("no_save_rng", True)
        if saved_without:  # --no-save-rng, or a writer that does not say
            problems.append(f"error: unable to load rng state from checkpoint {path}: it holds "
                            "no RNG state (saved with --no-save-rng). Specify --no-load-rng or "
                            "--finetune to prevent attempting to load the rng state")
        else:  # saved with RNG states, dropped by tools/checkpoint_convert.py (per rank)
            notes.append(f" > {path} holds no RNG states (resharded to another layout): RNG "
                         "states start fresh")
    return LoadStates(with_optimizer, with_rng, problems, notes)


def no_weights_message(iter_dir: Optional[str], state: dict) -> str:
    """The error of a load whose file `state` (of `iter_dir`, where known) holds no model
    entry ("model", or "model0", "model1", ... with virtual pipeline stages)."""
    root, name = os.path.split(os.path.normpath(iter_dir or "."))
    return (f"error: checkpoint {iter_dir or ''} holds no model weights (no 'model' entry; "
            f"its entries: {', '.join(sorted(map(str, state))) or 'none'}): it was not "
            "written by a training run, or was saved without the model. Load another "
            f"checkpoint: {other_checkpoints_hint(root or '.', name)}")


class Preflight(NamedTuple):
    """`preflight_load`'s findings."""

    lines: List[str]  # what the load would do
    problems: List[str]  # every problem that would stop the real run (its message)


def run_layout(config: Config) -> Layout:
    """The layout the run's Trainer will have (`trainer_layout`), from its config."""
    p, o = config.parallel, config.optimizer
    kind = ("distributed" if p.use_distributed_optimizer
            else "mixed" if (o.fp16 or o.bf16) else "fp32")
    return Layout(p.tp_size, p.pp_size, p.virtual_pp_size or 1, kind)


def _find_iteration(ck: CheckpointConfig) -> Tuple[Optional[Tuple[int, bool, str]], Preflight]:
    """(iteration, release, its directory) the tracker names, or None with why: the
    real run's `resolve_checkpoint`, without the collective and without repairing."""
    root = ck.load
    try:
        iteration, release = read_tracker(root)
    except ValueError as exc:
        return None, Preflight([], [malformed_tracker_message(root, exc)])
    if iteration is None:
        if ck.exit_on_missing_checkpoint:  # (a --load that does not exist: a missing input)
            problems = [exit_on_missing_message(tracker_path(root))] if os.path.isdir(root) else []
            return None, Preflight([], problems)
        try:
            refuse_untracked_checkpoints(root)
        except SystemExit as exc:
            return None, Preflight([], [str(exc.code)])
        return None, Preflight([f"no checkpoint ({tracker_path(root)} does not exist): starts "
                                "from scratch (random weights, iteration 0)"], [])
    iter_dir = os.path.join(root, iteration_dir_name(iteration, release))
    if os.path.isdir(iter_dir):
        return (iteration, release, iter_dir), Preflight([], [])
    if os.path.isdir(iter_dir + ".old"):
        return (iteration, release, iter_dir + ".old"), Preflight(
            [f"{iter_dir} is missing but {iter_dir}.old is there (an interrupted re-save): "
             "the run restores it first"], [])
    return None, Preflight([], [missing_iteration_dir_message(root, iteration, release)])


def _shard_problems(iter_dir: str, saved: Layout, first_path: str,
                    distrib_files: bool) -> List[str]:
    """Every rank file of the saved layout (and `distrib_optim.pt` beside it when
    `distrib_files`) missing or unreadable (each one's structure is read, memory-mapped)."""
    missing, problems = [], []
    for p in range(saved.pp):
        for t in range(saved.tp):
            rank_dir = os.path.join(iter_dir, rank_dir_name(t, p, saved.pp))
            path = model_file(rank_dir)
            extra = [os.path.join(rank_dir, DISTRIB_FILENAME)] if distrib_files else []
            missing += [f for f in [path] + extra if not os.path.isfile(f)]
            for f in [path] + extra:
                if f != first_path and os.path.isfile(f):
                    try:
                        load_shard(f)
                    except SystemExit as exc:
                        problems.append(str(exc.code))
    if missing:  # as the run says it (the directories themselves are complete: complete_layout)
        problems.insert(0, incomplete_checkpoint_message(
            iter_dir, [os.path.relpath(f, iter_dir) for f in missing],
            f"the directories say tp {saved.tp} x pp {saved.pp}"))
    return problems


def _resume_lines(ck: CheckpointConfig, iteration: int, release: bool, iter_dir: str,
                  first: dict, states: LoadStates, consumed: int) -> List[str]:
    """The iteration the run starts at (after `consumed` training samples) and the states
    it loads."""
    if ck.finetune:
        return [f"finetune: weights only from {iter_dir}, iteration 0 (optimizer, "
                "learning-rate schedule, RNG and sample counts start fresh)"]
    if release:
        return [f"release checkpoint {iter_dir}: weights only, iteration 0 (optimizer, "
                f"learning-rate schedule and RNG start fresh; consumed samples {consumed})"]
    loads = ["model weights"]
    if states.with_optimizer:
        loads.append("optimizer and learning-rate schedule")
    if states.with_rng:
        loads.append("RNG states")
    lines = [f"resumes from iteration {iteration} ({iter_dir}), consumed samples {consumed}",
             f"loads: {', '.join(loads)}"]
    if not (states.with_optimizer or states.with_rng or ck.no_load_optim or ck.no_load_rng):
        lines.append("--skip-train: evaluates only, so the optimizer, learning-rate schedule "
                     "and RNG states are not loaded")
    elif ck.no_load_optim:
        lines.append("--no-load-optim: the optimizer state and the learning-rate schedule "
                     "start fresh (the schedule counts samples from 0 again, warmup first)")
    if ck.no_load_rng:
        lines.append("--no-load-rng: the RNG states start fresh")
    return lines


def _layout_lines(saved: Layout, run: Layout, states: LoadStates, num_files: int) -> List[str]:
    if not needs_resharding(saved, run, states.with_optimizer):
        return [f"layout: saved with {saved.describe()}; each rank reads its own shard"]
    text = (f"resharded on load: saved with {saved.describe()}, this run has "
            f"{run.describe()}; every rank reads all {num_files} shard file(s) and takes its "
            "slice")
    if states.with_rng and (saved.tp, saved.pp) != (run.tp, run.pp):
        text += "; RNG states start fresh (they are per rank)"
    return [text]


def run_goal(t) -> str:
    """The run's length as its flag gives it (`t`: the training config)."""
    return (f"--train-samples {t.train_samples} ({t.train_iters} iterations)" if t.train_samples
            else f"--train-iters {t.train_iters}")


def past_the_run_note(t, iteration, release: bool) -> str:
    """A note for the schedule-mismatch error when the checkpoint already reaches the run's
    last iteration: either scheduler flag would then only load it and stop (a lowered
    --train-iters), so the user learns that before retrying. '' otherwise."""
    if release or not isinstance(iteration, int) or iteration < t.train_iters:
        return ""
    return (f"\nnote: the checkpoint at iteration {iteration} already reaches "
            f"{run_goal(t)}, so with either flag this run trains nothing; to train on, "
            f"pass a run longer than {iteration} iterations")


def _schedule_check(config: Config, entry: dict, iter_dir: str) -> Preflight:
    """The learning-rate schedule's values against the run's (`check_state_dict` of a
    scheduler built from the run's config, as the Trainer builds it)."""
    from megatron.core.optimizer import OptimizerParamScheduler

    scheduler = OptimizerParamScheduler(SimpleNamespace(param_groups=[]), config.optimizer)
    notes, errors = scheduler.check_state_dict(entry)
    return Preflight([f"learning-rate schedule: {n}" for n in notes],
                     [f"error: loading {iter_dir}: {e}" for e in errors])


def _saved_param_groups(entry) -> Optional[list]:
    """The parameter groups of a checkpoint's "optimizer" entry (fp32: the torch state
    dict; mixed precision and distributed: under its own "optimizer"), or None."""
    inner = entry.get("optimizer", entry) if isinstance(entry, dict) else None
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    return groups if isinstance(groups, list) else None


def _optimizer_check(config: Config, entry, iter_dir: str) -> Preflight:
    """The saved optimizer kind against --optimizer, and the hyper-parameters the command
    line changes (the real load's `settle_groups`, on the run's values)."""
    from megatron.core.optimizer.inner_state import settle_groups

    saved = _saved_param_groups(entry)
    if not saved:
        return Preflight([], [])
    opt = config.optimizer
    run = ({"betas": (opt.adam_beta1, opt.adam_beta2), "eps": opt.adam_eps}
           if opt.optimizer == "adam" else {"momentum": opt.sgd_momentum})
    try:
        notes = settle_groups(saved, [run] * len(saved))[1]
    except ValueError as exc:
        return Preflight([], [f"error: loading {iter_dir}: {exc}"])
    return Preflight([f"optimizer: {n}" for n in notes], [])


def preflight_load(config: Config, evaluation: bool = False) -> Preflight:
    """What loading --load would do for this run, and every problem that would stop it
    (see the module doc). Nothing to say without --load. `evaluation`: the run only
    evaluates the weights (its config skips the optimizer and RNG states)."""
    ck = config.checkpoint
    if not ck.load:
        return Preflight([], [])
    found, result = _find_iteration(ck)
    if found is None:
        return result
    iteration, release, iter_dir = found
    lines, problems = list(result.lines), list(result.problems)
    try:
        saved, first_path, first = inspect_checkpoint(iter_dir)
    except SystemExit as exc:
        return Preflight(lines, problems + [str(exc.code)])
    if not model_keys(first):  # every load reads the weights (also --finetune, a release)
        problems.append(no_weights_message(iter_dir, first))
    states = states_to_load(ck, release, first, first_path, config.training.skip_train)
    run = run_layout(config)
    if evaluation:
        what = "the release checkpoint" if release else f"iteration {iteration}"
        lines.append(f"evaluates the weights of {what} ({iter_dir})")
    else:
        consumed = (_consumed_train(config, iteration, first)[0] if not release else
                    (first.get("args") or {}).get("consumed_train_samples", 0))
        lines += _resume_lines(ck, iteration, release, iter_dir, first, states, consumed)
    lines += _layout_lines(saved, run, states, saved.tp * saved.pp)
    lines += [note.strip(" >") for note in states.notes]
    if not evaluation:
        for warning in (seq_length_warning(first.get("args"), config.args, iter_dir),
                        data_order_warning(first.get("args"), config.args, iter_dir),
                        tokenizer_warning(first.get("args"), config.args, iter_dir)):
            lines += [warning] if warning else []
    else:  # the scores read the run's token ids
        warning = tokenizer_warning(first.get("args"), config.args, iter_dir, evaluation=True)
        lines += [warning] if warning else []
    warning = norm_epsilon_warning(first.get("args"), config.args, iter_dir)
    lines += [warning] if warning else []
    # the saved distributed optimizer's state is in each rank's distrib_optim.pt: read by
    # the rank itself, or by every rank when resharding (the saved kind is the first rank's)
    distrib = states.with_optimizer and saved.optimizer == "distributed"
    problems += _shard_problems(iter_dir, saved, first_path, distrib)
    run_args = config.args
    if vocab_assumed(run_args):  # a dry run without the tokenizer files: no vocabulary to compare
        run_args = {k: v for k, v in run_args.items() if k != "padded_vocab_size"}
    args_error = checkpoint_args_message(first.get("args"), run_args, iter_dir, ck.finetune)
    problems += [args_error] if args_error else []
    problems += states.problems
    if states.with_optimizer:
        optimizer = _optimizer_check(config, first.get("optimizer"), iter_dir)
        lines += optimizer.lines
        problems += optimizer.problems
    if states.with_optimizer and isinstance(first.get("opt_param_scheduler"), dict):
        schedule = _schedule_check(config, first["opt_param_scheduler"], iter_dir)
        lines += schedule.lines
        problems += schedule.problems
        note = past_the_run_note(config.training, iteration, release) if schedule.problems else ""
        lines += [note.strip()] if note else []
    if not (evaluation or release or ck.finetune):
        lines += _assumed_counts_lines(config, iteration, first)
        budget = _sample_budget(config, iteration, first, states)
        lines += [budget] if budget else []
    return Preflight(lines, problems)


def _consumed_train(config: Config, iteration: int, first: dict) -> Tuple[int, Optional[str]]:
    """The training samples the resumed run takes as consumed, and the run's note when
    the checkpoint counts none (resume_samples.assumed_counters)."""
    from megatron.resume_samples import assumed_counters

    counts = first.get("train_state") or first.get("args") or {}
    train, _, note = assumed_counters(config, iteration,
                                      int(counts.get("consumed_train_samples") or 0), 1)
    return train, note


def _assumed_counts_lines(config: Config, iteration: int, first: dict) -> List[str]:
    _, note = _consumed_train(config, iteration, first)
    return [note.strip(" >")] if note else []


def _sample_budget(config: Config, iteration: int, first: dict,
                   states: LoadStates) -> Optional[str]:
    """The run's warning for a sample-based resume at another global batch size (see
    resume_samples.sample_budget_message), from the checkpoint's counts."""
    from megatron.resume_samples import sample_budget_message

    consumed, _ = _consumed_train(config, iteration, first)
    saved = first.get("opt_param_scheduler")
    goal = None
    if (states.with_optimizer and isinstance(saved, dict)
            and config.optimizer.use_checkpoint_opt_param_scheduler):
        goal = saved.get("wd_incr_steps")
    return sample_budget_message(config, iteration, consumed, goal)


__all__ = ["LoadStates", "states_to_load", "Preflight", "run_layout", "preflight_load"]


def rounded_weights_note(saved: Optional[Dict], run: Dict, ck, with_optimizer: bool
                         ) -> Optional[str]:
    """The note for an fp32 run that loads a bf16/fp16 checkpoint without its optimizer
    state (--no-load-optim, --finetune): the weights are the 16-bit copies, as in
    Megatron-LM; the fp32 main weights are left out with that state."""
    saved = saved or {}
    half = "bf16" if saved.get("bf16") else "fp16" if saved.get("fp16") else None
    if half is None or run.get("bf16") or run.get("fp16") or with_optimizer or \
            saved.get("no_save_optim") or not (ck.finetune or ck.no_load_optim):
        return None
    flag = "--finetune" if ck.finetune else "--no-load-optim"
    return (f" > the model takes the checkpoint's {half} weights (this run is fp32): its fp32 "
            f"main weights are optimizer state, which {flag} leaves out; load without "
            f"{flag} to go on from them")
