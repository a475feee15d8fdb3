"""`--profile`: a torch profiler trace for a window of iterations, plus NVTX ranges.

The trace is written with torch's tensorboard trace handler (open it in tensorboard's
profiler plugin, or chrome://tracing / Perfetto) under `<tensorboard-dir>/profile` or
`./profile`. On GPU each profiled iteration is also an NVTX range, so
`nsys profile -c cudaProfilerApi` captures the same window.
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch


class StepProfiler:
    """Profiles the iterations after the first `start` up to and including iteration `end`
    (1-based, as the log numbers them): Megatron-LM 23.05 starts profiling when `start`
    iterations are done (0: from the first) and stops when `end` are."""

    def __init__(self, enabled: bool, start: int, end: int, out_dir: str):
        if enabled and end <= start:
            raise ValueError(f"--profile-step-end ({end}) must be greater than "
                             f"--profile-step-start ({start})")
        self.enabled, self.start, self.end, self.out_dir = enabled, start, end, out_dir
        self.prof: Optional[torch.profiler.profile] = None
        self.cuda = torch.cuda.is_available()

    @classmethod
    def from_args(cls, args: dict, rank: int, tensorboard_dir: Optional[str]) -> "StepProfiler":
        enabled = bool(args.get("profile")) and rank in (args.get("profile_ranks") or [0])
        out = os.path.join(tensorboard_dir or ".", "profile")
        return cls(enabled, int(args.get("profile_step_start", 10)),
                   int(args.get("profile_step_end", 12)), out)

    def before_step(self, iteration: int) -> None:
        if not self.enabled or iteration != self.start + 1:
            return
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.cudart().cudaProfilerStart()
        self.prof = torch.profiler.profile(
            activities=acts, record_shapes=True,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.out_dir))
        self.prof.__enter__()

    def step_range(self, iteration: int):
        if self.prof is None:
            return contextlib.nullcontext()
        if self.cuda:
            return torch.cuda.nvtx.range(f"iteration {iteration}")
        return torch.profiler.record_function(f"iteration {iteration}")

    def after_step(self, iteration: int) -> None:
        if self.prof is None:
            return
        self.prof.step()
        if iteration >= self.end:
            self.finish()

    def finish(self) -> None:
        """Write the trace of the window so far (the run stopped inside it: its end, an
        exit condition) and stop profiling."""
        if self.prof is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        self.prof.__exit__(None, None, None)
        self.prof = None
        self.enabled = False
        print(f" > profiler trace written under {self.out_dir}", flush=True)

    def window_note(self, first: int, last: int) -> Optional[str]:
        """What the window (iterations start+1..end) does in a run of iterations
        first..last: None when it lies inside, else a WARNING line (no trace at all, or one
        cut at the run's end)."""
        if not self.enabled:
            return None
        window = f"--profile window (iterations {self.start + 1}-{self.end})"
        if self.start + 1 < first:
            return (f"WARNING: the {window} starts before this run's first iteration {first} "
                    f"(resumed from iteration {first - 1}): no trace will be written; pass "
                    f"--profile-step-start {first - 1} or more")
        if self.start + 1 > last:
            return (f"WARNING: the {window} starts after this run's last iteration {last}: "
                    f"no trace will be written; pass --profile-step-start {first - 1} (and "
                    f"--profile-step-end at most {last}) or a longer run")
        if self.end > last:
            return (f"WARNING: the {window} ends after this run's last iteration {last}: the "
                    f"trace covers iterations {self.start + 1}-{last}")
        return None
