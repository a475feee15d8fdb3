"""Test-session settings.

Without CUDA, the Triton kernels (AdamW, fused cross entropy) run in Triton's CPU
interpreter. Triton builds its own library functions (tl.sum, tl.max, ...) for the
interpreter only when TRITON_INTERPRET is set before Triton is first imported, so it is
set here, before any test module imports Triton. Where CUDA is visible it stays unset and
the kernels compile for the GPU.
"""
import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
