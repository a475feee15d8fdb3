"""pretrain(): build everything, then the loop -- train_step, logging, eval, checkpoints, exit.

The iteration line and TensorBoard scalars are megatron/interval_log.py's.

`train_step` reads top to bottom: micro-batches -> forward/backward -> finish the
data-parallel gradient reduction -> optimizer step (may skip) -> lr step.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from megatron import checkpointing, nan_policy, step_graph, trainer_checkpoint
from megatron.agreed_exit import exit_on_every_rank, max_over_ranks
from megatron.checkpoint_args import train_order_warning, valid_order_warning
from megatron.checkpoint_dirs import UNFINISHED_IDLE_S, unfinished_saves_report
from megatron.config import Config
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt.stages import (
    build_stage_models,
    sync_tied_embeddings,
    tied_embedding_weights,
)
from megatron.core.optimizer import OptimizerParamScheduler, build_optimizer
from megatron.core.pipeline_parallel import ModelChunks
from megatron.custom_script_api import module_getattr, refuse_megatron_call
from megatron.data_iterators import close_iterators, loader_worker_exit, make_iterator
from megatron.data_loading import (
    build_datasets,
    build_tokenizer_for,
    missing_eod_warning,
    no_validation_reason,
    split_sample_counts,
    train_shortfall,
    validation_shortfall,
)
from megatron.gemm_choice import activate_gemm_algorithms
from megatron.initialize import Runtime
from megatron.interrupt import RunProgress, last_checkpoint_text
from megatron.interval_log import (  # noqa: F401 (progress_line re-exported)
    IntervalStats,
    log_interval,
    points_kept_on_stop,
    progress_line,
    to_float,
)
from megatron.logging_utils import (
    TensorboardLogger,
    format_validation_block,
    print_line,
    print_rank_0,
    print_rank_last,
)
from megatron.memory_history import MemoryHistory
from megatron.microbatches import update_micro_batches
from megatron.nan_policy import check_pending_nan, report_nan, rollback
from megatron.oom_report import OomReport
from megatron.profiling import StepProfiler
from megatron.save_lock import lock_save_dir
from megatron.signals import SignalHandler, signal_name
from megatron.tokenizer import eod_or_none
from megatron.train_step import (  # noqa: F401 (forward_backward re-exported)
    StepLog,
    forward_backward,
    step_log,
    sync_replicas,
    train_step,
    watch_param_sync,
)
from megatron.watchdog import build_watchdog, watching

# Megatron-LM's get_model, setup_model_and_optimizer, ...: one clear ImportError
__getattr__ = module_getattr("megatron.training")


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
    tokenizer: object = None  # the run's, when the entry point built it (else built for the data)
    start_time: float = field(default_factory=time.time)
    start_iteration: int = 0
    start_consumed: int = 0  # consumed training samples when this run's loop started
    watchdog: object = None
    last_local_loss: Optional[torch.Tensor] = None
    async_saver: object = None  # megatron.async_save.AsyncSaver once --async-save has saved
    step_log: object = None  # megatron.train_step.StepLog, built at the first step
    # megatron.step_graph.StepGraph (False: graphs off), decided at the first step
    step_graph: object = None
    # --nan-loss-policy rollback: (the furthest iteration a NaN stopped, how many rollbacks
    # in a row have not got past it)
    rollback_streak: Tuple[int, int] = (0, 0)
    # iteration -> how this run has it in --save ("saved", "resumed from"): what a
    # rollback may reload (trainer_checkpoint.rollback_iteration)
    own_checkpoints: Dict[int, str] = field(default_factory=dict)
    process_start_time: Optional[float] = None  # --exit-duration-in-mins counts from it
    exit_reason: Optional[str] = None  # the exit line when an exit condition ended the run
    memory_history: object = None  # megatron.memory_history.MemoryHistory (pretrain's)
    progress: RunProgress = field(default_factory=RunProgress)  # the phase, for Ctrl-C
    checkpoint_args: Optional[dict] = None  # the arguments stored in the loaded checkpoint
    train_set_size: Optional[int] = None  # samples in the train set, once it is built


# --------------------------------------------------------------------------- building
def build_model(config: Config, rt: Runtime, for_training: bool = True) -> ModelChunks:
    """This rank's model chunks (one, or one per virtual pipeline stage), each wrapped for
    data-parallel gradient reduction (not when `for_training` is false: evaluation only,
    no gradient buffers). With pp > 1 and tied embeddings the last stage's
    output-embedding copy starts as the first stage's embedding (broadcast)."""
    models = build_stage_models(config.model, rt.ps, rt.rng_tracker, rt.device,
                                config.parallel.virtual_pp_size,
                                config.parallel.standalone_embedding_stage)
    for model in models:
        model.to(rt.device)
    n_params = sum(p.numel() for model in models for p in model.parameters())
    if rt.ps.dp_rank == 0:  # one write per line: the ranks share torchrun's output
        print_line(f" > number of parameters on (tensor, pipeline) model parallel rank "
                   f"({rt.ps.tp_rank}, {rt.ps.pp_rank}): {n_params}")
    sync_tied_embeddings(models, rt.ps)
    if not for_training:
        return ModelChunks(models)
    for weight in tied_embedding_weights(models, rt.ps):
        # a bucket of its own, sharded alike on both ends: with the distributed optimizer
        # its grads are summed over the embedding group right after the reduce-scatter
        # (unmarked, each step first rebuilt the whole reduced grad: one more all-reduce)
        weight.shared_embedding = True
    return ModelChunks(DistributedDataParallel(m, rt.ps, config.parallel) for m in models)


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
        datasets = build_datasets(config, rt.ps.rank, vocab, rt.control_group)
    return make_iterator(config, datasets[split], consumed, rt.ps.dp_rank, rt.ps.dp_size,
                         pin=rt.device.type == "cuda")


@torch.no_grad()
def evaluate(tr: Trainer, data: Iterator[dict], count_valid_samples: bool = True,
             verbose: bool = False) -> float:
    """Mean loss over --eval-iters global batches (all ranks agree). `count_valid_samples`:
    the batches are the validation set's (the test set's are not counted). `verbose` (the
    final evaluation): Megatron's 'Evaluating iter i/N' every --log-interval batches."""
    cfg = tr.config
    tr.model.eval()
    total = torch.zeros((), device=tr.rt.device)
    for i in range(1, cfg.training.eval_iters + 1):
        if verbose and i % cfg.logging.log_interval == 0:
            print_rank_0(f"Evaluating iter {i}/{cfg.training.eval_iters}")
        total += forward_backward(tr, data, cfg.data.num_micro_batches, forward_only=True)
        if count_valid_samples:
            tr.state.consumed_valid_samples += cfg.data.global_batch_size
    tr.model.train()
    if tr.rt.ps.dp_group is not None:
        with watching("validation loss all-reduce (data-parallel group)", tr.rt.ps.dp_group):
            dist.all_reduce(total, group=tr.rt.ps.dp_group)
            total = total.cpu()  # NCCL: the wait for the reduction is here
        total /= tr.rt.ps.dp_size
    return total.item() / max(cfg.training.eval_iters, 1)


def run_evaluation(tr: Trainer, data, prefix: str, test_set: bool = False,
                   write_tensorboard: bool = True, verbose: bool = False) -> None:
    """Evaluate and print Megatron's validation block. Its TensorBoard scalars are
    `lm loss validation` for the test set too (Megatron writes every evaluation there)."""
    with tr.progress.stage("evaluation"):
        loss = evaluate(tr, data, count_valid_samples=not test_set, verbose=verbose)
    block = format_validation_block(prefix, {"lm loss": loss})
    print_rank_last(block)
    if tr.tb is not None and write_tensorboard:
        tr.tb.log_validation(tr.state.iteration, tr.state.consumed_train_samples, {"lm loss": loss})


def final_evaluation(tr: Trainer, valid_data, test_data) -> None:
    """After the loop reached --train-iters (or with --skip-train, at the loaded
    iteration): the validation set, then the test set, each an --eval-iters draw.
    --skip-train writes no TensorBoard scalars. The label's draw is Megatron's: --eval-iters
    x --global-batch-size, the final size also where --rampup-batch-size evaluates at a
    smaller current one."""
    cfg = tr.config
    draw = cfg.training.eval_iters * (cfg.data.target_global_batch_size
                                      or cfg.data.global_batch_size)
    write = not cfg.training.skip_train
    for data, name in ((valid_data, "validation"), (test_data, "test")):
        if data is not None:
            run_evaluation(tr, data, f"iteration {tr.state.iteration} on {draw}-sample draw "
                                     f"from {name} set", test_set=name == "test",
                           write_tensorboard=write, verbose=True)


# --------------------------------------------------------------------------- the loop
def _should_exit(tr: Trainer, start_time: float) -> Optional[str]:
    """Megatron's exit line when an exit condition holds (the same on all ranks: one
    `max_over_ranks` over the control group per iteration decides the first two), else
    None. In Megatron's order: a signal received by any rank (--exit-signal-handler),
    --exit-duration-in-mins since `start_time` (the process start) on the longest-running
    rank, --exit-interval."""
    t = tr.config.training
    it = tr.state.iteration
    signal_code, minutes = _exit_checks(tr, start_time)
    if signal_code:
        return f"[exiting program after receiving {signal_name(signal_code)}.]"
    if t.exit_duration_in_mins and minutes > t.exit_duration_in_mins:
        # the longest-running rank decides, and the message gives its time
        return f"[exiting program after {minutes} minutes]"
    if t.exit_interval and it % t.exit_interval == 0:
        return f"[exiting program at iteration {it}]"
    return None


def _exit_checks(tr: Trainer, start_time: float) -> Tuple[float, float]:
    """(the largest signal number any rank received, 0 for none or without
    --exit-signal-handler; the longest time any rank has run, in minutes, 0 without
    --exit-duration-in-mins): one reduction over the control group when either flag is
    on, whose cost grows as log2 of the world size (megatron/agreed_exit.py)."""
    t = tr.config.training
    if tr.signals is None and not t.exit_duration_in_mins:
        return 0.0, 0.0
    local = [(tr.signals.received or 0) if tr.signals is not None else 0,
             (time.time() - start_time) / 60.0 if t.exit_duration_in_mins else 0.0]
    with watching("exit checks (signal, --exit-duration-in-mins)", tr.rt.control_group):
        signal_code, minutes = max_over_ranks(local, tr.rt.control_group)
    return signal_code, minutes


def _after_step(tr: Trainer, stats: IntervalStats, loss, ok: bool, grad_norm) -> bool:
    """Count the step; apply the NaN policy. Returns False when the step was rolled back."""
    cfg, st = tr.config, tr.state
    st.iteration += 1
    st.consumed_train_samples += cfg.data.global_batch_size
    if not torch.is_tensor(ok):  # a tensor (fp16 replay): counted at the log line
        st.skipped_iters += 0 if ok else 1
    policy = cfg.training.nan_loss_policy
    if policy != "stop" and not ok and not math.isfinite(to_float(loss)):
        st.nan_iters += 1
        msg = report_nan(tr, st.iteration, tr.last_local_loss)
        print_rank_0(f" > {msg}: optimizer step skipped (--nan-loss-policy {policy})")
        if policy == "rollback":
            batch = cfg.data.global_batch_size  # the NaN step's (the reload may change it)
            with stats.paused(tr.rt.device):  # the reload, like a save, is not training
                rollback(tr, st.iteration)
            stats.roll_back(tr.state.iteration, batch)
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
            check_pending_nan(tr, stats)
        log_interval(tr, stats)
    t = cfg.training
    if t.eval_interval and st.iteration % t.eval_interval == 0 and valid_data is not None:
        with stats.paused(tr.rt.device):
            run_evaluation(tr, valid_data, f"iteration {st.iteration}")
    ck = cfg.checkpoint
    if ck.save and ck.save_interval and st.iteration % ck.save_interval == 0:
        with stats.paused(tr.rt.device):
            _save(tr, stats)
        return True
    return False


def _save(tr: Trainer, stats: IntervalStats, timed: bool = True) -> None:
    """Save a checkpoint. `timed`: Megatron's level-0 `save-checkpoint` timer (barriers
    around it) and its timer block, as for the saves inside the loop."""
    if tr.config.training.nan_loss_policy == "stop":
        check_pending_nan(tr, stats)  # never checkpoint weights a NaN step produced
    with tr.progress.stage("saving"):
        if not timed:
            trainer_checkpoint.save_trainer_checkpoint(tr)
            return
        timers = step_log(tr).timers
        timers("save-checkpoint", 0).start(barrier=True)
        trainer_checkpoint.save_trainer_checkpoint(tr)
        timers("save-checkpoint").stop(barrier=True)
    timers.log(["save-checkpoint"])


def _close_interval(tr: Trainer, stats: IntervalStats) -> None:
    """The loop stops: NaN check (policy stop), then the pending records go to
    TensorBoard without an iteration line (Megatron prints one only every
    --log-interval iterations)."""
    if tr.config.training.nan_loss_policy == "stop":
        check_pending_nan(tr, stats)
    if stats.records:
        log_interval(tr, stats, print_line=False)


def _exit_program(tr: Trainer, stats: IntervalStats, reason: str, saved_at) -> None:
    """An exit condition holds on every rank: save (with --save, unless this iteration
    was just saved), finish an async save, and print Megatron's exit line."""
    cfg, st = tr.config, tr.state
    _close_interval(tr, stats)
    if cfg.checkpoint.save and saved_at != st.iteration:
        _save(tr, stats)
    elif not cfg.checkpoint.save and reason.startswith("[exiting program after receiving"):
        print_rank_0("WARNING: exiting without a checkpoint: --save is not set")
    trainer_checkpoint.wait_for_async_save(tr)
    if dist.is_initialized():
        with watching("barrier before the exit", tr.rt.control_group):
            dist.barrier(group=tr.rt.control_group)
    _datetime_line(reason)


def train(tr: Trainer, train_data, valid_data) -> Optional[str]:
    """The training loop, from the trainer's iteration to --train-iters. Returns None when
    it got there (`[after training is done]` printed, then a final checkpoint saved with
    --save, unless the run loaded that state from the same directory and trained
    nothing), or Megatron's exit line when an exit condition (--exit-signal-handler,
    --exit-duration-in-mins, --exit-interval) stopped it: the caller then ends the program
    without the final evaluation. An error or Ctrl-C still writes the last steps' points."""
    cfg, st = tr.config, tr.state
    tr.model.train()
    saved_at = None
    check_each_step = cfg.training.nan_loss_policy != "stop"
    tr.start_time, tr.start_iteration = time.time(), st.iteration
    tr.start_consumed = st.consumed_train_samples
    process_start = tr.process_start_time or tr.start_time
    profiler = StepProfiler.from_args(cfg.args, tr.rt.ps.rank, cfg.logging.tensorboard_dir)
    note = profiler.window_note(st.iteration + 1, cfg.training.train_iters)
    if note:
        print(note, flush=True)  # on the profiled ranks
    if trainer_checkpoint.nothing_to_train(tr):  # the loaded state is in --save already
        saved_at = st.iteration
    with points_kept_on_stop(tr) as stats:
        while st.iteration < cfg.training.train_iters:
            used_up = nan_policy.train_data_used_up(tr)  # after rollbacks: the set would run out
            if used_up:
                profiler.finish()
                _exit_program(tr, stats, f"[exiting program at iteration {st.iteration}: the "
                                         "train set is used up]", saved_at)
                raise exit_on_every_rank(used_up, tr.rt.control_group)
            trainer_checkpoint.report_async_failure(tr)  # the run goes on past that save
            profiler.before_step(st.iteration + 1)
            with profiler.step_range(st.iteration + 1):
                loss, ok, grad_norm, _ = train_step(tr, train_data, skip_nonfinite=check_each_step)
            profiler.after_step(st.iteration + 1)
            if not _after_step(tr, stats, loss, ok, grad_norm):  # rolled back
                if isinstance(valid_data, nan_policy.ValidationData):
                    valid_data.rewind(st.consumed_valid_samples)  # the checkpoint's
                continue
            if tr.memory_history is not None:
                tr.memory_history.after_iteration(st.iteration)
            if _periodic(tr, stats, valid_data):
                saved_at = st.iteration
            reason = _should_exit(tr, process_start)
            if reason:
                profiler.finish()
                _exit_program(tr, stats, reason, saved_at)
                return reason
    profiler.finish()
    _close_interval(tr, stats)
    step_graph.settle(tr)
    # before the final save, as in Megatron
    print_datetime("after training is done", tr.rt.control_group)
    if cfg.checkpoint.save and st.iteration > 0 and saved_at != st.iteration:
        _save(tr, stats, timed=False)
    trainer_checkpoint.wait_for_async_save(tr)
    return None


def _datetime_line(label: str) -> None:
    """Megatron's `<label> datetime: YYYY-MM-DD HH:MM:SS ` line."""
    print_rank_0(f"{label} datetime: {time.strftime('%Y-%m-%d %H:%M:%S')} ")


def print_datetime(event: str, group=None) -> None:
    """Megatron's `[<event>] datetime: ...` line on rank 0, once every rank has come here
    (Megatron's barrier): the lines other ranks printed before it (the last rank's final
    iteration line, the parameter counts) come before it in the job's output, not after.
    Collective over the world when distributed: `group` is the run's CPU control group
    (None: the default group)."""
    if dist.is_initialized():
        with watching(f"barrier before the [{event}] line", group):
            dist.barrier(group=group)
    _datetime_line(f"[{event}]")


def _build_data(tr: Trainer):
    """(train, valid, test) iterators; valid and test None without --eval-iters or data.
    The test set is read from its start, and so is the validation set with --skip-train
    (as in Megatron: every checkpoint evaluated alone is scored on the same samples,
    whatever its training consumed); a training run goes on from the checkpoint's
    consumed_valid_samples. SystemExit, before any loader starts, when the validation set
    cannot serve the evaluations left (a resume with other evaluation flags:
    `validation_shortfall`)."""
    config, rt = tr.config, tr.rt
    valid_start = 0 if config.training.skip_train else tr.state.consumed_valid_samples
    vocab = config.data.vocab_size or config.model.padded_vocab_size
    tokenizer = tr.tokenizer if tr.tokenizer is not None else build_tokenizer_for(config)
    tr.eod = eod_or_none(tokenizer)
    datasets = build_datasets(config, rt.ps.rank, vocab, rt.control_group,
                              None if tokenizer is None else tokenizer.vocab_size)
    eod_warning = missing_eod_warning(config, tr.eod) if rt.ps.rank == 0 else None
    if eod_warning:
        print_rank_0(eod_warning)
    if datasets["valid"] is None and config.training.eval_iters > 0 and rt.ps.rank == 0 and (
            config.training.eval_interval or config.training.skip_train):  # it opens the data
        print_rank_0(f"WARNING: {no_validation_reason(config, datasets['test'] is not None)}")
    if datasets["valid"] is not None:
        shortfall = validation_shortfall(config, tr.state.iteration, valid_start,
                                         len(datasets["valid"]))
        if shortfall:
            raise exit_on_every_rank(f"error: {shortfall}", rt.control_group)  # rank 0 prints
    if datasets["train"] is not None:
        shortfall = train_shortfall(config, tr.state.iteration, tr.state.consumed_train_samples,
                                    len(datasets["train"]))
        if shortfall:
            raise exit_on_every_rank(f"error: {shortfall}", rt.control_group)  # rank 0 prints
    asked = split_sample_counts(config)
    for order in (train_order_warning(tr.checkpoint_args, config.args, datasets["train"],
                                      asked[0], tr.state.consumed_train_samples),
                  valid_order_warning(tr.checkpoint_args, config.args, datasets["valid"],
                                      asked[1], valid_start)):
        if order:
            print_rank_0(order)
    if datasets["train"] is not None:
        tr.train_set_size = len(datasets["train"])
    train_data = data_iterator(config, rt, "train", tr.state.consumed_train_samples, datasets)
    valid_data = test_data = None
    if config.training.eval_iters > 0:
        valid_data = None if datasets["valid"] is None else nan_policy.ValidationData(
            lambda consumed: data_iterator(config, rt, "valid", consumed, datasets), valid_start)
        test_data = data_iterator(config, rt, "test", 0, datasets)
    return train_data, valid_data, test_data


def _setup(config: Config, rt: Runtime, process_start_time: Optional[float],
           progress: RunProgress, save_locked: bool = False,
           signals: Optional[SignalHandler] = None) -> Trainer:
    """Model, optimizer, scheduler, --load: Megatron's `model-and-optimizer-setup` timer
    (with `load-checkpoint` inside it, printed when it happens). The watchdog's reports
    say where `progress` is. `save_locked`: this process holds --save's lock, so the
    unfinished saves found there that nothing wrote to lately are no other run's, and
    are removed. `signals`: the caller's --exit-signal-handler handler (None: one is
    installed here). A stop here (a --load that does not fit) first tears down what was
    started: the signal handlers installed here, the TensorBoard writer, the watchdog."""
    log = StepLog(config, rt.device)
    log.timers("model-and-optimizer-setup", 0).start(barrier=True)
    tr = build_trainer(config, rt)
    tr.step_log, tr.process_start_time, tr.progress = log, process_start_time, progress
    tr.watchdog = build_watchdog(config.parallel.distributed_timeout_minutes * 60,
                                 announces=rt.speaks_for_node)
    tr.watchdog.describe = progress.where
    try:
        watch_param_sync(tr)
        if config.training.exit_signal_handler:
            tr.signals = signals if signals is not None else SignalHandler()
        _load_and_check_save_dir(tr, save_locked)
    except BaseException:
        _teardown(tr, (), restore_signals=signals is None)
        raise
    log.timers("model-and-optimizer-setup").stop()
    print_datetime("after model, optimizer, and learning rate scheduler are built",
                   rt.control_group)
    return tr


def _load_and_check_save_dir(tr: Trainer, save_locked: bool) -> None:
    """--load (timed), the micro-batch count of the consumed samples, then rank 0's
    warnings about --save (later checkpoints there, unfinished saves)."""
    config, rt, log = tr.config, tr.rt, tr.step_log
    if config.checkpoint.load:
        with tr.progress.stage("loading"):
            log.timers("load-checkpoint", 0).start(barrier=True)
            trainer_checkpoint.load_trainer_checkpoint(tr)
            log.timers("load-checkpoint").stop(barrier=True)
        log.timers.log(["load-checkpoint"])
    # Under --rampup-batch-size the batch of the consumed samples (the ramp's START without
    # a checkpoint), as Megatron's calculator starts: what --skip-train evaluates with.
    update_micro_batches(config.data, tr.state.consumed_train_samples, rt.ps.dp_size)
    if config.checkpoint.save and rt.ps.rank == 0 and not config.training.skip_train:
        save = config.checkpoint.save
        for warning in (checkpointing.later_checkpoints_warning(save, tr.state.iteration,
                                                                config.checkpoint.finetune),
                        unfinished_saves_report(save, save_locked, max(
                            UNFINISHED_IDLE_S,
                            60 * config.parallel.distributed_timeout_minutes))):
            if warning:
                print(warning, flush=True)


def _train_and_evaluate(tr: Trainer, train_data, valid_data, test_data) -> None:
    """The loop (unless --skip-train), then the final evaluation unless an exit condition
    ended the loop."""
    config = tr.config
    if not config.training.skip_train:
        print_rank_0("training ...")
        print_datetime("before the start of training step", tr.rt.control_group)
        tr.exit_reason = train(tr, train_data, valid_data)
    else:
        print_rank_0("skipping training (--skip-train is on) ...")
        if config.training.data_parallel_random_init:
            sync_replicas(tr)  # no step took DP rank 0's weights: evaluate one model
        if config.training.eval_iters <= 0:
            print_rank_0("WARNING: --skip-train with --eval-iters 0: nothing is evaluated "
                         "either, the run ends here; pass --eval-iters N to score N global "
                         "batches of the validation and test sets")
    if tr.exit_reason is None and (config.training.skip_train or config.training.eval_interval):
        final_evaluation(tr, valid_data, test_data)


@refuse_megatron_call
def pretrain(config: Config, rt: Runtime, process_start_time: Optional[float] = None,
             progress: Optional[RunProgress] = None, tokenizer=None,
             signals: Optional[SignalHandler] = None) -> Trainer:
    """Build model, optimizer and data; load; train; evaluate at the end (validation,
    then test). An exit condition ends it after the loop's checkpoint, without the final
    evaluation (`tr.exit_reason` says which). `process_start_time`: what
    --exit-duration-in-mins counts from (default: the start of the loop). An
    out-of-memory error on this rank prints what to do and raises `OutOfMemoryExit`
    (status 1; megatron/oom_report.py). `progress` follows the run's phase and trainer
    (for the Ctrl-C line of pretrain_gpt.py). `tokenizer`: the run's, when the caller has
    built it already (its files are read once per rank); None: built from `config.data`."""
    history = MemoryHistory.from_config(config, rt.ps.rank, rt.ps.world_size)
    try:  # (stopped after the report: an out-of-memory error writes the history first)
        with OomReport(config, rt, memory_history=history) as oom:
            history.start()  # before the model is built: its allocations are in it
            return _pretrain(config, rt, process_start_time, oom, progress or RunProgress(),
                             tokenizer, signals)
    finally:
        history.stop()


def _pretrain(config: Config, rt: Runtime, process_start_time: Optional[float],
              oom: OomReport, progress: RunProgress, tokenizer=None,
              signals: Optional[SignalHandler] = None) -> Trainer:
    # --skip-train saves nothing: its --save is neither created nor probed nor locked, so it
    # evaluates a --save that a training run is writing now (the same command line)
    saves = None if config.training.skip_train else config.checkpoint.save
    if saves:
        checkpointing.check_save_dir(saves, rt.ps, rt.control_group)  # not after training
    if config.logging.tensorboard_dir:  # the last rank writes it: a message, not a traceback
        checkpointing.check_output_dir(config.logging.tensorboard_dir, "--tensorboard-dir",
                                       rt.ps, rt.control_group, rt.ps.world_size - 1)
    # one run per --save: the lock is held by global rank 0
    with lock_save_dir(saves, rt.ps, rt.control_group) as save_lock:
        tr = _setup(config, rt, process_start_time, progress, save_lock.held, signals)
        oom.trainer = progress.trainer = tr  # the reports name the iteration from here on
        tr.tokenizer = tokenizer
        tr.memory_history = oom.memory_history
        loaders = ()
        try:
            loaders = _start(tr)
            progress.phase = "training"
            _train_finishing_save(tr, loaders)
        except RuntimeError as e:  # a loader worker that died: one line, not a traceback
            stop = loader_worker_exit(e, config.data.num_workers, tr.state.iteration,
                                      last_checkpoint_text(config.checkpoint.save))
            if stop is None:
                raise
            raise stop from None
        finally:  # also on an error or a stop (SystemExit): nothing outlives this call
            _teardown(tr, loaders, restore_signals=signals is None)
    sys.stdout.flush()
    return tr


def _train_finishing_save(tr: Trainer, loaders) -> None:
    """`_train_and_evaluate`; an error leaving it first lets the background save in
    flight (--async-save) finish, as a synchronous save would have kept that checkpoint
    (`AsyncSaver.finish`, bounded) -- not Ctrl-C, which abandons it (pretrain_gpt.py)."""
    try:
        _train_and_evaluate(tr, *loaders)
    except BaseException as exc:
        if tr.async_saver is not None and not isinstance(exc, KeyboardInterrupt):
            tr.async_saver.finish()
        raise


def _start(tr: Trainer) -> tuple:
    """TensorBoard's argument and layout texts, then the data iterators."""
    config, rt, timers = tr.config, tr.rt, tr.step_log.timers
    if tr.tb is not None:
        tr.tb.log_args(config.args, tr.state.iteration, tr.state.state_dict())
        ps = rt.ps
        tr.tb.log_text("parallel layout", f"world {ps.world_size} = tensor {ps.tp_size} x "
                       f"pipeline {ps.pp_size} x data {ps.dp_size}; sequence parallel "
                       f"{config.model.sequence_parallel}; backend {rt.backend}", tr.state.iteration)
    timers("train/valid/test-data-iterators-setup", 0).start(barrier=True)
    loaders = _build_data(tr)
    timers("train/valid/test-data-iterators-setup").stop()
    print_datetime("after dataloaders are built", rt.control_group)
    print_rank_0("done with setup ...")
    timers.log(["model-and-optimizer-setup", "train/valid/test-data-iterators-setup"])
    return loaders


def _teardown(tr: Trainer, loaders, restore_signals: bool = True) -> None:
    """Stop what the run started: the loaders' threads / worker processes (they would
    outlive this call, and the next one's), the signal handlers (unless the caller
    installed them: `restore_signals` False), the TensorBoard writer (its last events
    reach the file even when the run stopped on an error) and the watchdog."""
    close_iterators(loaders)
    if tr.signals is not None and restore_signals:
        tr.signals.restore()
    if tr.tb is not None:
        tr.tb.close()
    tr.watchdog.close()
