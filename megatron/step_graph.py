"""Whole-step CUDA graphs (`--cuda-graph-step auto|on|off`).

A training step issues a few thousand kernels; on a small model the host needs nearly as
long to launch them as the GPU needs to run them, and the GPU idles in between. Here the
whole step -- zeroing the grad buffer, forward and backward over every micro-batch,
gradient clipping and the AdamW kernel -- is recorded once as a CUDA graph and then
replayed each step with one launch.

Per step the host still: reads the micro-batches from the data iterator and copies them
(asynchronously, from pinned memory) into the graph's static input buffers; writes the
step's learning rate, weight decay and bias corrections into the device tensor the AdamW
kernel reads (`optimizer.prepare_replay()`); steps the lr scheduler; returns copies of the
graph's loss and grad norm, so a caller may keep them past the next replay.

fp16 without a host sync. Whether an fp16 step updated (no overflow) is decided on the
device: the captured AdamW kernel masks itself off and the loss scaler updates its
tensors in the graph. The host learns the outcome one step late, so it never waits for
the GPU: the step returns its update flag as a 0-dim device tensor, and the host counts
the step as if it updated (Adam's step count, the lr scheduler). Before the next replay
it uploads two sets of values -- for "the previous step updated" and for "it skipped" --
and the device picks by the previous flag; after launching that replay the host reads
the previous flag (copied to pinned memory; by then the GPU is busy with the new step)
and takes the count back if the step skipped. `settle(tr)` reads the last flag at once:
before a checkpoint, at a log line, at the end of training.

The first steps run eagerly (the compiled graphs are built, cuBLAS/cuDNN plans chosen,
optimizer state allocated); the second one on the stream the capture will use. The third
step is captured, then replayed. `auto` (the default) uses the graph when nothing in the
step needs the host to decide something mid-step (see `graph_capture_reason`); a capture
that fails then falls back to eager steps with a warning. `on` insists (and fails loudly);
`off` never captures.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional

import torch

from megatron.core.graph_capture import simulated_capture
from megatron.core.models.gpt.grouped_experts import experts_sync_free
from megatron.logging_utils import print_rank_0

WARMUP_STEPS = 2  # eager steps before the capture


def settings_reason(*, device_type: str, world_size: int, hidden_dropout: float,
                    attention_dropout: float, nan_loss_policy: str, timing_log_level: int,
                    rampup_batch_size, empty_unused_memory_level: int, compile_mode: str,
                    adam_kernel: str, optimizer: str, num_experts: Optional[int] = None,
                    experts_sync_free: bool = False) -> Optional[str]:
    """Why these settings rule out a captured step (None: they don't). Checked from the
    flags when `--cuda-graph-step on` is given, and again at the first step.

    `experts_sync_free`: the switch MLPs (`--num-experts`) use the grouped dispatch with a
    grouped GEMM that needs nothing from the host (`SwitchMLP.sync_free`); the loop
    dispatch counts each expert's tokens on the host in every layer."""
    checks = (
        (device_type != "cuda", "it needs CUDA"),
        (world_size > 1, f"the run has {world_size} ranks (one-GPU runs only, so far)"),
        (hidden_dropout > 0 or attention_dropout > 0,
         f"dropout is on (--hidden-dropout {hidden_dropout}, --attention-dropout "
         f"{attention_dropout}); its RNG-state forks cannot be captured"),
        (nan_loss_policy != "stop", f"--nan-loss-policy {nan_loss_policy} checks each step's "
                                    "loss on the host"),
        (timing_log_level > 0, f"--timing-log-level {timing_log_level} times pieces of the "
                               "step on the host"),
        (rampup_batch_size is not None, "--rampup-batch-size changes the number of "
                                        "micro-batches per step"),
        (empty_unused_memory_level > 0, "--empty-unused-memory-level frees memory mid-step"),
        (compile_mode == "reduce-overhead", "--compile-mode reduce-overhead graphs the layers "
                                            "already"),
        (adam_kernel == "torch", "--adam-kernel torch reads the learning rate on the host"),
        (optimizer != "adam", f"--optimizer {optimizer}: only the Triton AdamW step reads its "
                              "learning rate from the device"),
        (num_experts is not None and not experts_sync_free,
         f"--num-experts {num_experts}: the switch MLP's tokens per expert are counted on "
         "the host every layer (its grouped dispatch, which needs no host, runs only in "
         "bf16 on compute capability 9.x/10.x GPUs, with widths of multiples of 8)"),
    )
    return next((reason for failed, reason in checks if failed), None)


def graph_capture_reason(tr) -> Optional[str]:
    """None when the step can be captured as one CUDA graph, else why not (a phrase that
    completes 'the whole-step CUDA graph is off: ...')."""
    cfg = tr.config
    m, o = cfg.model, cfg.optimizer
    reason = settings_reason(
        device_type=tr.rt.device.type,
        world_size=tr.rt.ps.world_size, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, nan_loss_policy=cfg.training.nan_loss_policy,
        timing_log_level=cfg.logging.timing_log_level,
        rampup_batch_size=cfg.data.rampup_batch_size,
        empty_unused_memory_level=cfg.training.empty_unused_memory_level,
        compile_mode=m.compile_mode, adam_kernel=o.adam_kernel, optimizer=o.optimizer,
        num_experts=m.num_experts, experts_sync_free=experts_sync_free(tr.model))
    return reason or tr.optimizer.graph_capture_reason()


def runner_for(tr) -> Optional["StepGraph"]:
    """The trainer's StepGraph (built on the first step), or None when graphs are off."""
    runner = tr.step_graph
    if runner is None:
        mode = tr.config.training.cuda_graph_step
        reason = "--cuda-graph-step off" if mode == "off" else graph_capture_reason(tr)
        if mode == "on" and reason is not None:
            raise SystemExit(f"error: --cuda-graph-step on, but {reason}; use "
                             "--cuda-graph-step auto (captures when it can) or off")
        runner = tr.step_graph = StepGraph(strict=mode == "on") if reason is None else False
        state = (f"on (steps from {WARMUP_STEPS + 1} replay one graph)" if runner
                 else f"off ({reason})")
        if tr.rt.device.type == "cuda":  # CPU runs never capture: no line for them
            print_rank_0(f" > whole-step CUDA graph: {state}")
    return runner or None


def settle(tr) -> None:
    """Make the host's counts exact now (a checkpoint, a log line, the end of training):
    read the last replay's overflow flag, if it is still unread (a wait for the GPU)."""
    runner = getattr(tr, "step_graph", None)
    if runner:
        runner.settle(tr)


class _Unread:
    """A replay's overflow flag that the host has not read: copied to pinned host memory
    after the replay, with an event to wait for (CPU tests: a copy, read at once)."""

    def __init__(self, flag: torch.Tensor, increment: int) -> None:
        self.increment = increment  # the scheduler's advance that the step was counted with
        self.event = None
        if flag.is_cuda:
            self.host = torch.empty((), dtype=flag.dtype, pin_memory=True)
            self.host.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = flag.detach().clone()

    def skipped(self) -> bool:
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host != 0)


def _copy_into(static: List[dict], micros: List[dict]) -> None:
    """This step's micro-batches into the graph's input buffers (same shapes each step)."""
    for buffers, micro in zip(static, micros):
        if buffers.keys() != micro.keys():
            raise RuntimeError(f"micro-batch keys changed: {sorted(micro)} vs {sorted(buffers)}")
        for key, value in micro.items():
            dst = buffers[key]
            if value.shape != dst.shape or value.dtype != dst.dtype:
                raise RuntimeError(f"micro-batch '{key}' is {tuple(value.shape)} {value.dtype}, "
                                   f"the captured step reads {tuple(dst.shape)} {dst.dtype}; "
                                   "use --cuda-graph-step off for varying batch shapes")
            dst.copy_(value, non_blocking=True)


class StepGraph:
    """Runs training steps as replays of one captured step. `simulated=True` (CPU tests)
    records the step function instead of a CUDA graph and re-runs it at each replay under
    `simulated_capture()`, so the host-side bookkeeping is exercised without CUDA."""

    def __init__(self, strict: bool = False, simulated: bool = False) -> None:
        self.strict, self.simulated = strict, simulated
        self.steps = 0
        self.failed: Optional[str] = None
        self.graph = None
        self.static: Optional[List[dict]] = None
        self.outputs = None
        self.body: Optional[Callable] = None
        self.stream = None
        self.unread: Optional[_Unread] = None  # fp16: the last replay's flag, not yet read

    def step(self, tr, data: Iterator[dict], body: Callable):
        """One training step: `body(tr, micro_batch_iterator)` eagerly while warming up
        (or after a failed capture), else a replay. Returns body's (loss, ok, grad_norm,
        num_zeros); for an fp16 replay `ok` is a 0-dim bool tensor on the device (read
        it at a log line) and the grad norm is returned even when the step skipped (then
        it is not finite)."""
        micros = [next(data) for _ in range(tr.config.data.num_micro_batches)]
        self.steps += 1
        if self.failed is not None or self.steps <= WARMUP_STEPS:
            with self._warmup_stream(self.steps == WARMUP_STEPS and self.failed is None):
                return body(tr, iter(micros))
        if self.body is None:
            self.static = [{k: torch.empty_like(v, device=tr.rt.device) for k, v in m.items()}
                           for m in micros]
            _copy_into(self.static, micros)
            try:
                self._capture(tr, body)
            except Exception as exc:  # noqa: BLE001 - auto mode falls back to eager steps
                if self.strict:
                    raise
                self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                print_rank_0(f"WARNING: whole-step CUDA graph capture failed ({self.failed}); "
                             "continuing with eager steps (--cuda-graph-step off hides this)")
                return body(tr, iter(self.static))
        else:
            _copy_into(self.static, micros)
        previous, self.unread = self.unread, None
        if previous is None:
            tr.optimizer.prepare_replay()
        else:  # the previous replay counted as updated; its values if it skipped:
            back = tr.scheduler.num_steps - previous.increment
            tr.optimizer.prepare_replay(if_skipped=tr.scheduler.group_values(back))
        loss, ok, grad_norm, num_zeros, last_local = self._replay(tr)
        tr.last_local_loss = last_local.clone()
        flag = tr.optimizer.replay_flag()
        if flag is not None:  # fp16: decided on the device, read on the host next step
            self.unread = _Unread(flag, tr.config.data.global_batch_size)
            ok = flag == 0
        if previous is not None:
            self._take_back_if_skipped(tr, previous)
        copy = (lambda t: None if t is None else t.clone())
        return loss.clone(), ok, copy(grad_norm), copy(num_zeros)

    def settle(self, tr) -> None:
        """Read the last replay's flag now (see `settle(tr)`)."""
        previous, self.unread = self.unread, None
        if previous is not None:
            self._take_back_if_skipped(tr, previous)

    @staticmethod
    def _take_back_if_skipped(tr, unread: _Unread) -> None:
        if unread.skipped():
            tr.optimizer.take_back_step()
            tr.scheduler.step(-unread.increment)

    @contextlib.contextmanager
    def _warmup_stream(self, side: bool):
        """Run the last warm-up step on the capture stream (lazily created handles and
        workspaces then exist for it before the capture)."""
        if self.simulated or not side:
            yield
            return
        self.stream = torch.cuda.Stream()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def _run_body(self, tr, body):
        loss, ok, grad_norm, num_zeros = body(tr, iter(self.static))
        if ok is not True:
            raise RuntimeError("the captured step did not run the optimizer")
        return loss, ok, grad_norm, num_zeros, tr.last_local_loss

    def _capture(self, tr, body) -> None:
        self.body = body
        if self.simulated:
            return
        self.graph = torch.cuda.CUDAGraph()
        stream = self.stream or torch.cuda.Stream()
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.outputs = self._run_body(tr, body)

    def _replay(self, tr):
        if self.simulated:
            with simulated_capture():
                return self._run_body(tr, self.body)
        self.graph.replay()
        return self.outputs
