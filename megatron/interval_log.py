"""The training loop's iteration line and TensorBoard scalars (Megatron's `training_log`).

Each step's values -- loss, loss scale, grad norm, update flag, and with --log-params-norm
the norm of the parameters at the iterations that report it -- stay on the device as a
`StepRecord` until the next --log-interval iteration, so a step never waits for the host.
There the records are read: each --tensorboard-log-interval iteration among them is
written to TensorBoard with its own values, and the line is printed with the loss averaged
over the interval's updated iterations. When the loop stops off the log interval (the
last iteration, an exit condition) the records still go to TensorBoard and the averages
are dropped without a line: Megatron prints one only every --log-interval iterations.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from megatron import step_graph
from megatron.agreed_exit import rank_ranges
from megatron.logging_utils import (
    format_iteration_line,
    format_memory_line,
    model_flops_per_token,
    print_line,
    print_rank_last,
)
from megatron.microbatches import samples_of_steps
from megatron.train_step import (
    IntervalExtras,
    interval_extras,
    log_timers,
    step_log,
    watch_optimizer,
)
from megatron.watchdog import watching

PEAK_FLOPS = 989e12  # H100/H200 dense bf16, the MFU denominator


class StepRecord(NamedTuple):
    """One iteration's values, kept (on the device) until the next log line."""

    iteration: int
    consumed: int
    lr: object  # a float; (if updated, if skipped) while `ok` is a device tensor
    loss: torch.Tensor
    scale: object
    grad_norm: Optional[torch.Tensor]
    ok: object  # bool, or a 0-dim bool tensor decided on the device (an fp16 replay)
    counted: bool  # a NaN already counted by the NaN policy
    local_loss: Optional[torch.Tensor]  # this rank's own loss, to name a NaN's origin
    params_norm: Optional[torch.Tensor]  # --log-params-norm, where a log reports it
    memory: Optional[dict] = None  # --log-memory-to-tensorboard at a TensorBoard iteration
    batch_size: int = 0  # this step's global batch (it changes with --rampup-batch-size)


def params_norm_due(logging_config, iteration: int) -> bool:
    """Whether --log-params-norm needs the norm after `iteration`: at the iteration line
    (--log-interval) and at the TensorBoard interval when a writer is configured. The
    same answer on every rank (the norm is a collective); a full pass over the
    parameters, so not taken at iterations that report nothing."""
    lg = logging_config
    if not lg.log_params_norm:
        return False
    return (iteration % lg.log_interval == 0
            or (lg.tensorboard_dir is not None and iteration % lg.tensorboard_log_interval == 0))


def memory_stats_due(tr, iteration: int) -> Optional[dict]:
    """The allocator's statistics when --log-memory-to-tensorboard writes them for
    `iteration` (a TensorBoard iteration of the rank that writes, on CUDA), else None.
    Host-side bookkeeping: no device synchronisation."""
    lg = tr.config.logging
    if (tr.tb is None or not lg.log_memory_to_tensorboard or tr.rt.device.type != "cuda"
            or iteration % lg.tensorboard_log_interval != 0):
        return None
    return torch.cuda.memory_stats(tr.rt.device)


def to_float(x) -> Optional[float]:
    if x is None:
        return None
    return float(x.item()) if torch.is_tensor(x) else float(x)


class IntervalStats:
    """The records and the wall time since the last console line, less the time spent
    in `paused()` (evaluation and checkpoint saves, so that "elapsed time per iteration"
    is training time, as in Megatron-LM releases after 23.05, which stop the interval
    timer around them; 23.05 counts them in)."""

    clock = staticmethod(time.monotonic)  # seconds; a wall-clock step never shows

    def __init__(self):
        self.floor_warned = False  # see `loss_scale_floor_warning`
        self.memory_reported = False  # see `report_memory_once`
        self.reset()

    def reset(self) -> None:
        self.records: List[StepRecord] = []
        self.start = self.clock()
        self.excluded = 0.0
        self.rolled_back_nans = 0  # NaN iterations undone by a rollback (no record left)
        self.undone_steps = self.undone_samples = 0  # run, then undone by a rollback
        self.written = False  # the records are in TensorBoard (the line may still fail)

    def roll_back(self, iteration: int, nan_batch: int) -> None:
        """--nan-loss-policy rollback reloaded the checkpoint of `iteration` after a NaN
        (a step of `nan_batch` samples): the records of the iterations it undid are dropped
        (they are trained again: the line would average both attempts and TensorBoard get
        their steps twice), and the NaN is counted on the next line as a skipped and a NaN
        iteration. The undone steps (the NaN's too) stay in the line's time per iteration
        and throughput as steps run, as their time stays in the interval."""
        undone = [r for r in self.records if r.iteration > iteration]
        self.records = [r for r in self.records if r.iteration <= iteration]
        self.rolled_back_nans += 1
        self.undone_steps += len(undone) + 1
        self.undone_samples += sum(r.batch_size for r in undone) + nan_batch

    def elapsed(self) -> float:
        return self.clock() - self.start - self.excluded

    @contextlib.contextmanager
    def paused(self, device: torch.device):
        """Leave the time inside out of the interval. The device is synchronised first,
        so that the training work still queued stays in the interval."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = self.clock()
        try:
            yield
        finally:
            self.excluded += self.clock() - began

    def add(self, tr, loss, ok, grad_norm, counted: bool = False) -> None:
        """Record the iteration just counted in `tr.state`; `counted`: a NaN the NaN policy
        counted already. With --log-params-norm, where due, the norm of the parameters
        after the step (collective over the optimizer's group; no host sync)."""
        scale = tr.optimizer.get_loss_scale()
        if getattr(tr.optimizer, "grad_scaler", None) is not None:
            scale = scale.clone()  # the scaler updates its tensor in place
        lr = tr.scheduler.get_lr()
        if torch.is_tensor(ok):  # decided on the device: the lr after it if it skipped too
            lr = (lr, tr.scheduler.get_lr(tr.scheduler.num_steps
                                          - tr.config.data.global_batch_size))
        st = tr.state
        norm = None
        if params_norm_due(tr.config.logging, st.iteration):
            with watch_optimizer(tr, "parameter norm all-reduce (--log-params-norm)"):
                norm = tr.optimizer.get_params_norm()
        self.records.append(StepRecord(st.iteration, st.consumed_train_samples, lr, loss,
                                       scale, grad_norm, ok, counted, tr.last_local_loss,
                                       norm, memory_stats_due(tr, st.iteration),
                                       tr.config.data.global_batch_size))

    def read_flags(self, st) -> None:
        """Read the update flags that fp16 replays left on the device (after a sync: no
        wait), count their skips, and pick each one's lr; a skipped step shows no norm."""
        resolved = []
        for r in self.records:
            if torch.is_tensor(r.ok):
                ok = bool(r.ok)
                st.skipped_iters += 0 if ok else 1
                r = r._replace(ok=ok, lr=r.lr[0] if ok else r.lr[1])
            resolved.append(r if r.ok else r._replace(grad_norm=None))
        self.records = resolved


def loss_scale_floor_warning(grad_scaler, scale: Optional[float], skipped: int,
                             iterations: int) -> Optional[str]:
    """A warning when every one of the interval's `iterations` skipped its step and the loss
    scale cannot go lower (a constant --loss-scale, or the dynamic one at --min-loss-scale):
    the skips then go on forever and the model never updates. Megatron keeps training
    silently; None otherwise."""
    if grad_scaler is None or scale is None or iterations == 0 or skipped < iterations:
        return None
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    if isinstance(grad_scaler, DynamicGradScaler):
        if scale > grad_scaler.min_scale * (1 + 1e-6):  # the scale is a float32
            return None
        where = (f"the dynamic loss scale is at --min-loss-scale {grad_scaler.min_scale:g} and "
                 "cannot back off further")
        fix = "lower --min-loss-scale"
    else:
        where = f"the loss scale is the constant --loss-scale {scale:g}"
        fix = "lower --loss-scale (or drop it for the dynamic scale)"
    return (f"WARNING: the optimizer skipped the step at each of the last {iterations} "
            f"iteration(s) (inf/nan gradients) and {where}: the model is not being updated. "
            f"If the loss is finite, {fix}; else lower --lr or check the data; "
            "the skips go on until a step succeeds")


def _settle(tr, stats: IntervalStats) -> None:
    """Wait for the interval's steps and make the host's counts exact."""
    if tr.rt.device.type == "cuda":
        # Collectives are asynchronous on NCCL: a hang shows up here.
        wd = tr.watchdog
        with wd.watch("step synchronisation at the log interval") if wd else contextlib.nullcontext():
            torch.cuda.synchronize()
    stats.read_flags(tr.state)
    step_graph.settle(tr)


def _write_records(tr, stats: IntervalStats, extras) -> Tuple[List[float], int, int]:
    """Write each record at the TensorBoard interval and count the NaN iterations into
    `tr.state`. Returns (losses of the updated iterations, skipped, NaN iterations)."""
    cfg, st = tr.config, tr.state
    last_it = stats.records[-1].iteration
    good_losses = []
    # The line counts skipped and NaN iterations of this interval, as Megatron's does (its
    # counters restart at every print); TrainState keeps the run's totals.
    skipped = nans = stats.rolled_back_nans
    for r in stats.records:
        loss_f = to_float(r.loss)
        skipped += 0 if r.ok else 1
        if not math.isfinite(loss_f):
            st.nan_iters += 0 if r.counted else 1
            nans += 1
        elif r.ok:
            good_losses.append(loss_f)
        if tr.tb is not None and r.iteration % cfg.logging.tensorboard_log_interval == 0:
            last = r.iteration == last_it
            memory = r.memory if r.memory is not None else extras.memory if last else None
            # The timers are read (a collective) only here, at the interval's end: each
            # TensorBoard iteration of the interval gets the interval's per-iteration
            # average, so `<timer>-time` has Megatron's x-axis (every
            # --tensorboard-log-interval iteration), not only the iterations that are
            # multiples of both intervals.
            tr.tb.log_training(r.iteration, r.consumed, r.lr, r.batch_size,
                               {"lm loss": loss_f}, to_float(r.scale), to_float(r.grad_norm),
                               to_float(extras.num_zeros.get(r.iteration)),
                               to_float(r.params_norm), tr.rt.ps.world_size,
                               memory, extras.timers)
    return good_losses, skipped, nans


@contextlib.contextmanager
def points_kept_on_stop(tr):
    """Around the loop, giving its `IntervalStats`: when an error or a Ctrl-C stops it, the
    steps since the last iteration line still go to TensorBoard (Megatron writes each step
    as it ends; here they wait for the next line, up to --log-interval - 1 of them). No
    collective (a peer may be gone), and no unbounded wait for the device: on CUDA only
    once its queued work is done (a collective whose peer left would never finish)."""
    stats = IntervalStats()
    try:
        yield stats
    except BaseException:
        if tr.tb is not None and tr.tb.enabled and stats.records and not stats.written:
            _write_pending(tr, stats)
        raise


def _write_pending(tr, stats: IntervalStats, wait_s: float = 10.0) -> None:
    try:
        if tr.rt.device.type == "cuda":  # the host is often a step ahead: a short wait
            done, deadline = torch.cuda.Event(), time.monotonic() + wait_s
            done.record()
            while not done.query():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the device was still busy after {wait_s:g} s")
                time.sleep(0.01)
        stats.read_flags(tr.state)
        _write_records(tr, stats, IntervalExtras(step_log(tr).num_zeros, None, None))
        stats.reset()
    except Exception as exc:  # the run's own error is the one to report
        print(f"note: the last {len(stats.records)} iteration(s) were not written to "
              f"TensorBoard ({exc})", flush=True)


def log_interval(tr, stats: IntervalStats, print_line: bool = True) -> None:
    """Write the records to TensorBoard, count NaN iterations and, with `print_line`,
    print Megatron's iteration line and timer block. Collective with timers: every rank
    calls it at the same iterations. Without `print_line` (the loop stopped off the log
    interval) the loss average and the timer readings are dropped."""
    cfg = tr.config
    _settle(tr, stats)
    elapsed = stats.elapsed()
    n = max(len(stats.records) + stats.undone_steps, 1)  # the steps the interval ran
    extras = interval_extras(tr, n)
    good_losses, skipped, nans = _write_records(tr, stats, extras)
    stats.written = True
    if print_line:
        r = stats.records[-1]
        # The interval's samples (under --rampup-batch-size its steps differ in size).
        samples = sum(rec.batch_size for rec in stats.records) + stats.undone_samples
        tokens_per_gpu = samples * cfg.data.seq_length / elapsed / tr.rt.ps.world_size
        m = cfg.model
        tflops = tokens_per_gpu * model_flops_per_token(m, cfg.data.seq_length) / 1e12
        print_rank_last(format_iteration_line(
            r.iteration, cfg.training.train_iters, r.consumed, elapsed * 1000.0 / n, r.lr,
            r.batch_size,
            {"lm loss": sum(good_losses) / len(good_losses)} if good_losses else {},
            to_float(r.scale), to_float(r.grad_norm),
            to_float(extras.num_zeros.get(r.iteration)), to_float(r.params_norm),
            skipped, nans, tokens_per_gpu, tflops))
        done, total, start, unit = run_progress(cfg, r.iteration, r.consumed,
                                                tr.start_iteration, tr.start_consumed)
        print_rank_last(progress_line(done, total, start, time.time() - tr.start_time, unit))
        report_memory_once(tr, stats, r.iteration, r.lr)
        _warn_at_loss_scale_floor(tr, stats, to_float(r.scale), skipped)
        log_timers(tr, n)
        if tr.tb is not None:
            extra = {"tokens-per-sec-per-gpu": tokens_per_gpu, "tflops-per-gpu": tflops,
                     "mfu": tflops * 1e12 / PEAK_FLOPS}
            if tr.rt.device.type == "cuda":
                extra["mem-max-allocated-gb"] = torch.cuda.max_memory_allocated() / 2**30
            tr.tb.log_scalars(r.iteration, r.consumed, extra)
            tr.tb.log_iteration_time(r.iteration, elapsed / n)
    if tr.tb is not None:
        tr.tb.flush()
    stats.reset()


def report_memory_once(tr, stats: IntervalStats, iteration: int, lr: float) -> None:
    """Megatron's `[Rank r] (after N iterations) memory (MB) | allocated: ... | max
    reserved: ...` line, once per run: after the first iteration line whose learning rate
    is above 0 (the optimizer state exists by then), from every data-parallel rank 0 (one
    per tensor/pipeline position). CUDA only: the figures are the caching allocator's."""
    if stats.memory_reported or lr <= 0.0 or tr.rt.device.type != "cuda":
        return
    stats.memory_reported = True
    if tr.rt.ps.dp_rank == 0:
        print_line(format_memory_line(tr.rt.ps.rank, iteration, tr.rt.device))


def _warn_at_loss_scale_floor(tr, stats: IntervalStats, scale: Optional[float],
                              skipped: int) -> None:
    """Print `loss_scale_floor_warning` once per run of skipped intervals (again after a
    step has succeeded)."""
    note = loss_scale_floor_warning(getattr(tr.optimizer, "grad_scaler", None), scale,
                                    skipped - stats.rolled_back_nans, len(stats.records))
    if note and not stats.floor_warned:
        print_rank_last(note)
    stats.floor_warned = note is not None


def _hours_minutes_seconds(seconds: float) -> str:
    """'HH:MM:SS' with as many hours as it takes ('52:00:00' for two days and four hours);
    '?' when unknown."""
    if not math.isfinite(seconds):
        return "?"
    minutes, sec = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours:02d}:{minutes:02d}:{sec:02d}"


def run_progress(cfg, iteration: int, consumed: int, start_iteration: int,
                 start_consumed: int) -> Tuple[int, int, int, str]:
    """(done, total, done when this run's loop started, unit): the measure the run is
    defined by. A sample-based run (--train-samples, with or without --rampup-batch-size)
    counts samples: the total is what it will have consumed at --train-iters, each step
    left at its ramp size (Megatron drops --train-samples' partial last batch, so that is
    up to a batch short of --train-samples), counted from the consumed samples now (a
    resumed run's from its checkpoint; a NaN rollback keeps them and repeats iterations).
    An iteration-based run counts iterations (its steps are all one size)."""
    train_iters = cfg.training.train_iters or 0
    if not cfg.training.train_samples:
        return iteration, train_iters, start_iteration, "iterations"
    d = cfg.data
    rampup = tuple(d.rampup_batch_size) if d.rampup_batch_size else None
    left = samples_of_steps(consumed, train_iters - iteration, rampup,
                            d.target_global_batch_size or d.global_batch_size)
    return consumed, consumed + left, start_consumed, "samples"


def progress_line(done: int, total: int, start: int, elapsed_s: float,
                  unit: str = "iterations") -> str:
    """' progress: 40.0% (120/300 iterations) | elapsed 00:01:02 | ETA 00:01:30 |': the
    share and the time left in one measure (`run_progress`), the time left at this run's
    pace (done - start units in elapsed_s). The hours are not taken modulo a day: a
    pretraining run's ETA is often days."""
    run = done - start
    eta = elapsed_s / run * max(total - done, 0) if run > 0 else float("nan")
    fmt = _hours_minutes_seconds
    return (f" progress: {100.0 * done / max(total, 1):.1f}% ({done}/{total} {unit}) "
            f"| elapsed {fmt(elapsed_s)} | ETA {fmt(eta)} |")


# --------------------------------------------------------------------------- NaN origins
_NONFINITE = ("nan", "inf", "-inf")  # code 1, 2, 3 in `nonfinite_origins`; 0: finite


def nonfinite_origins(tr, local: Optional[torch.Tensor]) -> torch.Tensor:
    """Which data-parallel replicas' own losses were non-finite: a float per replica (0
    finite, else 1 + its index in _NONFINITE), from each replica's last pipeline stage's
    tensor-parallel rank 0 (the replica's other ranks hold the same loss). Collective:
    one MAX all-reduce over the run's control group, which every rank calls at the same
    point (the loss averaged over the replicas is non-finite on all of them)."""
    ps = tr.rt.ps
    kinds = torch.zeros(ps.dp_size)
    if (local is not None and not torch.isfinite(local).all() and ps.tp_rank == 0
            and ps.pp_rank == ps.pp_size - 1):
        value = float(local)
        kinds[ps.dp_rank] = 1 + _NONFINITE.index(
            "nan" if math.isnan(value) else "inf" if value > 0 else "-inf")
    if dist.is_initialized() and dist.get_world_size() > 1:
        with watching("non-finite loss origins", tr.rt.control_group):
            dist.all_reduce(kinds, op=dist.ReduceOp.MAX, group=tr.rt.control_group)
    return kinds


def nonfinite_origin_line(kinds: torch.Tensor, iteration: int) -> Optional[str]:
    """The line naming the replicas of `nonfinite_origins`, e.g. 'non-finite loss (nan)
    at iteration 3 on data-parallel ranks 0-2, 5 (of 8)'; None when no replica's own loss
    was (their average overflowed)."""
    dp_size = len(kinds)
    found = {}
    for dp_rank, code in enumerate(kinds.tolist()):
        if code:
            found.setdefault(_NONFINITE[int(code) - 1], []).append(dp_rank)
    if not found:
        return None
    if dp_size == 1:
        return f"non-finite loss ({next(iter(found))}) at iteration {iteration}"
    where = [f"{rank_ranges(ranks).replace('rank', 'data-parallel rank', 1)}"
             for ranks in found.values()]
    if len(found) == 1:
        return (f"non-finite loss ({next(iter(found))}) at iteration {iteration} on "
                f"{where[0]} (of {dp_size})")
    parts = ", ".join(f"{kind} on {w}" for kind, w in zip(found, where))
    return f"non-finite loss at iteration {iteration}: {parts} (of {dp_size})"
