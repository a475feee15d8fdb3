"""How long a run trains and how its learning rate is scheduled (Megatron-LM 23.05 rules).

A run is iteration-based (`--train-iters`) or sample-based (`--train-samples`); each allows
only its own family of schedule flags. `--rampup-batch-size` needs a sample-based run. All
schedule lengths are in SAMPLES, as Megatron's scheduler counts them; the warmup
`fraction x decay` stays fractional.

Called by `arguments_validate.validate_args` in this order: `check_run_length` (once the
global batch is known), `resolve_iterations` (ramp-up; train_iters of sample-based runs),
`schedule_steps` (also used by `build_config`) and `warn_unfinished_warmup`.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from megatron.arguments_common import ArgumentsError, note, spelled, warn
from megatron.microbatches import parse_rampup, rampup_consumed_samples, rampup_train_iters

# mode -> (dest of the other mode's flag, its only allowed value, what to use instead)
_OTHER_MODE = {
    "iteration": (("lr_decay_samples", None, "--lr-decay-iters"),
                  ("lr_warmup_samples", 0, "--lr-warmup-iters or --lr-warmup-fraction")),
    "sample": (("lr_decay_iters", None, "--lr-decay-samples"),
               ("lr_warmup_iters", 0, "--lr-warmup-samples or --lr-warmup-fraction")),
}


def check_run_length(ns, origins: Optional[Mapping[str, str]] = None) -> None:
    """--train-iters xor --train-samples, and the schedule flags each mode allows (Megatron's
    asserts): an iteration-based run takes no *-samples flag, a sample-based run no *-iters
    flag; with --lr-warmup-fraction the mode's warmup count must stay 0."""
    origins = origins or {}
    if ns.train_iters is not None and ns.train_samples is not None:
        raise ArgumentsError(f"--train-iters {ns.train_iters} and --train-samples "
                             f"{ns.train_samples} are exclusive; pass one")
    if ns.train_iters and ns.rampup_batch_size is not None:
        raise ArgumentsError("--rampup-batch-size needs a sample-based run: use --train-samples "
                             f"instead of --train-iters {ns.train_iters}")
    if ns.train_iters:
        mode, run, warmup = "an iteration", f"--train-iters {ns.train_iters}", "lr_warmup_iters"
    elif ns.train_samples:
        mode, run, warmup = "a sample", f"--train-samples {ns.train_samples}", "lr_warmup_samples"
    else:
        return
    for dest, allowed, instead in _OTHER_MODE[mode.split()[1]]:
        if getattr(ns, dest) != allowed:
            raise ArgumentsError(f"{spelled(ns, dest, origins)} cannot be used in {mode}-based "
                                 f"run ({run}); use {instead}")
    if ns.lr_warmup_fraction is not None and getattr(ns, warmup) != 0:
        flag = "--" + warmup.replace("_", "-")
        raise ArgumentsError(
            f"{spelled(ns, 'lr_warmup_fraction', origins)} and {spelled(ns, warmup, origins)} "
            f"both set the warmup: with --lr-warmup-fraction set, {flag} must be 0; pass only "
            "one of them")


def resolve_iterations(ns) -> None:
    """--rampup-batch-size: Megatron's checks (the namespace keeps the strings, as
    Megatron-LM's arguments dump shows them; the config gets ints: build_config);
    then train_iters of a sample-based run (train_samples // global batch, or Megatron's
    count through the ramp-up), or --lr-decay-iters' default of an iteration-based one;
    a --log-interval longer than the run is warned."""
    interleaved = ns.virtual_pipeline_model_parallel_size is not None
    try:
        rampup = parse_rampup(ns.rampup_batch_size, ns.global_batch_size, ns.micro_batch_size,
                              ns.data_parallel_size,
                              ns.pipeline_model_parallel_size if interleaved else 1)
    except ValueError as e:
        raise ArgumentsError(str(e)) from None
    if rampup is not None:
        note(f"will use batch size rampup starting from global batch size {rampup[0]} to "
             f"global batch size {ns.global_batch_size} with batch size increments {rampup[1]} "
             f"over {rampup[2]} samples.")
        if rampup[0] == ns.global_batch_size:  # Megatron-LM divides by zero increments
            warn(f"--rampup-batch-size {' '.join(map(str, rampup))}: START is already "
                 f"--global-batch-size {ns.global_batch_size}, so the batch never ramps up; "
                 "pass a smaller START to ramp")
    if not ns.train_samples:
        if ns.lr_decay_iters is None:
            ns.lr_decay_iters = ns.train_iters
        _check_log_interval(ns)
        return
    gbs = ns.global_batch_size
    ns.train_iters = ns.train_samples // gbs
    if rampup is not None:
        ns.train_iters = rampup_train_iters(ns.train_samples, rampup, gbs)
        if ns.train_samples <= rampup[2] and rampup[0] < gbs:  # START == gbs: no ramp
            consumed = rampup_consumed_samples(ns.train_iters, rampup, gbs)
            warn(f"--rampup-batch-size {' '.join(map(str, rampup))} ramps up over {rampup[2]} "
                 f"samples but --train-samples is {ns.train_samples}: the run ends during the "
                 f"ramp-up, after {ns.train_iters} iterations ({consumed} samples, Megatron-LM's "
                 f"count), before the global batch reaches {gbs}")
    if ns.train_iters == 0 and not ns.skip_train:
        warn(f"--train-samples {ns.train_samples} is less than one global batch ({gbs}): "
             "no training iteration will run")
    _check_log_interval(ns)


def _check_log_interval(ns) -> None:
    """A run shorter than --log-interval prints no iteration line at all (the line comes at
    multiples of it, as in Megatron-LM): a short test run with the default 100 shows no
    loss and looks stuck. Warned."""
    if ns.train_iters and not ns.skip_train and ns.log_interval > ns.train_iters:
        warn(f"--log-interval {ns.log_interval} is larger than the run's {ns.train_iters} "
             "training iterations: no iteration line (loss, learning rate, progress) will be "
             f"printed; pass a --log-interval of at most {ns.train_iters} (e.g. "
             f"{max(1, ns.train_iters // 10)}) to see them")


def schedule_steps(ns) -> Dict[str, Any]:
    """LR/WD schedule lengths in SAMPLES, as Megatron's scheduler counts them:
    iteration-based: decay = (--lr-decay-iters or --train-iters) x global batch, warmup =
    fraction x decay or --lr-warmup-iters x global batch; sample-based: decay =
    --lr-decay-samples or --train-samples, warmup = fraction x decay or --lr-warmup-samples.
    A fractional warmup stays fractional. Raises unless 0 <= warmup < decay."""
    gbs = ns.global_batch_size
    if ns.train_samples:
        decay = ns.lr_decay_samples if ns.lr_decay_samples is not None else ns.train_samples
        warmup = (ns.lr_warmup_fraction * decay if ns.lr_warmup_fraction is not None
                  else ns.lr_warmup_samples)
        wd_incr = ns.train_samples
    else:
        iters = ns.lr_decay_iters if ns.lr_decay_iters is not None else ns.train_iters
        decay = (iters or 0) * gbs
        warmup = (ns.lr_warmup_fraction * decay if ns.lr_warmup_fraction is not None
                  else ns.lr_warmup_iters * gbs)
        wd_incr = (ns.train_iters or 0) * gbs
    if ns.skip_train and not decay:
        decay, warmup, wd_incr = 1, 0, 1
    if decay <= 0 or not 0 <= warmup < decay:
        raise _schedule_error(ns, warmup, decay)
    if isinstance(warmup, float) and warmup.is_integer():
        warmup = int(warmup)
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wd_incr_steps": max(wd_incr, 1)}


def _schedule_error(ns, warmup: float, decay: float) -> ArgumentsError:
    """A warmup count not shorter than the decay: the two flags that set them, with the
    values as typed (a --config preset's lr-warmup-iters under a short --train-iters
    try-out), and a warmup that fits."""
    if ns.lr_warmup_fraction is None and decay > 0 <= warmup:
        if ns.train_samples:
            unit, warm, count, length = ("samples", "--lr-warmup-samples",
                                         ns.lr_warmup_samples, decay)
            given = ("lr_decay_samples" if ns.lr_decay_samples is not None
                     else "train_samples")
        else:
            unit, warm, count, length = ("iterations", "--lr-warmup-iters", ns.lr_warmup_iters,
                                         decay // ns.global_batch_size)
            given = ("lr_decay_iters" if ns.lr_decay_iters not in (None, ns.train_iters)
                     else "train_iters")
        decay_flag = "--" + given.replace("_", "-")
        return ArgumentsError(
            f"{warm} {count} is not shorter than the {length:g} {unit} the learning rate "
            f"decays over ({decay_flag} {getattr(ns, given)}): pass a smaller {warm} (e.g. "
            f"{int(length) // 10}), or a longer {decay_flag}")
    return ArgumentsError(
        f"learning-rate warmup ({warmup:g} samples) must be >= 0 and shorter than the decay "
        f"({decay:g} samples); lower --lr-warmup-iters/--lr-warmup-samples/"
        "--lr-warmup-fraction or raise --lr-decay-iters/--lr-decay-samples")


def warn_unfinished_warmup(ns, warmup: float) -> None:
    """A run that ends inside the learning-rate warmup never trains at --lr: its lr climbs
    to lr x (samples trained / warmup samples) and stops there (e.g. a --config preset's
    --lr-warmup-samples kept under a short --train-samples try-out). Megatron-LM runs it
    in silence; warned with the lr reached and the fix."""
    if ns.skip_train or not ns.train_iters or not warmup:
        return
    gbs = ns.global_batch_size
    # the namespace keeps --rampup-batch-size as its strings (resolve_iterations)
    trained = (rampup_consumed_samples(ns.train_iters,
                                       tuple(int(v) for v in ns.rampup_batch_size), gbs)
               if ns.rampup_batch_size else ns.train_iters * gbs)
    if trained >= warmup:
        return
    if ns.lr_warmup_fraction is not None:
        flag = f"--lr-warmup-fraction {ns.lr_warmup_fraction:g}"
    elif ns.train_samples:
        flag = f"--lr-warmup-samples {ns.lr_warmup_samples}"
    else:
        flag = f"--lr-warmup-iters {ns.lr_warmup_iters}"
    warn(f"{flag} makes a learning-rate warmup of {warmup:g} samples, but the run trains "
         f"only {trained} ({ns.train_iters} iterations): the learning rate ends at "
         f"{ns.lr * trained / warmup:.3E}, {100.0 * trained / warmup:.2g}% of --lr {ns.lr:g}, "
         "and never decays; shorten the warmup or lengthen the run")
