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
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
            self.prof.__exit__(None, None, None)
            self.prof = None
            self.enabled = False
            print(f" > profiler trace written under {self.out_dir}", flush=True)
