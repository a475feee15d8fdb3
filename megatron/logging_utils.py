"""Driver-side logging: rank-aware printing, timers, the iteration line, TensorBoard, MFU.

Everything written here keeps Megatron-LM 23.05's output shapes so that existing log
parsers and dashboards keep working:

* `format_iteration_line` -- the per-iteration stdout line (same fields, order and
  number formats), plus two optional fields of ours at the end (tokens/s/GPU, TFLOP/s/GPU).
* `format_validation_block` -- the dashed validation block with perplexities.
* `Timers.log_string` -- the "(min, max) time across ranks (ms):" block.
* `TensorboardLogger` -- the same scalar names, each with its "<name> vs samples" twin.
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.config import LoggingConfig

PEAK_FLOPS_H100_BF16 = 989e12
TIMER_LOG_OPTIONS = ("max", "minmax", "all")


# ---------------------------------------------------------------------------------------
# Rank-aware printing
def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def print_line(msg: str) -> None:
    """`msg` and its newline in ONE write, flushed: ranks sharing a terminal or log (torchrun
    merges their output) then cannot split each other's lines, as print's separate writes
    of the text and the newline let them (unbuffered output, PYTHONUNBUFFERED=1)."""
    sys.stdout.write(f"{msg}\n")
    sys.stdout.flush()


def print_rank_0(msg: str) -> None:
    """Print on global rank 0 only (every process prints when not distributed)."""
    if not _dist_ready() or dist.get_rank() == 0:
        print_line(msg)


def print_rank_last(msg: str) -> None:
    """Print on the last global rank only (every process prints when not distributed)."""
    if not _dist_ready() or dist.get_rank() == dist.get_world_size() - 1:
        print_line(msg)


def _collective_device(group=None) -> torch.device:
    """CPU for gloo, the current CUDA device for NCCL (which only moves CUDA tensors)."""
    if _dist_ready() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------
# Timers
class _NullTimer:
    """Stand-in for a timer above the configured level: every call does nothing."""

    def start(self, barrier: bool = False) -> None:
        pass

    def stop(self, barrier: bool = False) -> None:
        pass

    def reset(self) -> None:
        pass

    def elapsed(self, reset: bool = True) -> float:
        return 0.0


class Timer:
    """One named wall-clock timer (seconds), accumulated over start/stop pairs."""

    def __init__(self, name: str, sync_cuda: bool = False) -> None:
        self.name = name
        self._sync_cuda = sync_cuda
        self._elapsed = 0.0
        self._started = False
        self._start_time = 0.0

    def _now(self, barrier: bool) -> float:
        if barrier and _dist_ready():
            from megatron.watchdog import watching

            with watching(f"barrier of timer {self.name}"):
                dist.barrier()  # collective over the world: every rank must start/stop it
        if self._sync_cuda:
            torch.cuda.synchronize()  # queued kernels belong to the timed region
        return time.perf_counter()

    def start(self, barrier: bool = False) -> None:
        """Start timing; with `barrier` all ranks first wait for each other."""
        assert not self._started, f"timer {self.name!r} has already been started"
        self._start_time = self._now(barrier)
        self._started = True

    def stop(self, barrier: bool = False) -> None:
        """Stop timing and add the interval to the accumulated time."""
        assert self._started, f"timer {self.name!r} is not started"
        self._elapsed += self._now(barrier) - self._start_time
        self._started = False

    def reset(self) -> None:
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated seconds (a running timer is read without being disturbed)."""
        running = self._started
        if running:
            self.stop()
        total = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start()
        return total


class Timers:
    """Named timers with levels, Megatron style: `timers("forward-backward", 1).start()`.

    A timer whose level is above `log_level` is a no-op. When `device` is a CUDA device
    (and CUDA is available) timers synchronise CUDA before reading the clock.
    """

    def __init__(self, log_level: int = 0, log_option: str = "minmax", device=None) -> None:
        if log_level not in (0, 1, 2):
            raise ValueError(f"timing log level must be 0, 1 or 2, got {log_level}")
        if log_option not in TIMER_LOG_OPTIONS:
            raise ValueError(
                f"timing log option must be one of {TIMER_LOG_OPTIONS}, got {log_option!r}"
            )
        self.log_level = log_level
        self.log_option = log_option
        dev = torch.device(device) if device is not None else torch.device("cpu")
        self._sync_cuda = dev.type == "cuda" and torch.cuda.is_available()
        self._timers: Dict[str, Timer] = {}
        self._levels: Dict[str, int] = {}
        self._null = _NullTimer()

    def __call__(self, name: str, log_level: Optional[int] = None):
        """The timer `name` (created on first use); a no-op timer above the log level."""
        if name in self._timers:
            return self._timers[name]
        level = 2 if log_level is None else log_level
        if level > self.log_level:
            return self._null
        self._timers[name] = Timer(name, self._sync_cuda)
        self._levels[name] = level
        return self._timers[name]

    def names(self) -> List[str]:
        return list(self._timers)

    def _gather_ms(self, names: Sequence[str], reset: bool, group) -> torch.Tensor:
        """[ranks, names] elapsed milliseconds; 0 for timers this rank does not have.

        Collective: all-gather over `group` (the world when None) when distributed.
        """
        local = [self._timers[n].elapsed(reset) * 1000.0 if n in self._timers else 0.0
                 for n in names]
        if not _dist_ready():
            return torch.tensor([local], dtype=torch.float64)
        from megatron.watchdog import watching

        device = _collective_device(group)
        mine = torch.tensor(local, dtype=torch.float64, device=device)
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        with watching("all-gather of the timers' readings (all ranks)", group):
            dist.all_gather(parts, mine, group=group)
            return torch.stack(parts).cpu()  # NCCL: the wait for the gather is here

    def max_times(self, names: Sequence[str], normalizer: float = 1.0, reset: bool = False,
                  group=None) -> Dict[str, float]:
        """Max over ranks of each timer, in seconds / normalizer (for TensorBoard).

        Collective (all-gather) when distributed: every rank must call it with the same names.
        """
        ms = self._gather_ms(list(names), reset, group)
        out = {}
        for i, name in enumerate(names):
            col = ms[:, i]
            if (col > 0).any():
                out[name] = col.max().item() / 1000.0 / normalizer
        return out

    def log_string(self, names: Optional[Sequence[str]] = None, normalizer: float = 1.0,
                   group=None, reset: bool = True) -> Optional[str]:
        """Megatron's timer block in ms / normalizer; None when no timer has a reading.

        Collective (all-gather over `group`, the world when None) when distributed: every
        rank must call it with the same names. Ranks without a timer report 0 and are left
        out of the min.
        """
        assert normalizer > 0.0
        names = list(self._timers) if names is None else list(names)
        ms = self._gather_ms(names, reset, group) / normalizer
        lines = []
        for i, name in enumerate(names):
            col = ms[:, i]
            if not (col > 0).any():
                continue
            padded = (name + " ").ljust(48, ".")
            if self.log_option == "minmax":
                lo, hi = col[col > 0].min().item(), col.max().item()
                lines.append(f"    {padded}: ({lo:.2f}, {hi:.2f})")
            elif self.log_option == "max":
                lines.append(f"    {padded}: {col.max().item():.2f}")
            else:
                lines.append(f"  {name}:")
                lines += [f"     rank {r:2d}: {t:.2f}" for r, t in enumerate(col.tolist()) if t > 0]
        if not lines:
            return None
        # Megatron heads the `max` block with the min/max header too: parsers key on it.
        header = ("times across ranks (ms):" if self.log_option == "all"
                  else "(min, max) time across ranks (ms):")
        return "\n".join([header] + lines)

    def log(self, names: Optional[Sequence[str]] = None, normalizer: float = 1.0,
            group=None, reset: bool = True) -> None:
        """`log_string` printed on the last rank (collective, see `log_string`)."""
        text = self.log_string(names, normalizer, group, reset)
        if text is not None:
            print_rank_last(text)


# ---------------------------------------------------------------------------------------
# Throughput
def flops_per_token(num_layers: int, hidden_size: int, seq_length: int, vocab_size: int,
                    num_experts: Optional[int] = None) -> float:
    """Training FLOPs per token (forward + backward, no activation recompute).

    72 * l * h^2 * (1 + s / (6h) + V / (12 l h)): the transformer matmuls and attention
    scores (24 l h^2 (1 + s/6h) per token forward, x3 with backward) plus the logits layer.
    With --num-experts E a token passes one expert (the same MLP FLOPs) plus the router:
    + 6 * l * h * E.
    """
    l, h, s, v = num_layers, hidden_size, seq_length, vocab_size
    router = 6.0 * l * h * num_experts if num_experts else 0.0
    return 72.0 * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h)) + router


def layer_forward_flops(model, seq_length: int) -> float:
    """Forward FLOPs per token of one transformer layer of `model` (a ModelConfig): the
    q/k/v projection at its query-group width, the attention scores and values over the
    whole sequence (as the formula of `flops_per_token` counts them), the output
    projection, the MLP's two matrices (three with SwiGLU) at --ffn-hidden-size and a
    --num-experts router."""
    h, d, n = model.hidden_size, model.kv_channels, model.num_attention_heads
    g = model.num_query_groups or n
    mlp_mats = 3 if model.activation == "swiglu" else 2
    return float(2 * h * (n + 2 * g) * d + 4 * seq_length * n * d + 2 * n * d * h
                 + 2 * h * model.ffn_hidden_size * mlp_mats + 2 * h * (model.num_experts or 0))


def model_flops_per_token(model, seq_length: int) -> float:
    """Training FLOPs per token of `model` counted product by product (forward + backward
    = 3 x forward, no activation recompute): its layers (`layer_forward_flops`) and the
    logits layer. For a GPT with a 4h MLP, one query group per head and h = heads x
    kv_channels it equals `flops_per_token`; for a Llama shape it is what the run does
    (the plain formula misses the SwiGLU and query-group widths)."""
    return 3.0 * (model.num_layers * layer_forward_flops(model, seq_length)
                  + 2.0 * model.hidden_size * model.padded_vocab_size)


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float,
        peak_flops: float = PEAK_FLOPS_H100_BF16) -> float:
    """Model FLOPs utilisation: achieved FLOP/s per GPU over the peak (default H100 bf16 dense)."""
    return tokens_per_s_per_gpu * flops_per_token / peak_flops


# ---------------------------------------------------------------------------------------
# Console lines
def format_iteration_line(
    iteration: int, train_iters: int, consumed_samples: int, elapsed_ms_per_iter: float,
    learning_rate: float, global_batch_size: int, losses: Dict[str, float], loss_scale: float,
    grad_norm: Optional[float] = None, num_zeros: Optional[float] = None,
    params_norm: Optional[float] = None, skipped_iters: int = 0, nan_iters: int = 0,
    tokens_per_s_per_gpu: Optional[float] = None, tflops_per_gpu: Optional[float] = None,
) -> str:
    """Megatron's per-iteration line; our throughput fields (when given) come last.

    Losses whose value is <= 0 are omitted, as Megatron does.
    """
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d} |",
        f" consumed samples: {consumed_samples:12d} |",
        f" elapsed time per iteration (ms): {elapsed_ms_per_iter:.1f} |",
        f" learning rate: {learning_rate:.3E} |",
        f" global batch size: {global_batch_size:5d} |",
    ]
    parts += [f" {key}: {value:.6E} |" for key, value in losses.items() if value > 0.0]
    parts.append(f" loss scale: {loss_scale:.1f} |")
    if grad_norm is not None:
        parts.append(f" grad norm: {grad_norm:.3f} |")
    if num_zeros is not None:
        parts.append(f" num zeros: {num_zeros:.1f} |")
    if params_norm is not None:
        parts.append(f" params norm: {params_norm:.3f} |")
    parts.append(f" number of skipped iterations: {skipped_iters:3d} |")
    parts.append(f" number of nan iterations: {nan_iters:3d} |")
    if tokens_per_s_per_gpu is not None:
        parts.append(f" tokens/s/GPU: {tokens_per_s_per_gpu:.0f} |")
    if tflops_per_gpu is not None:
        parts.append(f" TFLOP/s/GPU: {tflops_per_gpu:.1f} |")
    return "".join(parts)


def format_validation_block(prefix: str, losses: Dict[str, float]) -> str:
    """Megatron's validation block: dashed line, the loss/PPL line, dashed line.

    PPL = exp(min(20, loss)); the dashed lines are one character longer than the text.
    """
    text = f" validation loss at {prefix} | "
    for key, value in losses.items():
        text += f"{key} value: {value:.6E} | "
        text += f"{key} PPL: {math.exp(min(20.0, value)):.6E} | "
    dashes = "-" * (len(text) + 1)
    return "\n".join([dashes, text, dashes])


def format_memory_line(rank: int, iteration: int, device=None) -> str:
    """Megatron's one-off `[Rank r] (after N iterations) memory (MB) | ...` report."""
    mb = 1024.0 * 1024.0
    if torch.cuda.is_available():
        stats = [torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device),
                 torch.cuda.memory_reserved(device), torch.cuda.max_memory_reserved(device)]
    else:
        stats = [0, 0, 0, 0]
    a, ma, r, mr = (s / mb for s in stats)
    return (f"[Rank {rank}] (after {iteration} iterations) memory (MB) | allocated: {a} | "
            f"max allocated: {ma} | reserved: {r} | max reserved: {mr}")


# ---------------------------------------------------------------------------------------
# TensorBoard
_MEMORY_SCALARS = (
    ("mem-reserved-bytes", "reserved_bytes.all.current"),
    ("mem-allocated-bytes", "allocated_bytes.all.current"),
    ("mem-allocated-count", "allocation.all.current"),
)


def _make_summary_writer(config: LoggingConfig):
    """A SummaryWriter, or None (with one warning) when tensorboard is not importable."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        print(f"WARNING: TensorBoard writing requested with --tensorboard-dir "
              f"{config.tensorboard_dir} but tensorboard is not available ({exc}); "
              f"install it with `pip install tensorboard`. No TensorBoard logs will be written.",
              flush=True)
        return None
    return SummaryWriter(log_dir=config.tensorboard_dir, max_queue=config.tensorboard_queue_size)


def _quiet_writer_thread_errors() -> None:
    """tensorboard's writer thread re-raises a failed write (a full disk) into
    threading.excepthook, a traceback on stderr, and again into the next call of the
    main thread, which `TensorboardLogger` reports in one line: the first is not printed.
    Installed once; any other thread's error goes to the hook that was there."""
    previous = threading.excepthook
    if getattr(previous, "tensorboard_quiet", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread"
                and isinstance(args.exc_value, OSError)):
            previous(args)

    hook.tensorboard_quiet = True
    threading.excepthook = hook


class TensorboardLogger:
    """Megatron's TensorBoard scalars, written only by the writer rank (the last rank).

    On other ranks, without `tensorboard_dir`, or without the tensorboard package every
    method is a no-op, so callers never need to check. A write that fails during the run
    (a full disk or quota) is reported in one line and TensorBoard logging stops there;
    training goes on (`_writing`).
    """

    def __init__(self, config: LoggingConfig, is_writer_rank: bool) -> None:
        self.config = config
        self.writer = None
        if is_writer_rank and config.tensorboard_dir is not None:
            self.writer = _make_summary_writer(config)
            _quiet_writer_thread_errors()

    @property
    def enabled(self) -> bool:
        return self.writer is not None

    @contextlib.contextmanager
    def _writing(self):
        """Around every use of the writer: an OSError (no space, quota, file-size limit,
        a vanished directory) warns once, naming the directory, and drops the writer."""
        try:
            yield
        except OSError as exc:
            writer, self.writer = self.writer, None
            with contextlib.suppress(Exception):  # it raises the same error again
                writer.close()
            print(f"warning: cannot write TensorBoard events to --tensorboard-dir "
                  f"{self.config.tensorboard_dir} ({exc.strerror or exc}): TensorBoard "
                  "logging stopped here, training continues; free space there (or raise "
                  "your quota), or pass another --tensorboard-dir", flush=True)

    def _both(self, name: str, value: float, iteration: int, consumed_samples: int) -> None:
        self.writer.add_scalar(name, value, iteration)
        self.writer.add_scalar(f"{name} vs samples", value, consumed_samples)

    def log_scalars(self, iteration: int, consumed_samples: int, values: Dict[str, float]) -> None:
        """Extra scalars (throughput, MFU, memory), each with its "vs samples" twin."""
        if self.writer is None:
            return
        with self._writing():
            for name, value in values.items():
                self._both(name, value, iteration, consumed_samples)

    def log_text(self, tag: str, text: str, iteration: int = 0) -> None:
        if self.writer is not None:
            with self._writing():
                self.writer.add_text(tag, text, global_step=iteration)

    def log_args(self, args_dict: Dict[str, object], iteration: int,
                 live: Optional[Dict[str, object]] = None) -> None:
        """One text entry per argument: tag = argument name, text = str(value). `live`:
        the run's counters (TrainState), which replace the parsed values of the arguments
        of the same name (Megatron's load sets a resumed run's consumed_*_samples in args)."""
        if self.writer is None:
            return
        live = live or {}
        with self._writing():
            for name, value in args_dict.items():
                self.writer.add_text(name, str(live.get(name, value)), global_step=iteration)

    def log_training(
        self, iteration: int, consumed_samples: int, lr: float, batch_size: int,
        losses: Dict[str, float], loss_scale: float, grad_norm: Optional[float],
        num_zeros: Optional[float], params_norm: Optional[float], world_size: int,
        mem_stats: Optional[Dict[str, float]] = None,
        timers_dict: Optional[Dict[str, float]] = None,
    ) -> None:
        """Training scalars every `tensorboard_log_interval` iterations.

        `losses` are this iteration's values; `mem_stats` is `torch.cuda.memory_stats()`;
        `timers_dict` maps timer name -> seconds per iteration (written as `<name>-time`).
        """
        cfg = self.config
        if self.writer is None or iteration % cfg.tensorboard_log_interval != 0:
            return
        scalars: List[Tuple[str, float]] = []
        if cfg.log_learning_rate_to_tensorboard:
            scalars.append(("learning-rate", lr))
        if cfg.log_batch_size_to_tensorboard:
            scalars.append(("batch-size", batch_size))
        scalars += list(losses.items())
        if cfg.log_loss_scale_to_tensorboard:
            scalars.append(("loss-scale", loss_scale))
        if cfg.log_world_size_to_tensorboard:
            scalars.append(("world-size", world_size))
        if grad_norm is not None:
            scalars.append(("grad-norm", grad_norm))
        if num_zeros is not None and cfg.log_num_zeros_in_grad:
            scalars.append(("num-zeros", num_zeros))
        if params_norm is not None and cfg.log_params_norm:
            scalars.append(("params-norm", params_norm))
        scalars = [(name, float(value), consumed_samples) for name, value in scalars]
        if mem_stats is not None and cfg.log_memory_to_tensorboard:
            scalars += [(name, mem_stats.get(key, 0), None) for name, key in _MEMORY_SCALARS]
        if timers_dict and cfg.log_timers_to_tensorboard:
            scalars += [(f"{name}-time", sec, None) for name, sec in timers_dict.items()]
        with self._writing():
            for name, value, samples in scalars:
                if samples is None:
                    self.writer.add_scalar(name, value, iteration)
                else:
                    self._both(name, value, iteration, samples)

    def log_iteration_time(self, iteration: int, seconds: float) -> None:
        """`iteration-time` (seconds per iteration), at log_interval with timer logging on."""
        if self.writer is not None and self.config.log_timers_to_tensorboard:
            with self._writing():
                self.writer.add_scalar("iteration-time", seconds, iteration)

    def log_validation(self, iteration: int, consumed_samples: int,
                       losses: Dict[str, float]) -> None:
        """`<key> validation` (+ `ppl` with log_validation_ppl_to_tensorboard), each with
        its `vs samples` twin."""
        if self.writer is None:
            return
        with self._writing():
            for key, value in losses.items():
                self._both(f"{key} validation", float(value), iteration, consumed_samples)
                if self.config.log_validation_ppl_to_tensorboard:
                    ppl = math.exp(min(20.0, float(value)))
                    self._both(f"{key} validation ppl", ppl, iteration, consumed_samples)

    def flush(self) -> None:
        if self.writer is not None:
            with self._writing():
                self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            with self._writing():
                self.writer.close()
            self.writer = None


def read_scalars(logdir: str) -> Dict[str, List[Tuple[int, float]]]:
    """Every scalar in the event files under `logdir`: name -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_texts(logdir: str) -> Dict[str, str]:
    """Text entries under `logdir` (latest value per tag), e.g. the arguments."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("tensors", []):
        events = acc.Tensors(tag)
        if events:
            vals = events[-1].tensor_proto.string_val
            if vals:
                out[tag.split("/")[0]] = vals[0].decode("utf-8")
    return out


__all__ = [
    "print_rank_0", "print_rank_last", "Timer", "Timers", "flops_per_token", "model_flops_per_token", "mfu",
    "format_iteration_line", "format_validation_block", "format_memory_line",
    "TensorboardLogger", "read_scalars", "read_texts",
]
