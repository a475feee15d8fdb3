"""The gradient a training step hands the optimizer is the derivative of the loss the step
reports (tests/grad_audit.py: directional five-point differences in fp32 on the CPU; the
16-bit steps against fp32): GPT-2-like with dropout under every recompute, compiled with
selective and full recompute, llama-style, a switch MLP, post-LN residuals, two
micro-batches, the distributed optimizer with a loss scale, bf16, fp16 with a dynamic loss
scale (through torch's AdamW step and through the Triton kernel's reading of the grad
buffers). And the audit itself fails a recompute that draws other dropout masks than the
forward, and a gradient unscaled by twice the loss scale.

The whole matrix on a GPU: benchmarks/grad_audit.py."""
from __future__ import annotations

import pytest
import torch

from megatron.core.optimizer import multi_tensor_adam
from megatron.core.optimizer.grad_scaler import MegatronGradScaler
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from megatron.core.tensor_parallel.random import _ReplayTrackerStates
from tests.grad_audit import TOLERANCE, audit_case, case

CPU = torch.device("cpu")


def _audit(name: str):
    row = audit_case(case(name), CPU)
    assert row.ok, f"{row.name}: {row.check} error {row.error:.2e} ({row.detail})"
    return row


@pytest.mark.parametrize("name", [
    "gpt2/eager/none", "gpt2/eager/selective", "gpt2/eager/full-uniform",
    "gpt2/eager/full-block", "llama/selective", "moe-2-experts", "post-layernorm",
    "2-micro-batches/selective", "distopt/loss-scale-4096", "bf16", "fp16/dynamic-scale",
])
def test_the_step_gradient_is_the_derivative_of_its_loss(name):
    _audit(name)


@pytest.mark.slow  # inductor on the CPU: 10-25 s each
@pytest.mark.parametrize("name", ["gpt2/compiled/selective", "gpt2/compiled/full-uniform"])
def test_compiled_layers_with_recompute_and_dropout(name):
    _audit(name)



@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["gpt2/compiled/selective", "llama/selective"])
def test_compiled_selective_recompute_with_attention_dropout_on_cuda(name):
    """The fused attention kernels' dropout under compiled selective recompute: before
    ParallelAttention._recompute_core, directional error 2.5 (gpt2) and 1.8 (llama) on an
    H100 in fp32 (the memory-efficient kernel, torch 2.11), 1e-4 and 4e-5 after."""
    row = audit_case(case(name), torch.device("cuda"))
    assert row.ok, f"{row.name}: {row.check} error {row.error:.2e} ({row.detail})"

def test_fp16_through_the_triton_kernel_step_is_unscaled(triton_interpreter, monkeypatch):
    """The Triton AdamW step (the default on GPUs) reads the fp16 grad buffers and divides
    by the loss scale itself; what it would apply is the fp32 gradient."""
    monkeypatch.setattr(multi_tensor_adam, "INTERPRET_ON_CPU", True)
    kernel_steps = []
    buffer_step = MixedPrecisionOptimizer._buffer_step

    def counted(self, multi, timers=None):
        kernel_steps.append(multi)
        return buffer_step(self, multi, timers)

    monkeypatch.setattr(MixedPrecisionOptimizer, "_buffer_step", counted)
    row = _audit("fp16/dynamic-scale")
    assert kernel_steps, "the fp16 step did not take the Triton kernel's path"
    assert not row.detail.endswith("loss scale 1"), row.detail


def test_the_audit_fails_a_recompute_with_other_dropout_masks(monkeypatch):
    """Full recompute that does not replay the tracker streams of the forward: the
    recomputed attention draws other dropout masks, and the error is far outside the
    bound (1e-1 against 2e-4 correct)."""
    def enter_without_replay(self):
        self.saved = self.tracker.get_states()
        return self

    monkeypatch.setattr(_ReplayTrackerStates, "__enter__", enter_without_replay)
    row = audit_case(case("gpt2/eager/full-uniform"), CPU)
    assert row.error > 10 * TOLERANCE, row


def test_the_audit_fails_a_gradient_left_scaled(monkeypatch):
    """Grads unscaled by 1 / (2 x scale): half the derivative, seen by the directional
    check in fp32 (the distributed optimizer's constant scale) and by the fp16 one."""
    monkeypatch.setattr(MegatronGradScaler, "inv_scale",
                        property(lambda self: 0.5 / self._scale.float()))
    for name in ("distopt/loss-scale-4096", "fp16/dynamic-scale"):
        row = audit_case(case(name), CPU)
        assert not row.ok and row.error > 0.1, row
