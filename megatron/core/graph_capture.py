"""Whether the code running now is being recorded into a whole-step CUDA graph.

Code inside a captured training step (`--cuda-graph-step`, megatron/step_graph.py) runs
once on the host while the GPU work is recorded, then the GPU work is replayed every step
without the host code. Host-side work that must happen every step (writing this step's
learning rate into the device tensor the optimizer kernel reads, counting the step) asks
`capturing()` and leaves that work to the step's replay driver.

`simulated_capture()` marks host code as captured without CUDA: the CPU tests drive the
same step code through a stand-in graph that re-runs the recorded function at replay.
"""
from __future__ import annotations

import contextlib

import torch

_SIMULATED = [False]


def capturing() -> bool:
    """True while a whole-step graph is being recorded (or simulated, in tests)."""
    if _SIMULATED[0]:
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def simulated_capture():
    """Make `capturing()` answer True inside the block (CPU stand-in for a capture)."""
    previous, _SIMULATED[0] = _SIMULATED[0], True
    try:
        yield
    finally:
        _SIMULATED[0] = previous
