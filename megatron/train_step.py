"""One training step, top to bottom: micro-batches -> pipeline schedule (forward/backward)
-> finish the data-parallel gradient reduction -> tied-embedding and sequence-parallel
grad all-reduces -> optimizer step (may skip) -> lr step.

`tr` is the `Trainer` of `megatron.training` (config, runtime, model, optimizer, scheduler).
What the step leaves for the log line -- Megatron's timers (`--timing-log-level`) and the
zero counts of the gradients (`--log-num-zeros-in-grad`) -- lives in `step_log(tr)`.

Every collective of the step runs in a block of the run's watchdog (megatron/watchdog.py),
so that a rank that never gets there, or stops inside the block before its collective, is
named with the phase: the schedule's actions (`_action_watch`), the loss broadcast, the
gradient reduction, the tied-embedding and sequence-parallel all-reduces, the loss average,
the NaN check and the optimizer step (one block for its reductions and, with the
distributed optimizer, its parameter all-gather; with --overlap-param-gather the wait for
that all-gather, per bucket, in the next forward: `watch_param_sync`). A block is an
in-memory check-in; nothing is added per layer.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.distributed import allreduce_sequence_parallel_grads
from megatron.core.models.gpt.stages import (
    allreduce_tied_embedding_grads,
    tied_embedding_weights,
)
from megatron.core.optimizer import DistributedOptimizer
from megatron.core.pipeline_parallel import (
    P2PCommunicator,
    ScheduleExecutor,
    action_phase,
    build_schedule,
    tensor_shape,
    transfer_name,
    unwrap,
)
from megatron.core.pipeline_parallel.schedules import COMM, WAIT
from megatron.core.timing import timed
from megatron.data_iterators import get_batch
from megatron.logging_utils import Timer, Timers
from megatron.microbatches import update_micro_batches
from megatron.step_graph import runner_for
from megatron.watchdog import CollectiveWatchdog, issued_collectives, issued_collectives_on

# Megatron's timers that this step runs, in the order of its timer block (Megatron's
# order, which mixes the levels). Level 1: forward-backward, the gradient reductions,
# params-all-gather (distributed optimizer), the optimizer's phases and the whole
# optimizer step. Level 2: forward-compute, backward-compute, batch-generator and the
# pipeline transfers (megatron/core/pipeline_parallel/p2p.py names them). A timer that did
# not run in the interval is not printed.
P2P_TIMER_NAMES = (
    "forward-recv", "forward-send", "backward-recv", "backward-send",
    "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
    "backward-send-backward-recv", "forward-backward-send-forward-backward-recv")
OPTIMIZER_TIMER_NAMES = (
    "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
    "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
    "optimizer-copy-main-to-model-params")
TIMER_NAMES = (("forward-backward", "forward-compute", "backward-compute", "batch-generator")
               + P2P_TIMER_NAMES
               + ("layernorm-grads-all-reduce", "embedding-grads-all-reduce",
                  "grads-all-reduce", "grads-reduce-scatter", "params-all-gather")
               + OPTIMIZER_TIMER_NAMES + ("optimizer",))


class _BarrierStart:
    """A level-1 timer whose start first waits for every rank at the world barrier, as
    Megatron's level-1 timers do unless --no-barrier-with-level-1-timing."""

    __slots__ = ("timer",)

    def __init__(self, timer: Timer) -> None:
        self.timer = timer

    def start(self) -> None:
        self.timer.start(barrier=True)

    def stop(self) -> None:
        self.timer.stop()


class StepLog:
    """What the steps leave for the next log line: the timers (no-ops above
    `--timing-log-level`, so level 0 adds no synchronisation) and, per iteration, the
    number of zero gradient entries (`--log-num-zeros-in-grad`, 0-dim tensors)."""

    def __init__(self, config, device: torch.device) -> None:
        lg = config.logging
        self.timers = Timers(lg.timing_log_level, lg.timing_log_option, device)
        # --no-barrier-with-level-1-timing: level-1 timers start without a world barrier.
        self.barrier = bool(config.args.get("barrier_with_L1_time", True))
        self.num_zeros: Dict[int, torch.Tensor] = {}
        self.replicas_synced = False
        self._barriered: Dict[str, _BarrierStart] = {}
        self.group_ranks: Dict[object, tuple] = {}  # process group -> its ranks (watch_group)
        self.optimizer_step_name: Optional[str] = None  # the watchdog's name of the step

    def core_timers(self, lowest_level: int):
        """The timer hook (megatron/core/timing.py) for core code whose timers are at
        `lowest_level` or above: None when --timing-log-level is below it, so that code
        calls no timer at all (level 0: none does)."""
        return self._core_timer if self.timers.log_level >= lowest_level else None

    def _core_timer(self, name: str, log_level: int):
        timer = self.timers(name, log_level)
        if log_level != 1 or not self.barrier or not isinstance(timer, Timer):
            return timer
        wrapped = self._barriered.get(name)
        if wrapped is None:
            wrapped = self._barriered[name] = _BarrierStart(timer)
        return wrapped


def step_log(tr) -> StepLog:
    """The trainer's StepLog, created on first use."""
    log = getattr(tr, "step_log", None)
    if log is None:
        log = tr.step_log = StepLog(tr.config, tr.rt.device)
    return log


class IntervalExtras(NamedTuple):
    """The log line's values beyond the per-step records (None when not asked for)."""

    num_zeros: Dict[int, torch.Tensor]  # iteration -> zero count (--log-num-zeros-in-grad)
    timers: Optional[Dict[str, float]]  # --log-timers-to-tensorboard: max s per iteration
    memory: Optional[dict]  # --log-memory-to-tensorboard: torch.cuda.memory_stats()


def interval_extras(tr, iterations: int) -> IntervalExtras:
    """Collect (and clear) what the next log line needs. Collective when asked for, so
    every rank calls it at the same iterations: the timer maxima are an all-gather over
    the world. (The parameter norm is taken after each step that reports it:
    megatron/interval_log.py.)"""
    lg, log = tr.config.logging, step_log(tr)
    num_zeros, log.num_zeros = log.num_zeros, {}
    timers = None
    if lg.log_timers_to_tensorboard and lg.timing_log_level > 0:
        timers = log.timers.max_times(TIMER_NAMES, normalizer=iterations)
    memory = None
    if lg.log_memory_to_tensorboard and tr.rt.device.type == "cuda":
        memory = torch.cuda.memory_stats(tr.rt.device)
    return IntervalExtras(num_zeros, timers, memory)


def log_timers(tr, iterations: int) -> None:
    """Megatron's timer block, ms per iteration, printed by the last rank and reset.
    Collective (all-gather over the world); nothing at --timing-log-level 0."""
    if tr.config.logging.timing_log_level > 0:
        step_log(tr).timers.log(TIMER_NAMES, normalizer=iterations)


# --------------------------------------------------------------------------- one step
class _MicroBatchFeed:
    """Micro-batches for the chunks that need data on this rank (the first and/or last
    pipeline stage; with --reset-attention-mask every chunk, as each layer needs the
    per-document mask), read from the iterator in order, one per micro-batch, and held
    until each of the `users` chunks of this rank that needs it has had it."""

    def __init__(self, data: Iterator[dict], device: torch.device, eod, flags,
                 timers: Timers) -> None:
        self.data, self.device, self.next = data, device, 0
        self.eod, self.flags = eod, flags
        self.timer = timers("batch-generator", 2)
        self.users, self.held = 1, {}

    def needed_by(self, module) -> bool:
        return module.pre_process or module.post_process or self.flags.reset_attention_mask

    def get(self, microbatch: int) -> dict:
        if microbatch in self.held:  # a later chunk of this rank: the batch already read
            batch, left = self.held.pop(microbatch)
            if left > 1:
                self.held[microbatch] = (batch, left - 1)
            return batch
        assert microbatch == self.next, f"micro-batch {microbatch} asked, {self.next} due"
        self.next += 1
        self.timer.start()
        batch = get_batch(next(self.data), self.device, self.eod, self.flags)
        self.timer.stop()
        if self.users > 1:
            self.held[microbatch] = (batch, self.users - 1)
        return batch


def _forward_step(chunks, feed: _MicroBatchFeed, metric=None):
    """forward_step(chunk, microbatch, input_sbh) for the executor: the chunk's output
    activation, or on the last stage the micro-batch loss (masked mean, fp32) -- or, with
    a `metric` (see `run_schedule`), what the metric makes of the output."""
    modules = [unwrap(c) for c in chunks]
    feed.users = sum(map(feed.needed_by, modules))
    wants_logits = metric is not None and metric.needs_logits

    def step(c: int, microbatch: int, input_sbh):
        model, module = chunks[c], modules[c]
        b = dict.fromkeys(("tokens", "labels", "loss_mask", "position_ids", "attention_mask"))
        if feed.needed_by(module):
            b = feed.get(microbatch)
        module.set_input_tensor(input_sbh)
        out = model(b["tokens"], position_ids=b["position_ids"],
                    labels=b["labels"] if module.post_process and not wants_logits else None,
                    attention_mask=b["attention_mask"])
        module.set_input_tensor(None)
        if not module.post_process:
            return out
        if metric is not None:
            return metric(out, b)
        return (out.float() * b["loss_mask"]).sum() / b["loss_mask"].sum()

    return step


def _p2p_communicator(tr) -> Optional[P2PCommunicator]:
    ps, m = tr.rt.ps, tr.config.model
    if ps.pp_size == 1:
        return None
    shape = tensor_shape(tr.config.data.seq_length, tr.config.data.micro_batch_size,
                         m.hidden_size, ps.tp_size, m.sequence_parallel)
    dtype = torch.float32 if m.fp32_residual_connection else m.params_dtype
    return P2PCommunicator(ps.ranks("pp"), shape, dtype, tr.rt.device, ps.pp_group)


def model_chunks(tr) -> list:
    """This rank's model chunks (a list even when `tr.model` is a single wrapper)."""
    return list(tr.model) if isinstance(tr.model, torch.nn.ModuleList) else [tr.model]


def _action_watch(tr, num_chunks: int):
    """The executor's hook that puts the schedule under the watchdog (megatron/watchdog.py;
    None without one), one action at a time: a wait for a batch of pipeline transfers is
    a watched block whose check-ins are its transfers, each with the rank at its other
    end; with tp > 1 a forward or backward is one watched over the tensor-parallel group
    (the collectives inside its layers), whose overrun compares how many collectives each
    member issued; at tp 1 it only records the phase (no check-in: no one waits for this
    rank inside it). Posting transfers waits for no one. A check-in is an in-memory
    count (the watchdog's monitor thread publishes them): no store call per action."""
    wd = getattr(tr, "watchdog", None)
    if not isinstance(wd, CollectiveWatchdog):
        return None
    ps = tr.rt.ps
    pp_ranks, tp_ranks = ps.ranks("pp"), ps.ranks("tp")
    progress = issued_collectives(ps.tp_group) if ps.tp_size > 1 else None
    none = contextlib.nullcontext()

    def watch(a):
        if a.kind == COMM:
            return none
        phase = action_phase(a, ps.pp_rank, ps.pp_size, num_chunks)
        if a.kind == WAIT:
            return wd.watch(phase, points=[
                (transfer_name(op, ps.pp_rank, ps.pp_size, num_chunks),
                 (wd.rank, pp_ranks[op.peer])) for op in a.ops])
        if ps.tp_size > 1:
            return wd.watch(phase, ranks=tp_ranks, progress=progress)
        return wd.phase(phase)

    return watch


def run_schedule(tr, data: Iterator[dict], num_micro: int, forward_only: bool = False,
                 metric=None) -> torch.Tensor:
    """Run the micro-batches through this rank's pipeline schedule (plain gradient
    accumulation when pp == 1, 1F1B, or interleaved 1F1B with virtual stages); returns
    the SUM over the micro-batches of what the last stage computes (a 0-dim fp32 tensor,
    this DP replica): each micro-batch's masked mean loss, or with `metric` (forward only)
    `metric(output, batch)`, where output is the per-token loss [b, s] (fp32), or the
    vocabulary-parallel logits [b, s, V/tp] when `metric.needs_logits` is true. With
    pp > 1 the sum, computed on the last stage, is broadcast over the pipeline group so
    that every rank returns it."""
    ps = tr.rt.ps
    chunks = model_chunks(tr)
    plan = build_schedule(ps.pp_size, num_micro, len(chunks), forward_only,
                          tr.config.parallel.overlap_p2p_comm)[ps.pp_rank]
    feed = _MicroBatchFeed(data, tr.rt.device, tr.eod, tr.config.data, step_log(tr).timers)
    scale_loss = tr.optimizer.scale_loss if tr.optimizer is not None else (lambda x: x)
    executor = ScheduleExecutor(
        chunks, _forward_step(chunks, feed, metric),
        _p2p_communicator(tr), ps.pp_rank, ps.pp_size, num_micro,
        scale_loss=scale_loss, forward_only=forward_only, device=tr.rt.device,
        # level-2 timers only; evaluation is not timed
        timers=None if forward_only else step_log(tr).core_timers(2),
        watch=_action_watch(tr, len(chunks)))
    result = executor.run(plan)
    total = result.loss_sum
    if total is None:
        total = torch.zeros((), dtype=torch.float32, device=tr.rt.device)
    if ps.pp_size > 1:
        with _watch(tr, "loss broadcast (pipeline group)", "pp"):
            dist.broadcast(total, src=ps.ranks("pp")[-1], group=ps.pp_group)
    return total


def forward_backward(tr, data: Iterator[dict], num_micro: int,
                     forward_only: bool = False) -> torch.Tensor:
    """`run_schedule` over `num_micro` micro-batches; returns the mean loss over them (a
    0-dim tensor, this DP replica, on every pipeline rank). Each micro-batch loss is
    divided by num_micro before backward."""
    return run_schedule(tr, data, num_micro, forward_only) / num_micro


def _watch(tr, name: str, group_kind: str, progress: bool = False):
    """Name the ranks that never arrive if this collective hangs (see megatron/watchdog).
    `progress`: when every member arrived, compare the collectives each issued on the
    group, naming one stuck in the block before its collective."""
    wd = getattr(tr, "watchdog", None)
    if wd is None:
        return contextlib.nullcontext()
    if not progress:
        return wd.watch(name, ranks=tr.rt.ps.ranks(group_kind))
    issued = issued_collectives(tr.rt.ps.group(group_kind))
    return wd.watch(name, ranks=tr.rt.ps.ranks(group_kind), progress=issued)


def watch_group(tr, name: str, group, also: Tuple[Tuple[str, object], ...] = ()):
    """`_watch` with progress over the process group `group` (None: the world), whose
    ranks are looked up once a run; nothing without a watchdog or when the group is this
    rank alone (no one to wait for). `also`: (label, group) pairs of the other groups the
    block issues collectives on; progress then counts per group (`issued_collectives_on`)."""
    wd = getattr(tr, "watchdog", None)
    if not isinstance(wd, CollectiveWatchdog):  # none, or a single process's
        return contextlib.nullcontext()
    group = dist.group.WORLD if group is None else group
    cache = step_log(tr).group_ranks
    ranks = cache.get(group)
    if ranks is None:
        ranks = cache[group] = tuple(dist.get_process_group_ranks(group))
    if len(ranks) == 1:
        return contextlib.nullcontext()
    progress = issued_collectives(group)
    if also:
        label = "all ranks" if len(ranks) == dist.get_world_size() else "its group"
        progress = issued_collectives_on(((label, group),) + also)
    return wd.watch(name, ranks=ranks, progress=progress)


def _optimizer_step_name(opt) -> str:
    """What the optimizer step waits for, for the watchdog's report: 'optimizer step
    (found-inf and grad-norm all-reduces over the model-parallel group)'; with the
    distributed optimizer the reductions are over all ranks and the updated parameters
    are all-gathered over the data-parallel group."""
    distributed = isinstance(opt, DistributedOptimizer)
    what = [w for w, on in (("found-inf", getattr(opt, "grad_scaler", None) is not None),
                            ("grad-norm", opt.clip_grad > 0.0),
                            ("zero-count", opt.log_num_zeros_in_grad)) if on]
    parts = []
    if what:
        parts.append(f"{' and '.join(what)} all-reduce{'s' if len(what) > 1 else ''} over "
                     f"{'all ranks' if distributed else 'the model-parallel group'}")
    if distributed and opt.dp_group is not None:
        parts.append("parameter all-gather over the data-parallel group")
    return f"optimizer step ({', '.join(parts) or 'no collective'})"


def watch_optimizer(tr, name: Optional[str] = None):
    """The watched block of a collective over the optimizer's reduction group (the
    model-parallel group; all ranks with the distributed optimizer): by default its
    step, named by `_optimizer_step_name`, whose progress also counts the distributed
    optimizer's parameter all-gather over the data-parallel group (a rank stuck between
    the norm's all-reduce and that all-gather is level with the others on the first).
    Nothing when the reduction group is this rank alone."""
    opt = tr.optimizer
    also: Tuple[Tuple[str, object], ...] = ()
    if name is None:
        log = step_log(tr)
        if log.optimizer_step_name is None:
            log.optimizer_step_name = _optimizer_step_name(opt)
        name = log.optimizer_step_name
        if isinstance(opt, DistributedOptimizer) and opt.dp_group is not None:
            also = (("the data-parallel group", opt.dp_group),)
    group = getattr(opt, "mp_group", None)
    if group is None:
        return contextlib.nullcontext()
    return watch_group(tr, name, group, also)


PARAM_SYNC_WAIT = ("parameter all-gather of the optimizer step, waited for in the forward "
                   "(data-parallel group, --overlap-param-gather)")


def watch_param_sync(tr) -> None:
    """With --overlap-param-gather the distributed optimizer's step only launches its
    parameter all-gather; the next forward waits for it, in no watched block at tp 1 (a
    rank that never launched it left the others waiting there until the process group's
    timeout). Puts each such wait (one per bucket and step, only where one is in
    flight) under the watchdog, over the data-parallel group. Nothing without a
    watchdog, the overlap or data parallelism."""
    wd, dp_group = getattr(tr, "watchdog", None), tr.rt.ps.dp_group
    if (not isinstance(wd, CollectiveWatchdog) or dp_group is None
            or not tr.config.parallel.overlap_param_gather):
        return
    ranks = tuple(tr.rt.ps.ranks("dp"))
    for chunk in model_chunks(tr):
        if hasattr(chunk, "watch_param_sync"):  # the DistributedDataParallel wrapper
            chunk.watch_param_sync(lambda: wd.watch(PARAM_SYNC_WAIT, ranks=ranks))


def _watch_tied_embedding(tr):
    """The watched block of the tied word-embedding all-reduce on the ranks that take part
    (pp > 1, tied weights: the first and last stage); nothing elsewhere."""
    ps = tr.rt.ps
    if ps.embedding_group is None or not tied_embedding_weights(model_chunks(tr), ps):
        return contextlib.nullcontext()
    return _watch(tr, "tied word-embedding gradient all-reduce (embedding group: first and "
                  "last pipeline stage)", "embedding", progress=True)


def loss_is_finite_everywhere(loss: torch.Tensor) -> bool:
    """True when no rank saw a NaN/Inf loss. Collective (MAX over the world) and a host
    synchronisation: used only when the NaN policy must act before the optimizer step."""
    bad = (~torch.isfinite(loss)).to(torch.float32).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


def _empty_cache(device: torch.device, wanted: bool) -> None:
    """`--empty-unused-memory-level`: hand cached, unused CUDA blocks back (1: after the
    forward-backward pass, 2: also after the optimizer step). Nothing on CPU."""
    if wanted and device.type == "cuda":
        torch.cuda.empty_cache()


def sync_replicas(tr) -> None:
    """`--data-parallel-random-init`: every DP rank drew its own initial weights (its
    seed includes 10 * dp_rank); copy DP rank 0's into the others before the first step
    and refresh the optimizer's main copies. Collective: one broadcast per parameter
    over the data-parallel group. Only for a fresh start (iteration 0): loaded weights
    are the same on every replica already. Once per run: before the first step, or
    before the evaluation of a --skip-train run (Megatron broadcasts when it builds the
    model, so an evaluation-only run scores DP rank 0's model, not a mean over replicas)."""
    log = step_log(tr)
    log.replicas_synced = True
    if tr.state.iteration != 0 or tr.rt.ps.dp_group is None:
        return
    with watch_group(tr, "--data-parallel-random-init broadcast of the weights "
                     "(data-parallel group)", tr.rt.ps.dp_group):
        for chunk in model_chunks(tr):
            if hasattr(chunk, "broadcast_params"):  # the DistributedDataParallel wrapper
                chunk.broadcast_params()
    tr.optimizer.reload_model_params()


def _finish_grads(tr, timers) -> None:
    """Data-parallel reduction, then the tied-embedding and sequence-parallel all-reduces.
    `timers`: the level-1 hook (`StepLog.core_timers(1)`, None at level 0): like
    Megatron's, these level-1 timers start behind the world barrier unless
    --no-barrier-with-level-1-timing."""
    ps = tr.rt.ps
    name = ("grads-reduce-scatter" if tr.config.parallel.use_distributed_optimizer
            else "grads-all-reduce")
    with _watch(tr, "gradient reduction (data-parallel group)", "dp"), timed(timers, name):
        tr.model.finish_grad_sync()
    with _watch_tied_embedding(tr), timed(timers, "embedding-grads-all-reduce"):
        allreduce_tied_embedding_grads(model_chunks(tr), ps)  # pp > 1: first + last stage
    with timed(timers, "layernorm-grads-all-reduce"):  # timed always, as by Megatron-LM
        if tr.config.model.sequence_parallel:
            with watch_group(tr, "sequence-parallel layer-norm and bias gradient all-reduce "
                             "(tensor-parallel group)", ps.tp_group):
                allreduce_sequence_parallel_grads(tr.model, ps.tp_group)


def _average_loss(tr, loss: torch.Tensor) -> None:
    """The loss averaged over the data-parallel replicas, in place (all-reduce SUM over
    the data-parallel group, then / dp_size); nothing at dp 1."""
    ps = tr.rt.ps
    if ps.dp_group is not None:
        with watch_group(tr, "loss average (data-parallel group)", ps.dp_group):
            dist.all_reduce(loss, group=ps.dp_group)
        loss /= ps.dp_size


def _step_body(tr, data: Iterator[dict], skip_nonfinite: bool = False):
    """Zero the grads, forward/backward over the micro-batches, finish the gradient
    reductions, step the optimizer: what a whole-step CUDA graph records (megatron/
    step_graph.py). Returns (loss, ok, grad_norm, num_zeros)."""
    cfg, log = tr.config, step_log(tr)
    tr.optimizer.zero_grad()
    tr.model.zero_grad_buffer()
    timer = log.timers("forward-backward", 1)
    timer.start(barrier=log.barrier)
    loss = forward_backward(tr, data, cfg.data.num_micro_batches)
    timer.stop()
    _empty_cache(tr.rt.device, cfg.training.empty_unused_memory_level >= 1)
    _finish_grads(tr, log.core_timers(1))
    tr.last_local_loss = loss.detach().clone()  # this rank's own loss, to name a NaN's origin
    _average_loss(tr, loss)
    if skip_nonfinite:
        with watch_group(tr, "NaN/Inf loss check (all ranks)", None):
            finite = loss_is_finite_everywhere(loss)
        if not finite:
            return loss, False, None, None
    timer = log.timers("optimizer", 1)
    timer.start(barrier=log.barrier)
    with watch_optimizer(tr):
        ok, grad_norm, num_zeros = tr.optimizer.step(timers=log.core_timers(1))
    timer.stop()
    _empty_cache(tr.rt.device, cfg.training.empty_unused_memory_level >= 2)
    return loss, ok, grad_norm, num_zeros


def train_step(tr, data: Iterator[dict], skip_nonfinite: bool = False):
    """One optimizer step over a global batch. Returns (dp-averaged loss tensor,
    update_successful, grad_norm tensor or None, num_zeros tensor or None). With
    `skip_nonfinite`, a NaN/Inf loss on any rank skips the optimizer step (all ranks
    agree). With --rampup-batch-size the step first sets the current global batch size
    and micro-batch count from the consumed samples (megatron/microbatches.py). From the
    third step on, the step may be a replay of a captured CUDA graph (--cuda-graph-step);
    an fp16 replay returns update_successful as a 0-dim bool tensor on the device, read
    without stalling the GPU at the next log line (megatron/step_graph.py)."""
    cfg, log = tr.config, step_log(tr)
    update_micro_batches(cfg.data, tr.state.consumed_train_samples, tr.rt.ps.dp_size)
    if cfg.training.data_parallel_random_init and not log.replicas_synced:
        sync_replicas(tr)
    runner = None if skip_nonfinite else runner_for(tr)
    if runner is not None:
        loss, ok, grad_norm, num_zeros = runner.step(tr, data, _step_body)
    else:
        loss, ok, grad_norm, num_zeros = _step_body(tr, data, skip_nonfinite)
    if torch.is_tensor(ok) or ok:  # a tensor: decided on the device, counted as updated
        tr.scheduler.step(increment=cfg.data.global_batch_size)
    if num_zeros is not None:
        log.num_zeros[tr.state.iteration + 1] = num_zeros
    return loss, ok, grad_norm, num_zeros
