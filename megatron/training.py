"""pretrain(): build everything, then the loop -- train_step, logging, eval, checkpoints, exit.

`train_step` reads top to bottom: micro-batches -> forward/backward -> finish the
data-parallel gradient reduction -> optimizer step (may skip) -> lr step.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron import checkpointing, step_graph, trainer_checkpoint
from megatron.config import Config
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt.stages import build_stage_models, sync_tied_embeddings
from megatron.core.optimizer import OptimizerParamScheduler, build_optimizer
from megatron.core.pipeline_parallel import ModelChunks
from megatron.data_loading import build_datasets, build_tokenizer_for, make_iterator
from megatron.initialize import Runtime
from megatron.logging_utils import (
    TensorboardLogger,
    flops_per_token,
    format_iteration_line,
    format_validation_block,
    print_rank_0,
    print_rank_last,
)
from megatron.profiling import StepProfiler
from megatron.signals import SignalHandler
from megatron.train_step import forward_backward, train_step  # noqa: F401 (re-exported)
from megatron.watchdog import build_watchdog


@dataclass
class TrainState:
    """Counters that a checkpoint restores."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    skipped_iters: int = 0
    nan_iters: int = 0

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, sd: dict) -> None:
        for k in self.__dict__:
            if k in sd:
                setattr(self, k, int(sd[k]))


@dataclass
class Trainer:
    """The live objects of one run."""

    config: Config
    rt: Runtime
    model: ModelChunks  # this rank's chunk(s); `.module` when there is one
    optimizer: object
    scheduler: OptimizerParamScheduler
    state: TrainState = field(default_factory=TrainState)
    tb: Optional[TensorboardLogger] = None
    signals: Optional[SignalHandler] = None
    eod: Optional[int] = None  # end-of-document token, for the reset/eod-mask flags
    start_time: float = field(default_factory=time.time)
    start_iteration: int = 0
    watchdog: object = None
    last_local_loss: Optional[torch.Tensor] = None
    async_saver: object = None  # megatron.async_save.AsyncSaver once --async-save has saved
    step_log: object = None  # megatron.train_step.StepLog, built at the first step
    # megatron.step_graph.StepGraph (False: graphs off), decided at the first step
    step_graph: object = None


# --------------------------------------------------------------------------- building
def build_model(config: Config, rt: Runtime) -> ModelChunks:
    """This rank's model chunks (one, or one per virtual pipeline stage), each wrapped for
    data-parallel gradient reduction. With pp > 1 and tied embeddings the last stage's
    output-embedding copy starts as the first stage's embedding (broadcast)."""
    models = build_stage_models(config.model, rt.ps, rt.rng_tracker, rt.device,
                                config.parallel.virtual_pp_size,
                                config.parallel.standalone_embedding_stage)
    for model in models:
        model.to(rt.device)
    n_params = sum(p.numel() for model in models for p in model.parameters())
    print(f" > number of parameters on (tensor, pipeline) model parallel rank "
          f"({rt.ps.tp_rank}, {rt.ps.pp_rank}): {n_params}", flush=True) if rt.ps.dp_rank == 0 else None
    sync_tied_embeddings(models, rt.ps)
    return ModelChunks(DistributedDataParallel(m, rt.ps, config.parallel) for m in models)


GEMM_TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm_tables")


def activate_gemm_algorithms(config: Config, rt: Runtime) -> None:
    """`--gemm-algorithms`: auto (the default) -> the tables shipped in megatron/gemm_tables
    that were measured on this GPU model with this cuBLASLt version (none on the CPU or
    elsewhere: torch's products); FILE -> that table (one measured on another GPU model or
    cuBLASLt version is refused, naming both); none -> torch's products. A table a
    previous trainer of this process used is dropped first."""
    from megatron.core.tensor_parallel import gemm_algos

    choice = config.args.get("gemm_algorithms") or "none"
    gemm_algos.activate({}, rt.device)
    if choice == "none" or (choice == "auto" and rt.device.type != "cuda"):
        return
    device_name = torch.cuda.get_device_name(rt.device)
    if choice != "auto":
        table = gemm_algos.load_table(choice, device_name, gemm_algos.cublaslt().version)
        gemm_algos.activate(table, rt.device)
        print_rank_0(f"> --gemm-algorithms {choice}: {len(table)} product shapes use the "
                     "measured cuBLASLt algorithm")
        return
    try:
        version = gemm_algos.cublaslt().version
    except (OSError, RuntimeError, AttributeError) as e:  # no libcublasLt, or an old one
        print_rank_0(f"> --gemm-algorithms auto: cuBLASLt cannot be called here ({e}); "
                     "torch's products")
        return
    table, used = gemm_algos.shipped_tables(GEMM_TABLES, device_name, version)
    gemm_algos.activate(table, rt.device)
    if used:
        print_rank_0(f"> --gemm-algorithms auto: products of the {len(table)} shapes in "
                     f"{', '.join(os.path.basename(u) for u in used)} (measured on "
                     f"{device_name}) use the measured cuBLASLt algorithm, all others "
                     "torch's (--gemm-algorithms none: torch's for all)")
    else:
        print_rank_0(f"> --gemm-algorithms auto: no table shipped for {device_name} with "
                     f"cuBLASLt {version}; torch's products (measure your own: "
                     "python tools/tune_gemms.py --out FILE -- <your flags>)")


def build_trainer(config: Config, rt: Runtime) -> Trainer:
    activate_gemm_algorithms(config, rt)
    model = build_model(config, rt)
    optimizer = build_optimizer(config.optimizer, model.unwrapped(), rt.ps)
    scheduler = OptimizerParamScheduler(optimizer, config.optimizer)
    tb = TensorboardLogger(config.logging, is_writer_rank=rt.ps.rank == rt.ps.world_size - 1)
    return Trainer(config, rt, model, optimizer, scheduler, TrainState(), tb)


def data_iterator(config: Config, rt: Runtime, split: str, consumed: int,
                  datasets: Optional[dict] = None) -> Optional[Iterator[dict]]:
    """Micro-batches of `split` for this DP rank from `consumed` samples on. Builds the
    datasets when not given (collective when distributed)."""
    if datasets is None:
        vocab = config.data.vocab_size or config.model.padded_vocab_size
        datasets = build_datasets(config, rt.ps.rank, vocab)
    return make_iterator(config, datasets[split], consumed, rt.ps.dp_rank, rt.ps.dp_size,
                         pin=rt.device.type == "cuda")


@torch.no_grad()
def evaluate(tr: Trainer, data: Iterator[dict]) -> float:
    """Mean validation loss over --eval-iters global batches (all ranks agree)."""
    cfg = tr.config
    tr.model.eval()
    total = torch.zeros((), device=tr.rt.device)
    for _ in range(cfg.training.eval_iters):
        total += forward_backward(tr, data, cfg.data.num_micro_batches, forward_only=True)
        tr.state.consumed_valid_samples += cfg.data.global_batch_size
    tr.model.train()
    if tr.rt.ps.dp_group is not None:
        dist.all_reduce(total, group=tr.rt.ps.dp_group)
        total /= tr.rt.ps.dp_size
    return total.item() / max(cfg.training.eval_iters, 1)


def run_evaluation(tr: Trainer, data, prefix: str) -> None:
    loss = evaluate(tr, data)
    block = format_validation_block(prefix, {"lm loss": loss})
    print_rank_last(block)
    if tr.tb is not None:
        tr.tb.log_validation(tr.state.iteration, tr.state.consumed_train_samples, {"lm loss": loss})


# --------------------------------------------------------------------------- logging
class IntervalStats:
    """Losses and times since the last console line. Per-iteration values stay on the
    device until the log interval, so the step itself never waits for the host."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.records: List[tuple] = []  # (iteration, consumed, lr, loss, scale, norm, ok, counted, local)
        self.start = time.time()

    def add(self, tr: Trainer, loss, ok, grad_norm, counted: bool = False) -> None:
        """Record one iteration; `counted`: a NaN already counted by the NaN policy."""
        scale = tr.optimizer.get_loss_scale()
        if getattr(tr.optimizer, "grad_scaler", None) is not None:
            scale = scale.clone()  # the scaler updates its tensor in place
        lr = tr.scheduler.get_lr()
        if torch.is_tensor(ok):  # decided on the device: the lr after it if it skipped too
            lr = (lr, tr.scheduler.get_lr(tr.scheduler.num_steps
                                          - tr.config.data.global_batch_size))
        self.records.append((tr.state.iteration, tr.state.consumed_train_samples,
                             lr, loss, scale, grad_norm, ok, counted, tr.last_local_loss))

    def read_flags(self, st: TrainState) -> None:
        """Read the update flags that fp16 replays left on the device (after a sync: no
        wait), count their skips, and pick each one's lr; a skipped step shows no norm."""
        resolved = []
        for it, consumed, lr, loss, scale, norm, ok, counted, local in self.records:
            if torch.is_tensor(ok):
                ok = bool(ok)
                st.skipped_iters += 0 if ok else 1
                lr = lr[0] if ok else lr[1]
            resolved.append((it, consumed, lr, loss, scale, norm if ok else None, ok,
                             counted, local))
        self.records = resolved


def _to_float(x) -> Optional[float]:
    if x is None:
        return None
    return float(x.item()) if torch.is_tensor(x) else float(x)


def log_interval(tr: Trainer, stats: IntervalStats) -> None:
    """Print Megatron's iteration line (and timer block), write tensorboard scalars, count
    NaN iterations. Collective with --log-params-norm or timers: every rank calls it."""
    from megatron.train_step import interval_extras, log_timers

    cfg, st = tr.config, tr.state
    if tr.rt.device.type == "cuda":
        # Collectives are asynchronous on NCCL: a hang shows up here.
        with tr.watchdog.watch("step synchronisation at the log interval") if tr.watchdog else contextlib.nullcontext():
            torch.cuda.synchronize()
    elapsed = time.time() - stats.start
    stats.read_flags(st)
    step_graph.settle(tr)
    n = max(len(stats.records), 1)
    extras = interval_extras(tr, n)
    last_it = stats.records[-1][0]
    good_losses = []
    # The line counts skipped and NaN iterations of this interval, as Megatron's does (its
    # counters restart at every print); TrainState keeps the run's totals.
    interval_skipped = interval_nans = 0
    for it, consumed, lr, loss, scale, norm, ok, counted, _ in stats.records:
        loss_f, norm_f = _to_float(loss), _to_float(norm)
        interval_skipped += 0 if ok else 1
        if not math.isfinite(loss_f):
            st.nan_iters += 0 if counted else 1
            interval_nans += 1
        elif ok:
            good_losses.append(loss_f)
        if tr.tb is not None and it % cfg.logging.tensorboard_log_interval == 0:
            last = it == last_it  # the norm, memory and timers are of the interval's end
            tr.tb.log_training(it, consumed, lr, cfg.data.global_batch_size, {"lm loss": loss_f},
                               _to_float(scale), norm_f, _to_float(extras.num_zeros.get(it)),
                               extras.params_norm if last else None, tr.rt.ps.world_size,
                               extras.memory if last else None, extras.timers if last else None)
    it, consumed, lr, _, scale, norm, _, _, _ = stats.records[-1]
    tokens_per_gpu = cfg.data.global_batch_size * cfg.data.seq_length * n / elapsed / tr.rt.ps.world_size
    m = cfg.model
    tflops = tokens_per_gpu * flops_per_token(m.num_layers, m.hidden_size, cfg.data.seq_length,
                                              m.padded_vocab_size) / 1e12
    line = format_iteration_line(
        it, cfg.training.train_iters, consumed, elapsed * 1000.0 / n, lr,
        cfg.data.global_batch_size,
        {"lm loss": sum(good_losses) / len(good_losses)} if good_losses else {},
        _to_float(scale), _to_float(norm), _to_float(extras.num_zeros.get(it)),
        extras.params_norm, interval_skipped, interval_nans, tokens_per_gpu, tflops,
    )
    print_rank_last(line)
    print_rank_last(progress_line(it, cfg.training.train_iters, time.time() - tr.start_time,
                                  tr.start_iteration))
    log_timers(tr, n)
    if tr.tb is not None:
        extra = {"tokens-per-sec-per-gpu": tokens_per_gpu, "tflops-per-gpu": tflops,
                 "mfu": tflops * 1e12 / PEAK_FLOPS}
        if tr.rt.device.type == "cuda":
            extra["mem-max-allocated-gb"] = torch.cuda.max_memory_allocated() / 2**30
        tr.tb.log_scalars(it, consumed, extra)
        tr.tb.log_iteration_time(it, elapsed / n)
        tr.tb.flush()
    stats.reset()


PEAK_FLOPS = 989e12  # H100/H200 dense bf16, the MFU denominator


def progress_line(iteration: int, train_iters: int, elapsed_s: float, start_iteration: int) -> str:
    """' progress: 40.0% (120/300) | elapsed 0:01:02 | ETA 0:01:30 |' from this run's pace."""
    done = iteration - start_iteration
    left = max(train_iters - iteration, 0)
    eta = elapsed_s / done * left if done > 0 else float("nan")
    fmt = lambda sec: "?" if not math.isfinite(sec) else time.strftime("%H:%M:%S", time.gmtime(sec))
    return (f" progress: {100.0 * iteration / max(train_iters, 1):.1f}% ({iteration}/{train_iters}) "
            f"| elapsed {fmt(elapsed_s)} | ETA {fmt(eta)} |")


# --------------------------------------------------------------------------- the loop
def _should_exit(tr: Trainer, start_time: float) -> Optional[str]:
    """Exit reason shared by all ranks (signals, duration, interval), or None."""
    t = tr.config.training
    it = tr.state.iteration
    if tr.signals is not None:
        name = tr.signals.any_rank_received(tr.rt.control_group)
        if name:
            return f"[exiting program after receiving {name}.]"
    if t.exit_duration_in_mins:
        # The longest-running rank decides, and the message gives its time.
        minutes = torch.tensor([(time.time() - start_time) / 60.0], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(minutes, op=dist.ReduceOp.MAX, group=tr.rt.control_group)
        if minutes.item() > t.exit_duration_in_mins:
            return f"[exiting program after {minutes.item()} minutes]"
    if t.exit_interval and it % t.exit_interval == 0:
        return f"[exiting program at iteration {it}]"
    return None


def _report_nan(tr: Trainer, iteration: int, local: Optional[torch.Tensor]) -> str:
    """Print which rank produced the non-finite loss; return the message for all ranks."""
    if local is not None and not torch.isfinite(local).all():
        print(f"[rank {tr.rt.ps.rank}] non-finite loss ({float(local)}) at iteration {iteration}",
              flush=True)
    return f"NaN/Inf loss at iteration {iteration}"


def _check_pending_nan(tr: Trainer, stats: IntervalStats) -> None:
    """Policy 'stop': losses are checked at log intervals and before saves (no per-step
    host sync); a non-finite one stops the run naming its iteration."""
    for it, _, _, loss, _, _, _, _, local in stats.records:
        if not math.isfinite(_to_float(loss)):
            msg = _report_nan(tr, it, local)
            log_interval(tr, stats)
            raise SystemExit(f"error: {msg}; stopping (--nan-loss-policy stop). Resume from "
                             f"the last checkpoint, or use --nan-loss-policy skip|rollback")


def _rollback(tr: Trainer, iteration: int) -> None:
    """Reload the last checkpoint of --save; keep the data position, so the batches since
    that checkpoint (the offending one included) are skipped."""
    ck = tr.config.checkpoint
    trainer_checkpoint.wait_for_async_save(tr)  # the checkpoint being written may be the last one
    tracker = checkpointing.read_tracker(ck.save)[0] if ck.save else None
    if not tracker:
        raise SystemExit(f"error: NaN/Inf loss at iteration {iteration} and no checkpoint in "
                         f"--save to roll back to; stopping")
    keep = (tr.state.consumed_train_samples, tr.state.consumed_valid_samples,
            tr.state.skipped_iters, tr.state.nan_iters)
    saved = tr.config.checkpoint
    tr.config.checkpoint = dataclasses.replace(saved, load=saved.save, finetune=False,
                                               no_load_optim=saved.no_save_optim,
                                               no_load_rng=saved.no_save_rng)
    try:
        trainer_checkpoint.load_trainer_checkpoint(tr)
    finally:
        tr.config.checkpoint = saved
    (tr.state.consumed_train_samples, tr.state.consumed_valid_samples,
     tr.state.skipped_iters, tr.state.nan_iters) = keep
    print_rank_0(f" > rolled back from iteration {iteration} to {tr.state.iteration}; "
                 f"continuing at sample {tr.state.consumed_train_samples}")


def _after_step(tr: Trainer, stats: IntervalStats, loss, ok: bool, grad_norm) -> bool:
    """Count the step; apply the NaN policy. Returns False when the step was rolled back."""
    cfg, st = tr.config, tr.state
    st.iteration += 1
    st.consumed_train_samples += cfg.data.global_batch_size
    if not torch.is_tensor(ok):  # a tensor (fp16 replay): counted at the log line
        st.skipped_iters += 0 if ok else 1
    policy = cfg.training.nan_loss_policy
    if policy != "stop" and not ok and not math.isfinite(_to_float(loss)):
        st.nan_iters += 1
        msg = _report_nan(tr, st.iteration, tr.last_local_loss)
        print_rank_0(f" > {msg}: optimizer step skipped (--nan-loss-policy {policy})")
        if policy == "rollback":
            _rollback(tr, st.iteration)
            return False
        loss = torch.zeros(()) * float("nan")  # recorded, not averaged, not counted twice
        stats.add(tr, loss, ok, grad_norm, counted=True)
        return True
    stats.add(tr, loss, ok, grad_norm)
    return True


def _periodic(tr: Trainer, stats: IntervalStats, valid_data) -> bool:
    """Log, evaluate and save when due. Returns True when a checkpoint was just saved."""
    cfg, st = tr.config, tr.state
    if st.iteration % cfg.logging.log_interval == 0:
        if cfg.training.nan_loss_policy == "stop":
            _check_pending_nan(tr, stats)
        log_interval(tr, stats)
    t = cfg.training
    if t.eval_interval and st.iteration % t.eval_interval == 0 and valid_data is not None:
        run_evaluation(tr, valid_data, f"iteration {st.iteration}")
    ck = cfg.checkpoint
    if ck.save and ck.save_interval and st.iteration % ck.save_interval == 0:
        _save(tr, stats)
        return True
    return False


def _save(tr: Trainer, stats: IntervalStats) -> None:
    if tr.config.training.nan_loss_policy == "stop":
        _check_pending_nan(tr, stats)  # never checkpoint weights a NaN step produced
    trainer_checkpoint.save_trainer_checkpoint(tr)


def train(tr: Trainer, train_data, valid_data) -> None:
    cfg, st = tr.config, tr.state
    stats = IntervalStats()
    start_time = time.time()
    tr.model.train()
    saved_at = None
    check_each_step = cfg.training.nan_loss_policy != "stop"
    tr.start_time, tr.start_iteration = time.time(), st.iteration
    profiler = StepProfiler.from_args(cfg.args, tr.rt.ps.rank, cfg.logging.tensorboard_dir)
    while st.iteration < cfg.training.train_iters:
        profiler.before_step(st.iteration + 1)
        with profiler.step_range(st.iteration + 1):
            loss, ok, grad_norm, _ = train_step(tr, train_data, skip_nonfinite=check_each_step)
        profiler.after_step(st.iteration + 1)
        if not _after_step(tr, stats, loss, ok, grad_norm):
            continue
        if _periodic(tr, stats, valid_data):
            saved_at = st.iteration
        reason = _should_exit(tr, start_time)
        if reason:
            if stats.records:
                log_interval(tr, stats)
            if cfg.checkpoint.save and saved_at != st.iteration:
                _save(tr, stats)
            elif not cfg.checkpoint.save and tr.signals is not None:
                print_rank_0("WARNING: exiting without a checkpoint: --save is not set")
            trainer_checkpoint.wait_for_async_save(tr)
            print_rank_0(f"{reason} datetime: {time.strftime('%Y-%m-%d %H:%M:%S')} ")
            return
    if stats.records:
        log_interval(tr, stats)
    step_graph.settle(tr)
    if cfg.checkpoint.save and st.iteration > 0 and saved_at != st.iteration:
        _save(tr, stats)
    trainer_checkpoint.wait_for_async_save(tr)


def pretrain(config: Config, rt: Runtime) -> Trainer:
    """Check --save; build model, optimizer and data; load; train; evaluate at the end."""
    if config.checkpoint.save:
        checkpointing.check_save_dir(config.checkpoint.save, rt.ps)  # not after training
    tr = build_trainer(config, rt)
    tr.watchdog = build_watchdog(config.parallel.distributed_timeout_minutes * 60)
    if config.training.exit_signal_handler:
        tr.signals = SignalHandler()
    if config.checkpoint.load:
        trainer_checkpoint.load_trainer_checkpoint(tr)
    print_rank_0(f"[after model, optimizer, and learning rate scheduler are built] datetime: "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')} ")
    if tr.tb is not None:
        tr.tb.log_args(config.args, tr.state.iteration)
        ps = rt.ps
        tr.tb.log_text("parallel layout", f"world {ps.world_size} = tensor {ps.tp_size} x "
                       f"pipeline {ps.pp_size} x data {ps.dp_size}; sequence parallel "
                       f"{config.model.sequence_parallel}; backend {rt.backend}", tr.state.iteration)
    vocab = config.data.vocab_size or config.model.padded_vocab_size
    tokenizer = build_tokenizer_for(config)
    tr.eod = None if tokenizer is None else tokenizer.eod
    datasets = build_datasets(config, rt.ps.rank, vocab)
    print_rank_0(f"[after dataloaders are built] datetime: {time.strftime('%Y-%m-%d %H:%M:%S')} ")
    train_data = data_iterator(config, rt, "train", tr.state.consumed_train_samples, datasets)
    valid_data = None
    if config.training.eval_iters > 0:
        valid_data = data_iterator(config, rt, "valid", tr.state.consumed_valid_samples, datasets)
    if not config.training.skip_train:
        print_rank_0(f"[before the start of training step] datetime: {time.strftime('%Y-%m-%d %H:%M:%S')} ")
        train(tr, train_data, valid_data)
        print_rank_0(f"[after training is done] datetime: {time.strftime('%Y-%m-%d %H:%M:%S')} ")
    if valid_data is not None and (config.training.skip_train or config.training.eval_interval):
        draw = config.training.eval_iters * config.data.global_batch_size
        run_evaluation(tr, valid_data, f"iteration {tr.state.iteration} on {draw}-sample draw "
                                       f"from validation set")
    if tr.tb is not None:
        tr.tb.close()
    tr.watchdog.close()
    sys.stdout.flush()
    return tr
