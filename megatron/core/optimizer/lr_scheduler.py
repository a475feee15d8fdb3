"""Learning-rate and weight-decay schedule, counted in samples (Megatron's semantics).

`OptimizerParamScheduler.step(increment)` advances the schedule by `increment` samples
(the driver passes `micro_batch_size * num_micro_batches * dp_size` after every
successful iteration) and writes the new values into every optimizer parameter group:

    group["lr"]           = lr * group.get("lr_mult", 1.0)
    group["weight_decay"] = wd * group.get("wd_mult", 1.0)

Learning rate at step n (W = warmup, D = decay steps, both in samples; W may be fractional,
e.g. `--lr-warmup-fraction 0.3` of 12 samples is 3.6, as in Megatron):
    n <= W and W > 0            -> max_lr * n / W
    style "constant"            -> max_lr
    n > D                       -> min_lr
    "inverse-square-root"       -> max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)))
    "linear"  r = (n-W)/(D-W)   -> min_lr + (max_lr - min_lr) * (1 - r)
    "cosine"                    -> min_lr + (max_lr - min_lr) * 0.5 * (cos(pi r) + 1)

Weight decay at step n (I = wd_incr_steps): n > I -> end_wd; "constant" -> end_wd;
r = n / I; "linear" -> start + r (end - start); "cosine" ->
start + 0.5 (cos(pi (1 - r)) + 1) (end - start).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Tuple

from megatron.core.config import OptimizerConfig

logger = logging.getLogger(__name__)

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
WD_INCR_STYLES = ("constant", "linear", "cosine")
# What a difference in a *_steps value is counted in: changing --global-batch-size changes it.
_SAMPLE_UNITS = "in samples: iterations x global batch size"
# The flags that set each checkpointed value, for messages (the key names are Megatron's).
_FLAGS = {
    "max_lr": "--lr",
    "min_lr": "--min-lr",
    "lr_warmup_steps": "--lr-warmup-iters/-samples/-fraction",
    "lr_decay_steps": "--lr-decay-iters/-samples, else --train-iters/-samples",
    "lr_decay_style": "--lr-decay-style",
    "start_wd": "--start-weight-decay, or --weight-decay",
    "end_wd": "--end-weight-decay, or --weight-decay",
    "wd_incr_steps": "--train-iters/-samples",
    "wd_incr_style": "--weight-decay-incr-style",
}


def _described(name: str, quoted: bool = False) -> str:
    """`name` (in quotes if asked) with the flags that set it and the unit of a *_steps
    value."""
    unit = f"; {_SAMPLE_UNITS}" if name.endswith("_steps") else ""
    shown = repr(name) if quoted else name
    return f"{shown} ({_FLAGS[name]}{unit})" if name in _FLAGS else shown

# Keys an older Megatron checkpoint may use instead of the current ones.
_LEGACY_KEYS = {
    "max_lr": ("start_lr",),
    "lr_warmup_steps": ("warmup_iter", "warmup_steps"),
    "lr_decay_steps": ("end_iter", "decay_steps"),
    "lr_decay_style": ("decay_style",),
    "num_steps": ("num_iters",),
}


def _weight_decay_range(config: OptimizerConfig):
    """(start_wd, end_wd) from the config; constant style uses `weight_decay` for both."""
    style = config.weight_decay_incr_style
    if style not in WD_INCR_STYLES:
        raise ValueError(
            f"weight_decay_incr_style={style!r} is not supported; use one of {WD_INCR_STYLES}"
        )
    start, end = config.start_weight_decay, config.end_weight_decay
    if style == "constant":
        start = config.weight_decay if start is None else start
        end = config.weight_decay if end is None else end
        if start != end:
            raise ValueError(
                f"constant weight decay needs start_weight_decay == end_weight_decay, got "
                f"{start} and {end}; set only --weight-decay or choose a linear/cosine style"
            )
        return float(start), float(end)
    if start is None or end is None:
        raise ValueError(
            f"weight_decay_incr_style={style!r} needs --start-weight-decay and "
            f"--end-weight-decay (got {start} and {end})"
        )
    return float(start), float(end)


def _warmup_steps(value) -> float:
    """The warmup length as Megatron keeps it: `fraction * decay` stays fractional (never
    truncated); a whole number is an int, so state dicts keep their old form."""
    value = float(value)
    return int(value) if value.is_integer() else value


def _truncated_warmup(current, saved) -> bool:
    """True when `saved` is `current` rounded down to an int: what checkpoints written before
    the warmup was kept fractional stored for a fractional warmup."""
    return (isinstance(current, float) and not current.is_integer()
            and isinstance(saved, int) and saved == math.floor(current))


class OptimizerParamScheduler:
    """Sets lr and weight decay of every parameter group from the number of samples seen.

    Args:
        optimizer: anything with a `param_groups` list of dicts (a torch optimizer or a
            `MegatronOptimizer`).
        config: lr, min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style,
            weight-decay range and style, wd_incr_steps and the two checkpoint flags
            (`override_opt_param_scheduler`, `use_checkpoint_opt_param_scheduler`).
    """

    def __init__(self, optimizer, config: OptimizerConfig) -> None:
        self.optimizer = optimizer
        self.max_lr = float(config.lr)
        self.min_lr = float(config.min_lr)
        self.lr_warmup_steps = _warmup_steps(config.lr_warmup_steps)
        self.lr_decay_steps = int(config.lr_decay_steps)
        self.lr_decay_style = config.lr_decay_style
        self.start_wd, self.end_wd = _weight_decay_range(config)
        self.wd_incr_steps = int(config.wd_incr_steps)
        self.wd_incr_style = config.weight_decay_incr_style
        self.override_opt_param_scheduler = config.override_opt_param_scheduler
        self.use_checkpoint_opt_param_scheduler = config.use_checkpoint_opt_param_scheduler
        self._validate()
        self.num_steps = 0
        self.step(0)

    def _validate(self) -> None:
        if self.min_lr < 0.0:
            raise ValueError(f"min_lr must be >= 0, got {self.min_lr}")
        if self.max_lr < self.min_lr:
            raise ValueError(f"lr ({self.max_lr}) must be >= min_lr ({self.min_lr})")
        if self.lr_decay_steps <= 0:
            raise ValueError(
                f"lr decay length must be > 0 samples, got {self.lr_decay_steps}; set "
                f"--lr-decay-iters/--lr-decay-samples or --train-iters/--train-samples"
            )
        if self.lr_warmup_steps >= self.lr_decay_steps:
            raise ValueError(
                f"lr warmup ({self.lr_warmup_steps} samples) must be shorter than lr decay "
                f"({self.lr_decay_steps} samples); reduce the warmup or lengthen the decay"
            )
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"lr_decay_style={self.lr_decay_style!r} is not supported; use one of "
                f"{LR_DECAY_STYLES}"
            )
        if self.start_wd < 0.0:
            raise ValueError(f"start weight decay must be >= 0, got {self.start_wd}")
        if self.end_wd < self.start_wd:
            raise ValueError(
                f"end weight decay ({self.end_wd}) must be >= start weight decay "
                f"({self.start_wd})"
            )
        if self.wd_incr_style != "constant" and self.wd_incr_steps <= 0:
            raise ValueError(f"wd_incr_steps must be > 0 samples, got {self.wd_incr_steps}")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError(
                "override_opt_param_scheduler and use_checkpoint_opt_param_scheduler are "
                "mutually exclusive; pass at most one of --override-opt_param-scheduler and "
                "--use-checkpoint-opt_param-scheduler"
            )

    # --- values --------------------------------------------------------------------------
    def get_wd(self, num_steps: Optional[int] = None) -> float:
        """Weight decay at the current step (or after `num_steps` samples)."""
        n = self.num_steps if num_steps is None else num_steps
        if n > self.wd_incr_steps or self.wd_incr_style == "constant":
            return self.end_wd
        ratio = n / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, num_steps: Optional[int] = None) -> float:
        """Learning rate at the current step, or after `num_steps` samples (before any
        group's lr_mult)."""
        n = self.num_steps if num_steps is None else num_steps
        warmup = self.lr_warmup_steps
        if warmup > 0 and n <= warmup:
            return self.max_lr * float(n) / float(warmup)
        if self.lr_decay_style == "constant":
            return self.max_lr
        if n > self.lr_decay_steps:
            return self.min_lr
        if self.lr_decay_style == "inverse-square-root":
            lr = self.max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(n, 1))
            return max(self.min_lr, lr)
        ratio = float(n - warmup) / float(self.lr_decay_steps - warmup)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def group_values(self, num_steps: Optional[int] = None) -> List[Tuple[float, float]]:
        """(lr, weight decay) of each param group at the current step or after `num_steps`
        samples, without stepping."""
        lr, wd = self.get_lr(num_steps), self.get_wd(num_steps)
        return [(lr * group.get("lr_mult", 1.0), wd * group.get("wd_mult", 1.0))
                for group in self.optimizer.param_groups]

    def step(self, increment: int) -> None:
        """Advance by `increment` samples (negative: take back an advance) and write lr /
        weight decay into the groups."""
        self.num_steps += increment
        for group, (lr, wd) in zip(self.optimizer.param_groups, self.group_values()):
            group["lr"], group["weight_decay"] = lr, wd

    # --- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Megatron's `opt_param_scheduler` checkpoint entry."""
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
        }

    def _check_and_set(self, current, saved, name: str, notes: List[str],
                       errors: Optional[List[str]] = None):
        """Megatron's rule: override -> keep config; use_checkpoint -> take the checkpoint;
        otherwise the two must agree. A value one of the two flags settles differently from
        the other side is described in `notes` (Megatron prints one line per value). A
        difference neither flag settles is a ValueError, or appended to `errors` when a
        list is given (the config's value is then kept)."""
        if self.override_opt_param_scheduler:
            if current != saved:
                notes.append(f"{_described(name)}: using the command line's {current}, not "
                             f"the checkpoint's {saved} (--override-opt_param-scheduler)")
            return current
        if not self.use_checkpoint_opt_param_scheduler and current != saved:
            message = (
                f"optimizer-parameter-scheduler value {_described(name, quoted=True)} from the checkpoint "
                f"({saved}) differs from the command line ({current}); pass "
                f"--override-opt_param-scheduler to use the command line or "
                f"--use-checkpoint-opt_param-scheduler to use the checkpoint"
            )
            if errors is None:
                raise ValueError(message)
            errors.append(message)
            return current
        if current != saved:
            notes.append(f"{_described(name)}: using the checkpoint's {saved}, not the "
                         f"command line's {current} (--use-checkpoint-opt_param-scheduler)")
        return saved

    def _keep_fractional_warmup(self, saved) -> bool:
        """A checkpoint from before the fractional warmup stores int(warmup): it matches this
        run's warmup, which is kept (with a warning) unless the checkpoint's values are
        asked for."""
        if not _truncated_warmup(self.lr_warmup_steps, saved):
            return False
        if self.use_checkpoint_opt_param_scheduler:
            return False
        if not self.override_opt_param_scheduler:
            logger.warning(
                f"the checkpoint's lr warmup of {saved} samples is this run's "
                f"{self.lr_warmup_steps:.6g} rounded down (written by a version that truncated "
                f"the warmup); continuing with {self.lr_warmup_steps:.6g} as Megatron-LM "
                f"computes it (pass --use-checkpoint-opt_param-scheduler to keep {saved})")
        return True

    def _settled_values(self, state_dict: Dict[str, Any], notes: List[str],
                        errors: Optional[List[str]] = None) -> Dict[str, Any]:
        """name -> the value the run goes on with, for every value a checkpoint entry holds
        (`_check_and_set`'s rule; older Megatron key names accepted). KeyError for an entry
        that lacks one."""
        keys = ["max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style"]
        if "start_wd" in state_dict:
            keys += ["start_wd", "end_wd", "wd_incr_steps", "wd_incr_style"]
        values = {}
        for key in keys:
            saved = _saved_value(state_dict, key)
            if key == "lr_warmup_steps" and self._keep_fractional_warmup(saved):
                continue
            values[key] = self._check_and_set(getattr(self, key), saved, key, notes, errors)
        return values

    def load_state_dict(self, state_dict: Dict[str, Any]) -> List[str]:
        """Restore from a checkpoint entry (also accepts the older Megatron key names).

        Returns one line per value on which the checkpoint and this run's config differ
        and --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler chose
        one side (for the caller to print); without either flag a difference is a
        ValueError naming every differing value (Megatron stops at the first), raised
        before anything is changed."""
        notes: List[str] = []
        errors: List[str] = []
        values = self._settled_values(state_dict, notes, errors)
        if errors:
            raise ValueError(mismatch_message(errors))
        for key, value in values.items():
            setattr(self, key, value)
        self.num_steps = 0
        self.step(int(_saved_value(state_dict, "num_steps")))
        return notes

    def check_state_dict(self, state_dict: Dict[str, Any]) -> Tuple[List[str], List[str]]:
        """(notes, errors) of loading `state_dict`, changing nothing: the notes
        `load_state_dict` would return and the message of every difference it would raise
        a ValueError for. For `--dry-run`."""
        notes: List[str] = []
        errors: List[str] = []
        try:
            self._settled_values(state_dict, notes, errors)
            _saved_value(state_dict, "num_steps")
        except KeyError as exc:
            errors.append(str(exc.args[0]))
        return notes, errors


def mismatch_message(errors: List[str]) -> str:
    """One message for the differences `check_state_dict` lists (`load_state_dict`'s
    ValueError text)."""
    if len(errors) == 1:
        return errors[0]
    return (f"{len(errors)} optimizer-parameter-scheduler values differ from the checkpoint:"
            "\n  " + "\n  ".join(errors))


def _saved_value(state_dict: Dict[str, Any], key: str):
    """`key` of a scheduler checkpoint entry, or its older Megatron name; KeyError if none."""
    for k in (key,) + _LEGACY_KEYS.get(key, ()):
        if k in state_dict:
            return state_dict[k]
    raise KeyError(f"optimizer-parameter-scheduler checkpoint has no {key!r}")
