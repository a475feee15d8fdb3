"""Range checks of single flag values: what argparse accepts (an int, a float) but no run
can use, caught in validation, before any cross-flag rule and any process group.

The bounds follow what Megatron-LM 23.05 can run. A value it crashes on later is an error
here (--log-interval 0: ZeroDivisionError; --hidden-dropout 1.5: torch's Dropout;
--num-workers -1: the DataLoader); a value it reads as "off" stays valid (--eval-iters 0,
--save-interval 0: only the final checkpoint, --exit-interval 0; here also
--eval-interval 0: no evaluation during or after training); a value it reads as another setting is
taken with a warning (--clip-grad -1: no clipping, like 0). A tuning flag the run's other
choices leave unread (--hysteresis with bf16, --adam-beta2 with --optimizer sgd) is warned.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Set, Tuple

from megatron.arguments_common import (
    FLAG_SPECS,
    ArgumentsError,
    flag_for_dest,
    spelled,
    warn,
)

_Rule = Tuple[str, float, str, Optional[Callable]]
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 2.0 ** -126  # the smallest normal float32; its reciprocal is finite


def _uses_dynamic_loss_scale(ns) -> bool:
    return bool(ns.fp16) and not ns.loss_scale


# (dest, smallest valid value, what the flag means or how to turn it off, applies when).
# An unset (None) optional flag is not checked.
_AT_LEAST: Tuple[_Rule, ...] = (
    ("log_interval", 1, "iterations between log lines", None),
    ("tensorboard_log_interval", 1, "iterations between tensorboard scalars",
     lambda ns: ns.tensorboard_dir),
    ("eval_interval", 0, "iterations between evaluations; 0: no evaluation, during or after "
     "training", None),
    ("eval_iters", 0, "iterations per evaluation; 0: no evaluation", None),
    ("save_interval", 0, "iterations between checkpoints; 0: only the final one", None),
    ("exit_interval", 0, "exit when the iteration is a multiple of it; 0: never", None),
    ("exit_duration_in_mins", 0, "exit after this many minutes; 0: never", None),
    ("num_workers", 0, "data-loader worker processes; 0: a thread of the trainer loads",
     None),
    ("distributed_timeout_minutes", 1, "minutes a collective may wait", None),
    ("train_iters", 1, "pass --skip-train to only evaluate", lambda ns: not ns.skip_train),
    ("train_samples", 1, "pass --skip-train to only evaluate", lambda ns: not ns.skip_train),
    ("train_iters", 0, "iterations to train", None),
    ("train_samples", 0, "samples to train on", None),
    ("lr_decay_iters", 1, "iterations the learning rate decays over", None),
    ("lr_decay_samples", 1, "samples the learning rate decays over", None),
    ("lr_warmup_iters", 0, "warmup iterations", None),
    ("lr_warmup_samples", 0, "warmup samples", None),
    ("lr_warmup_fraction", 0, "fraction of the decay spent warming up", None),
    ("lr", 0, "the peak learning rate", None),
    ("weight_decay", 0, "the L2 regularization coefficient", None),
    ("init_method_std", 0, "standard deviation of the initial weights", None),
    ("adam_beta1", 0, "Adam's first-moment decay", lambda ns: ns.optimizer == "adam"),
    ("adam_beta2", 0, "Adam's second-moment decay", lambda ns: ns.optimizer == "adam"),
    ("adam_eps", 0, "Adam's denominator term", lambda ns: ns.optimizer == "adam"),
    ("sgd_momentum", 0, "SGD's momentum", lambda ns: ns.optimizer == "sgd"),
    ("hidden_dropout", 0, "a probability", None),
    ("attention_dropout", 0, "a probability", None),
    ("kv_channels", 1, "width of one attention head", None),
    ("rotary_percent", 0, "share of each head's channels that rotary embeddings rotate", None),
    ("layernorm_epsilon", 0, "added to the variance in every norm", None),
    ("ffn_hidden_size", 1, "width of the MLP", None),
    ("num_experts", 1, "experts per switch MLP; leave it unset for the dense MLP", None),
    ("vocab_size", 1, "NullTokenizer's token ids", lambda ns: ns.tokenizer_type == "NullTokenizer"),
    ("vocab_size", 2, "--mock-data's token ids are drawn below it",  # ValueError at the data
     lambda ns: ns.mock_data),
    ("ddp_bucket_size", 1, "elements per gradient all-reduce bucket", None),
    ("loss_scale", 0, "a fixed loss scale; 0 or unset: dynamic scaling with --fp16", None),
    ("loss_scale_window", 1, "clean iterations before the loss scale grows",
     _uses_dynamic_loss_scale),
    ("hysteresis", 1, "overflows tolerated before the loss scale drops",
     _uses_dynamic_loss_scale),
)

# (dest, meaning, applies when): values that must be > 0
_POSITIVE = (
    ("initial_loss_scale", "the first dynamic loss scale", _uses_dynamic_loss_scale),
    ("min_loss_scale", "the smallest dynamic loss scale", _uses_dynamic_loss_scale),
    ("rotary_base", "the rotary embeddings' frequency base", None),
    ("gpu_memory_gb", "GiB of memory per GPU for --dry-run's check; leave it unset to skip "
     "the check", None),
)

# Loss scales (float32 tensors) that are > 0 must not be below FLOAT32_TINY: a smaller one
# rounds to 0 or has an infinite reciprocal, so the gradients unscale to NaN after the
# overflow check has passed them and the step writes NaN weights. (dest, meaning, when)
_FLOAT32_NORMAL = (
    ("initial_loss_scale", "the first dynamic loss scale, a float32 whose reciprocal "
     "unscales the gradients", _uses_dynamic_loss_scale),
    ("min_loss_scale", "the smallest dynamic loss scale, a float32 whose reciprocal "
     "unscales the gradients", _uses_dynamic_loss_scale),
    ("loss_scale", "a fixed loss scale, a float32 whose reciprocal unscales the gradients",
     lambda ns: ns.loss_scale > 0),
)

# (dest, value it must stay below or at, inclusive?, meaning, applies when)
_AT_MOST = (
    ("hidden_dropout", 1, True, "a probability", None),
    ("attention_dropout", 1, True, "a probability", None),
    ("lr_warmup_fraction", 1, False, "fraction of the decay spent warming up", None),
    ("adam_beta1", 1, False, "Adam's first-moment decay", lambda ns: ns.optimizer == "adam"),
    ("adam_beta2", 1, False, "Adam's second-moment decay", lambda ns: ns.optimizer == "adam"),
    # Megatron-LM takes a larger one, and its momentum buffer then grows geometrically.
    ("sgd_momentum", 1, True, "SGD's momentum: the share of the last update kept",
     lambda ns: ns.optimizer == "sgd"),
    # The loss scale is a float32: a larger value is inf, and inf never backs off.
    ("initial_loss_scale", FLOAT32_MAX, True, "the first dynamic loss scale, a float32",
     _uses_dynamic_loss_scale),
    ("min_loss_scale", FLOAT32_MAX, True, "the smallest dynamic loss scale, a float32",
     _uses_dynamic_loss_scale),
    ("loss_scale", FLOAT32_MAX, True, "a fixed loss scale, a float32", None),
)


def _applies(ns, dest: str, when: Optional[Callable]) -> bool:
    return getattr(ns, dest, None) is not None and (when is None or bool(when(ns)))


# Float flags whose infinite value means something: no clipping, every channel rotated.
_INF_MEANINGFUL = ("clip_grad", "rotary_percent")


_FLOAT_SPECS = tuple(spec for spec in FLAG_SPECS.values() if spec.kind in ("float", "num"))


def _check_finite(ns) -> None:
    """A float flag given as nan passes every comparison below (each is False with NaN), and
    an infinite one most of them; both fail later, after the model is built: a traceback
    (--rotary-percent nan, --gpu-memory-gb inf) or a NaN loss (--lr inf)."""
    for spec in _FLOAT_SPECS:
        value = getattr(ns, spec.dest, None)
        if not isinstance(value, float):
            continue
        if math.isnan(value) or (math.isinf(value) and spec.dest not in _INF_MEANINGFUL):
            default = "unset" if spec.default is None else f"{spec.default:g}"
            raise ArgumentsError(f"{spec.flag} {value} is not a finite number; pass a "
                                 f"number (default: {default})")


def check_value_ranges(ns) -> None:
    """Raise `ArgumentsError` for the first flag outside its range, naming the value, the
    range and what the flag means; take --clip-grad below 0 as 0 (no clipping) with a
    warning, as Megatron-LM clips only when --clip-grad > 0."""
    _check_finite(ns)
    for dest, low, meaning, when in _AT_LEAST:
        if _applies(ns, dest, when) and getattr(ns, dest) < low:
            raise ArgumentsError(f"{flag_for_dest(dest)} {getattr(ns, dest)} must be "
                                 f">= {low:g} ({meaning})")
    for dest, meaning, when in _POSITIVE:
        if _applies(ns, dest, when) and getattr(ns, dest) <= 0:
            raise ArgumentsError(f"{flag_for_dest(dest)} {getattr(ns, dest)} must be > 0 "
                                 f"({meaning})")
    for dest, meaning, when in _FLOAT32_NORMAL:
        if _applies(ns, dest, when) and getattr(ns, dest) < FLOAT32_TINY:
            raise ArgumentsError(f"{flag_for_dest(dest)} {getattr(ns, dest):g} must be >= "
                                 f"{FLOAT32_TINY:g} ({meaning})")
    for dest, high, inclusive, meaning, when in _AT_MOST:
        value = getattr(ns, dest, None)
        if _applies(ns, dest, when) and (value > high if inclusive else value >= high):
            bound = f"<= {high:g}" if inclusive else f"< {high:g}"
            raise ArgumentsError(f"{flag_for_dest(dest)} {value} must be {bound} ({meaning})")
    _warn_zero_adam_eps(ns)
    if ns.clip_grad < 0:
        warn(f"--clip-grad {ns.clip_grad}: gradients are not clipped (Megatron-LM clips only "
             "when --clip-grad > 0); pass --clip-grad 0 to say so")
        ns.clip_grad = 0.0
    if ns.loss_scale and not (ns.fp16 or ns.bf16):
        how = ("the distributed optimizer scales the loss and unscales the gradients again, "
               "as Megatron-LM's does" if ns.use_distributed_optimizer else
               "fp32 training scales no loss (Megatron-LM ignores it too)")
        warn(f"--loss-scale {ns.loss_scale:g} has no effect without --fp16 or --bf16: {how}; "
             "drop it or add --fp16")
    window = ns.loss_scale_window
    if _uses_dynamic_loss_scale(ns) and window != int(window):  # a float flag, as Megatron's
        raise ArgumentsError(f"--loss-scale-window {window} must be a whole number of "
                             f"iterations (Megatron-LM never grows the scale with a fraction); "
                             f"pass --loss-scale-window {max(int(window), 1)}")
    if _uses_dynamic_loss_scale(ns) and ns.min_loss_scale > ns.initial_loss_scale:
        raise ArgumentsError(f"--min-loss-scale {ns.min_loss_scale} must be <= "
                             f"--initial-loss-scale {ns.initial_loss_scale} (the dynamic "
                             "scale starts at the initial one and never drops below the "
                             f"minimum); pass --min-loss-scale {ns.initial_loss_scale:g} "
                             f"or --initial-loss-scale {ns.min_loss_scale:g}")
    if ns.profile and ns.profile_step_end <= ns.profile_step_start:
        # Found out at the first training step otherwise, after the model and data are built.
        raise ArgumentsError(f"--profile-step-end {ns.profile_step_end} must be greater than "
                             f"--profile-step-start {ns.profile_step_start} (the profiler "
                             "records iterations start + 1 to end); pass e.g. --profile-step-end "
                             f"{ns.profile_step_start + 2}")


def _warn_zero_adam_eps(ns) -> None:
    """--adam-eps 0 can run (where no gradient element is ever exactly 0), so it is taken,
    as Megatron-LM takes it; but a zero element at its first step, common in the attention
    key biases, gives 0/0 = NaN in that weight, then a NaN loss at the next step."""
    if ns.optimizer == "adam" and ns.adam_eps == 0:
        warn("--adam-eps 0: Adam divides by the root of the second moment alone, so a "
             "gradient element that is exactly 0 at its first step (the attention key "
             "biases' often are) makes its weight NaN (0/0) and the loss NaN at the next "
             "step; pass e.g. --adam-eps 1e-8 (the default)")


_DYNAMIC_SCALER_FLAGS = ("initial_loss_scale", "min_loss_scale", "loss_scale_window",
                         "hysteresis")
_ADAM_FLAGS = ("adam_beta1", "adam_beta2", "adam_eps")


def warn_unread(ns, explicit: Set[str], dests, why: str) -> None:
    """Warn of the flags in `dests` the user set to another value than the default that
    this run never reads (Megatron-LM ignores them silently): `why` ends the sentence. A
    default spelled out (scripts do) changes nothing either way."""
    given = [spelled(ns, d) for d in dests
             if d in explicit and getattr(ns, d) != FLAG_SPECS[flag_for_dest(d)].default]
    if given:
        verb = "has" if len(given) == 1 else "have"
        warn(f"{', '.join(given)} {verb} no effect: {why} (Megatron-LM ignores "
             f"{'it' if len(given) == 1 else 'them'} too)")


# What only the TensorBoard writer reads (the writer exists with --tensorboard-dir only).
_TENSORBOARD_DESTS = ("tensorboard_log_interval", "tensorboard_queue_size",
                      "log_timers_to_tensorboard", "log_batch_size_to_tensorboard",
                      "log_learning_rate_to_tensorboard", "log_loss_scale_to_tensorboard",
                      "log_validation_ppl_to_tensorboard", "log_memory_to_tensorboard",
                      "log_world_size_to_tensorboard")


def _given(ns, explicit: Set[str], dests) -> list:
    """The flags of `dests` the user set to another value than the default, as typed
    (a switch by its name alone)."""
    given = []
    for dest in dests:
        spec = FLAG_SPECS[flag_for_dest(dest)]
        if dest in explicit and getattr(ns, dest) != spec.default:
            switch = spec.kind in ("true", "false")
            given.append(spec.flag if switch else f"{spec.flag} {getattr(ns, dest)}")
    return given


def warn_unread_tensorboard_flags(ns, explicit: Set[str]) -> None:
    """The TensorBoard flags of a run without --tensorboard-dir (Megatron-LM ignores them
    silently): a script that lost its --tensorboard-dir would train without the scalars it
    asks for, and say nothing. With --skip-train the writer gets the arguments only (Megatron
    writes no scalar then, not even the validation loss): that is said too."""
    # (only a --skip-train the user gave: tools/plan_layout.py sets one as a placeholder)
    if ns.tensorboard_dir is not None and ns.skip_train and "skip_train" in explicit:
        given = _given(ns, explicit, _TENSORBOARD_DESTS)
        unread = (f"; {', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect"
                  if given else "")
        warn(f"--skip-train writes no scalars to --tensorboard-dir {ns.tensorboard_dir}, not "
             "even the validation and test losses (as in Megatron-LM): only the arguments go "
             f"there, the losses are printed{unread}")
        return
    if ns.tensorboard_dir is not None:
        return
    given = _given(ns, explicit, _TENSORBOARD_DESTS)
    if given:
        verb = "has" if len(given) == 1 else "have"
        warn(f"{', '.join(given)} {verb} no effect without --tensorboard-dir (nothing is "
             f"written to TensorBoard; Megatron-LM ignores {'it' if len(given) == 1 else 'them'} "
             "too); add --tensorboard-dir DIR")


# What only saving reads (with --save), and what only loading reads (with --load).
_SAVE_DESTS = ("save_interval", "no_save_optim", "no_save_rng", "async_save")
_LOAD_DESTS = ("finetune", "no_load_optim", "no_load_rng", "exit_on_missing_checkpoint")
# Read only by a run that saves or loads (tools/plan_layout.py, which does neither, drops them).
CHECKPOINT_ONLY_DESTS = frozenset(_SAVE_DESTS + _LOAD_DESTS)


def warn_unread_checkpoint_flags(ns, explicit: Set[str]) -> None:
    """The save flags of a run without --save and the load flags of a run without --load
    (Megatron-LM ignores them silently): a script that lost its --save would train for days
    and write no checkpoint; one that lost its --load (with --exit-on-missing-checkpoint,
    meant to stop a resume that finds nothing) would start from scratch, and say nothing.
    A --save with --skip-train is said to write nothing as well (Megatron-LM saves only
    after training, so it writes nothing either, silently)."""
    # (only a --skip-train the user gave: tools/plan_layout.py sets one as a placeholder)
    if ns.save is not None and ns.skip_train and "skip_train" in explicit:
        warn(f"--save {ns.save}: --skip-train only evaluates and writes no checkpoint (as in "
             "Megatron-LM, which saves only after training); drop --skip-train to train and "
             "save")
    for dests, flag, what in ((_SAVE_DESTS, "--save", "no checkpoint is written"),
                              (_LOAD_DESTS, "--load", "the run starts from freshly "
                                                      "initialised weights, loading nothing")):
        given = _given(ns, explicit, dests) if getattr(ns, flag[2:]) is None else []
        if given:
            one = len(given) == 1
            warn(f"{', '.join(given)} {'has' if one else 'have'} no effect without {flag} "
                 f"({what}); add {flag} DIR")
    if ns.exit_signal_handler and ns.save is None:  # here, so that --dry-run says it too
        warn("--exit-signal-handler without --save: on SIGTERM/SIGUSR1 the run will exit "
             "without saving a checkpoint; add --save DIR --save-interval N to save first")


def warn_unread_tuning_flags(ns, explicit: Set[str]) -> None:
    """The loss-scaler, optimizer, weight-decay, rotary and init flags the run's other choices
    leave unread, so that a tuned value that changes nothing is not taken for one that does."""
    if not ns.fp16 or ns.loss_scale:
        run = (f"the loss scale is the constant --loss-scale {ns.loss_scale:g}"
               if ns.loss_scale and (ns.fp16 or ns.bf16)
               else "bf16 trains without loss scaling" if ns.bf16
               else "fp32 training scales no loss")
        warn_unread(ns, explicit, _DYNAMIC_SCALER_FLAGS,
                f"{run}; only --fp16 without --loss-scale has a dynamic loss scale")
    if ns.optimizer == "sgd":
        warn_unread(ns, explicit, _ADAM_FLAGS, "this run uses --optimizer sgd")
    else:
        warn_unread(ns, explicit, ("sgd_momentum",), f"this run uses --optimizer {ns.optimizer}")
    if ns.lr_decay_style == "constant":
        warn_unread(ns, explicit, ("min_lr", "lr_decay_iters", "lr_decay_samples"),
                "--lr-decay-style constant keeps --lr after the warmup (the decay length "
                "only bounds the warmup)")
    _warn_unread_scheduler_flags(ns)
    if not ns.use_rotary_position_embeddings:  # resolved by the model-shape rules
        warn_unread(ns, explicit, ("rotary_percent", "rotary_base"),
                    f"the positions are {ns.position_embedding_type}, without rotary "
                    "embeddings; add --use-rotary-position-embeddings (or "
                    "--position-embedding-type rope) to rotate")
    if ns.init_method_xavier_uniform:  # every weight, output projections too
        warn_unread(ns, explicit, ("init_method_std",),
                    "--init-method-xavier-uniform draws every weight matrix from U(-a, a), "
                    "a = sqrt(6 / (fan_in + fan_out)); drop one of the two")
    if ns.weight_decay_incr_style != "constant":
        warn_unread(ns, explicit, ("weight_decay",),
                f"with --weight-decay-incr-style {ns.weight_decay_incr_style} the weight decay "
                "goes from --start-weight-decay to --end-weight-decay")


def warn_unread_evaluation_flags(ns, explicit: Set[str]) -> None:
    """--eval-iters N (N > 0) given with --eval-interval 0 on a training run: 0 turns every
    evaluation off, the final validation and test losses too (Megatron-LM divides by the
    interval and stops), so the N given would silently score nothing."""
    if ns.eval_interval == 0 and not ns.skip_train and ns.eval_iters > 0 and (
            "eval_iters" in explicit):
        warn(f"--eval-iters {ns.eval_iters} has no effect: --eval-interval 0 turns evaluation "
             "off, during and after training (no validation or test loss is printed); pass "
             f"--eval-interval N to evaluate every N iterations, or one above --train-iters "
             "to evaluate only at the end")


def _warn_unread_scheduler_flags(ns) -> None:
    """--override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler settle the
    schedule a checkpoint brings: a run that loads none (no --load, --finetune,
    --no-load-optim) reads neither."""
    given = [flag for flag, dest in (("--override-opt_param-scheduler",
                                      "override_opt_param_scheduler"),
                                     ("--use-checkpoint-opt_param-scheduler",
                                      "use_checkpoint_opt_param_scheduler"))
             if getattr(ns, dest, False)]
    why = ("there is no --load" if not ns.load else "--finetune loads no schedule"
           if ns.finetune else "--no-load-optim loads no schedule" if ns.no_load_optim
           else None)
    if given and why:
        warn(f"{given[0]} has no effect: {why}, so the schedule comes from the command line "
             "(Megatron-LM ignores it too)")


def check_rotary_width(ns, kv_given: bool) -> None:
    """Rotary embeddings turn channel pairs: an odd rotary width W turns W + 1 channels (as
    Megatron-LM's RotaryEmbedding(W) does), more than a head has when W is the whole odd
    head (--rotary-percent 1): Megatron-LM and this code then fail at the first forward
    pass, refused here. A width of 0 turns nothing: the positions are not encoded, warned."""
    if not ns.use_rotary_position_embeddings:
        return
    from megatron.core.models.gpt.rotary import rotary_dim

    kv, percent = ns.kv_channels, ns.rotary_percent
    head = (f"--kv-channels {kv}" if kv_given else f"the head size {kv} (--hidden-size "
            f"{ns.hidden_size} / --num-attention-heads {ns.num_attention_heads})")
    width = rotary_dim(kv, percent)
    if width % 2 and width == kv:
        raise ArgumentsError(
            f"{head} is odd: rotary embeddings over whole heads (--rotary-percent {percent:g}) "
            f"turn channel pairs, {kv + 1} channels of a {kv}-channel head (Megatron-LM fails "
            f"at the first forward pass too); use an even head size (e.g. --kv-channels "
            f"{kv - 1 if kv > 1 else 2} or {kv + 1}) or a --rotary-percent below 1 (e.g. 0.5)")
    if width == 0:
        warn(f"--rotary-percent {percent:g} of {head} is {kv * percent:g} channels, int() "
             f"makes 0: the rotary embeddings turn no channel and "
             f"{'the model sees no positions' if not ns.add_position_embedding else 'only the learned positions remain'}"
             f"; use a --rotary-percent of at least {2 / kv:g}")
