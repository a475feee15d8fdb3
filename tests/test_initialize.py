"""initialize_distributed on a node with fewer GPUs than processes: a clean error naming
the GPU count and the fix, before any CUDA call (was 'CUDA error: invalid device ordinal')."""
from __future__ import annotations

import pytest
import torch

import megatron.initialize as init
from megatron.config import ParallelConfig


def test_a_local_rank_without_a_gpu_is_refused_with_the_fix():
    init.check_local_rank(0, 1)
    init.check_local_rank(7, 8)
    with pytest.raises(SystemExit, match=r"local rank 1 has no GPU: this node has 1 visible "
                                         r"GPU\(s\).*--nproc-per-node 1.*CUDA_VISIBLE_DEVICES="):
        init.check_local_rank(1, 1)


def test_initialize_checks_before_touching_the_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def no_cuda_call(*args, **kwargs):
        raise AssertionError("set_device called for a GPU that does not exist")

    monkeypatch.setattr(torch.cuda, "set_device", no_cuda_call)
    with pytest.raises(SystemExit, match="local rank 1 has no GPU"):
        init.initialize_distributed(ParallelConfig(), rank=1, world_size=2, local_rank=1)
