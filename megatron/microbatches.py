"""Batch-size ramp-up (`--rampup-batch-size START INCR SAMPLES`), Megatron-LM's rule.

The global batch starts at START samples and grows by INCR each time another
SAMPLES / ((GBS - START) / INCR) samples have been consumed; once more than SAMPLES samples
are consumed it is the final `--global-batch-size` (GBS). The micro-batch size stays fixed:
the number of micro-batches per step changes. Consumed samples, the lr / weight-decay
schedule (they step by the current global batch) and the sample-based iteration count all
follow the current size.

During a ramped run `DataConfig.global_batch_size` and `DataConfig.num_micro_batches` are
the CURRENT values: `train_step` sets them from the consumed samples before every step (as
Megatron's `get_current_global_batch_size()` / `get_num_microbatches()` do), and
`DataConfig.target_global_batch_size` keeps GBS.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple


def parse_rampup(values: Optional[Sequence], global_batch_size: int, micro_batch_size: int,
                 dp_size: int, pp_multiple: int = 1) -> Optional[Tuple[int, int, int]]:
    """(start, increment, ramp-up samples) from the flag's three values, checked; None when
    the flag is absent. Every size the ramp passes through must be a multiple of
    micro-batch size x data-parallel size (x `pp_multiple` micro-batches for the
    interleaved schedule). Raises ValueError naming the values and the fix."""
    if values is None:
        return None
    flag = "--rampup-batch-size " + " ".join(str(v) for v in values)
    if len(values) != 3:
        raise ValueError(f"{flag}: expected 3 values, START INCREMENT SAMPLES")
    try:
        start, incr, samples = (int(v) for v in values)
    except ValueError:
        raise ValueError(f"{flag}: START, INCREMENT and SAMPLES must be integers") from None
    gbs = global_batch_size
    if start <= 0 or incr <= 0 or samples <= 0:
        raise ValueError(f"{flag}: START, INCREMENT and SAMPLES must all be > 0")
    if start > gbs or (gbs - start) % incr:
        raise ValueError(f"{flag}: --global-batch-size {gbs} must be START plus a whole number "
                         f"of INCREMENTs (START <= {gbs}, ({gbs} - START) % INCREMENT == 0)")
    unit = micro_batch_size * dp_size * pp_multiple
    if start % unit or incr % unit:
        raise ValueError(f"{flag}: START and INCREMENT must be multiples of --micro-batch-size "
                         f"{micro_batch_size} x data-parallel size {dp_size}"
                         + (f" x pipeline size {pp_multiple} (interleaved schedule)"
                            if pp_multiple > 1 else "") + f" = {unit}")
    return start, incr, samples


def current_global_batch_size(consumed_samples: int, rampup: Tuple[int, int, int],
                              global_batch_size: int) -> int:
    """The global batch size of the step that starts after `consumed_samples` samples."""
    start, incr, samples = rampup
    num_increments = (global_batch_size - start) // incr
    if num_increments == 0 or consumed_samples > samples:
        return global_batch_size
    per_increment = samples / num_increments
    return min(start + int(consumed_samples / per_increment) * incr, global_batch_size)


def rampup_train_iters(train_samples: int, rampup: Tuple[int, int, int],
                       global_batch_size: int) -> int:
    """Iterations of a sample-based run (`--train-samples`) with ramp-up: the steps taken
    until more than the ramp-up samples are consumed, then whole final-size batches of
    what is left (Megatron's count; a partial last batch is dropped). When --train-samples
    ends inside the ramp-up, Megatron's floor division of the negative remainder takes
    steps back off in final-size batches: 2 1 8 with GBS 4 and 8 train samples ramps
    2 + 2 + 3 + 3 = 10 samples in 4 steps, then (8 - 10) // 4 = -1: 3 iterations."""
    iterations, consumed = rampup_span(rampup, global_batch_size)
    return max(iterations + (train_samples - consumed) // global_batch_size, 0)


def rampup_span(rampup: Optional[Tuple[int, int, int]],
                global_batch_size: int) -> Tuple[int, int]:
    """(steps, samples) of the ramp in Megatron's count of a sample-based run: the steps
    taken until more than the ramp-up samples are consumed; (0, 0) without ramp-up."""
    consumed = iterations = 0
    while rampup is not None and consumed <= rampup[2]:
        consumed += current_global_batch_size(consumed, rampup, global_batch_size)
        iterations += 1
    return iterations, consumed


def whole_steps_within(consumed_samples: int, budget: int,
                       rampup: Optional[Tuple[int, int, int]], global_batch_size: int) -> int:
    """How many steps after `consumed_samples` take at most `budget` samples in all (each
    step the ramp's size at its own consumed count, `global_batch_size` after the ramp)."""
    steps = 0
    while rampup is not None and budget > 0:
        size = current_global_batch_size(consumed_samples, rampup, global_batch_size)
        if size == global_batch_size or size > budget:
            break
        consumed_samples, budget, steps = consumed_samples + size, budget - size, steps + 1
    return steps + max(budget, 0) // global_batch_size


def rampup_consumed_samples(iterations: int, rampup: Tuple[int, int, int],
                            global_batch_size: int) -> int:
    """Samples consumed by the first `iterations` steps of a ramped run."""
    consumed = 0
    for _ in range(iterations):
        consumed += current_global_batch_size(consumed, rampup, global_batch_size)
    return consumed


def update_micro_batches(data, consumed_samples: int, dp_size: int) -> None:
    """Set `data.global_batch_size` / `data.num_micro_batches` (a DataConfig) to the
    values of the step that starts after `consumed_samples`; nothing without ramp-up."""
    if not data.rampup_batch_size:
        return
    gbs = current_global_batch_size(consumed_samples, tuple(data.rampup_batch_size),
                                    data.target_global_batch_size)
    data.global_batch_size = gbs
    data.num_micro_batches = gbs // (data.micro_batch_size * dp_size)


def samples_of_steps(consumed_samples: int, steps: int,
                     rampup: Optional[Tuple[int, int, int]], global_batch_size: int) -> int:
    """Samples the next `steps` steps take after `consumed_samples` (each step the ramp's
    size at its own consumed count; `global_batch_size` each without ramp-up). A run of
    steps of one size at a time (a GPT-3 ramp is ~10^6 steps in ~50 sizes), the steps
    after the ramp in one product."""
    taken = 0
    while steps > 0 and rampup is not None:
        size = current_global_batch_size(consumed_samples + taken, rampup, global_batch_size)
        if size == global_batch_size:  # the final size from here on
            break
        run = min(_steps_of_size(consumed_samples + taken, size, rampup, global_batch_size),
                  steps)
        taken, steps = taken + run * size, steps - run
    return taken + max(steps, 0) * global_batch_size


def _steps_of_size(consumed: int, size: int, rampup: Tuple[int, int, int],
                   global_batch_size: int) -> int:
    """How many steps in a row from `consumed` (whose step is `size`) take `size` samples:
    estimated from where the next increment falls, then settled on the exact rule (the
    size only grows with the consumed count)."""
    start, incr, samples = rampup
    per_increment = samples / ((global_batch_size - start) // incr)
    change_at = min((int(consumed / per_increment) + 1) * per_increment, samples + 1)
    n = max(math.ceil((change_at - consumed) / size), 1)

    def same(k: int) -> bool:
        return current_global_batch_size(consumed + k * size, rampup, global_batch_size) == size

    while n > 1 and not same(n - 1):
        n -= 1
    while same(n):
        n += 1
    return n
