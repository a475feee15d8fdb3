"""The switch MLP's grouped expert dispatch (megatron/core/models/gpt/grouped_experts.py)
against its loop dispatch, the reference.

1. Parity (fp32, the same module deep-copied, one copy forced to the loop): the output,
   the separate fc2 bias and every gradient (input, router, every expert parameter) agree
   within max|grouped - loop| <= 1e-6 * (1 + max|loop|), for 1 to 8 experts, each
   activation, with and without biases, one expert without tokens (its gradients are
   exactly zero, and present); on two gloo ranks with the experts split over TP the same
   holds on each rank's shards and for the input gradient (the TP all-reduce); three
   training steps of a small GPT (grad buffers, gradient-accumulation fusion) give the
   same losses, gradients and weights within the same bound.
2. No host reads in the grouped forward and backward (the tensor-to-Python conversions
   raise while they run; the loop needs them); every expert parameter is seen by the
   forward pre-hooks of the modules called (what the DDP wrapper's
   --overlap-param-gather waits on); no stacked copy of the expert weights is saved for
   the backward; the loop is kept where the probe fails (no operator, bf16 widths off the
   16-byte rule).
3. Whole-step CUDA graphs: --num-experts no longer rules them out once every switch MLP is
   host-free; without --bf16 `--cuda-graph-step on` is still refused.
4. CUDA (skipped without a GPU): bf16 grouped vs loop, and no synchronising CUDA call in
   the grouped forward and backward (torch.cuda.set_sync_debug_mode("error")).
"""
from __future__ import annotations

import pytest
import torch

from megatron.core.config import ModelConfig
from megatron.core.models.gpt import grouped_experts
from megatron.core.models.gpt.transformer import SwitchMLP
from tests.dist_utils import run_distributed

H, FFN = 16, 24


def _switch(activation="gelu", bias=True, experts=3, tp_group=None, dtype=torch.float32,
            device="cpu", hidden=H, ffn=FFN, **kw) -> SwitchMLP:
    """A switch MLP whose last expert gets no tokens (when there are several)."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, hidden_size=hidden, num_attention_heads=2,
                      padded_vocab_size=32, seq_length=8, max_position_embeddings=8,
                      ffn_hidden_size=ffn, activation=activation, add_bias_linear=bias,
                      num_experts=experts, init_method_std=0.1, use_cpu_initialization=True,
                      params_dtype=dtype, **kw)
    mlp = SwitchMLP(cfg, tp_group=tp_group, device="cpu")
    with torch.no_grad():
        for p in mlp.parameters():  # nonzero biases, so that their paths count
            if p.dim() == 1:
                p.copy_(torch.linspace(-0.5, 0.5, p.numel()))
        mlp.router.weight.mul_(8)  # spread the tokens over the experts
        if experts > 1:
            mlp.router.bias[-1] = -1e4
    return mlp.to(device)


def _pair(build):
    """The module `build()` makes twice (the same weights), one forced to the loop."""
    mlp, loop = build(), build()
    loop.dispatch = "loop"
    assert mlp.grouped_dispatch() and not loop.grouped_dispatch()
    return mlp, loop


def _run(mlp: SwitchMLP, x: torch.Tensor, weight: torch.Tensor):
    """(output, bias, {name: grad}) for loss = sum((out + bias) * weight)."""
    x = x.detach().clone().requires_grad_()
    out, bias = mlp(x)
    loss = ((out if bias is None else out + bias) * weight).sum()
    names = ["input"] + [n for n, _ in mlp.named_parameters()]
    grads = torch.autograd.grad(loss, [x, *mlp.parameters()])
    return out.detach(), None if bias is None else bias.detach(), dict(zip(names, grads))


def _inputs(h=H, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, h, generator=gen).to(device, dtype)
    weight = torch.randn(8, 3, h, generator=gen).to(device, dtype)
    return x, weight


def _max_rel_diff(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / (1 + want.float().abs().max())).item()


def _compare(mlp: SwitchMLP, loop: SwitchMLP, x, weight, tol: float) -> dict:
    """Every difference (relative, see the module docstring) within `tol`; returns them."""
    (out, bias, grads), (ref, ref_bias, ref_grads) = _run(mlp, x, weight), _run(loop, x, weight)
    diffs = {"output": _max_rel_diff(out, ref)}
    assert (bias is None) == (ref_bias is None)
    if bias is not None:
        diffs["bias"] = _max_rel_diff(bias, ref_bias)
    for name, g in grads.items():
        diffs[name] = _max_rel_diff(g, ref_grads[name])
    bad = {k: v for k, v in diffs.items() if not v <= tol}
    assert not bad, bad
    return {"diffs": diffs, "grads": grads, "ref_grads": ref_grads}


# ---------------------------------------------------------------------------- 1. parity
@pytest.mark.parametrize("activation,bias,experts,kw", [
    ("gelu", True, 3, {}),
    ("swiglu", False, 4, {}),
    ("swiglu", True, 2, {}),
    ("squared_relu", True, 8, {}),
    ("openai_gelu", True, 1, {}),
    ("gelu", True, 3, {"gelu_kernel": "epilogue"}),  # the loop's experts: the GeLU epilogue
], ids=["gelu-bias-3", "swiglu-4", "swiglu-bias-2", "sqrelu-bias-8", "tanh-gelu-1",
        "gelu-epilogue-3"])
def test_grouped_dispatch_equals_the_loop(activation, bias, experts, kw):
    mlp, loop = _pair(lambda: _switch(activation, bias, experts, **kw))
    x, weight = _inputs()
    result = _compare(mlp, loop, x, weight, tol=1e-6)
    if experts > 1:  # the last expert had no tokens: zero gradients, on both paths
        idle = f"experts.{experts - 1}."
        for name, g in result["grads"].items():
            if idle in name:
                assert g is not None and not g.any() and not result["ref_grads"][name].any()
        busy = [g for n, g in result["grads"].items() if "experts.0." in n]
        assert all(g.any() for g in busy)


def _tp_worker(rank, world, activation, bias):
    from megatron.core.parallel_state import ParallelState

    ps = ParallelState.build(world, rank, tp_size=world)
    mlp, loop = _pair(lambda: _switch(activation, bias, 4, tp_group=ps.tp_group))
    assert mlp.experts[0].dense_4h_to_h.weight.shape[1] == FFN // 2  # split over the ranks
    x, weight = _inputs()
    return _compare(mlp, loop, x, weight, tol=1e-6)["diffs"]


@pytest.mark.parametrize("activation,bias", [("gelu", True), ("swiglu", False)])
def test_grouped_dispatch_equals_the_loop_on_two_tensor_parallel_ranks(activation, bias):
    for diffs in run_distributed(_tp_worker, 2, activation, bias):
        assert set(diffs) >= {"input", "router.weight", "experts.3.dense_4h_to_h.weight"}


@pytest.mark.parametrize("model_kw", [
    dict(gradient_accumulation_fusion=True),
    dict(activation="swiglu", ffn_hidden_size=48, add_bias_linear=False),
], ids=["fusion", "swiglu"])
def test_training_steps_with_the_grouped_dispatch_equal_the_loop(monkeypatch, model_kw):
    """Three steps of the small GPT of tests/test_moe.py (4 experts, grad buffers, the
    fused weight-grad path for the loop's experts): the same losses, gradients and
    weights within 1e-6 * (1 + max|loop|)."""
    from tests.test_moe import _parity_worker

    grouped = _parity_worker(0, 1, 1, 1, model_kw, {})
    monkeypatch.setattr(SwitchMLP, "grouped_dispatch", lambda self: False)
    loop = _parity_worker(0, 1, 1, 1, model_kw, {})
    torch.testing.assert_close(torch.tensor(grouped["losses"]), torch.tensor(loop["losses"]),
                               rtol=1e-6, atol=0)
    for kind in ("grads", "params"):
        assert grouped[kind].keys() == loop[kind].keys()
        for name, want in loop[kind].items():
            assert _max_rel_diff(grouped[kind][name], want) <= 1e-6, (kind, name)


# ------------------------------------------------- 2. host reads, pre-hooks, fallback
_HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu",
               "numpy")


def test_the_grouped_dispatch_reads_nothing_back_to_the_host(monkeypatch):
    mlp, loop = _pair(lambda: _switch(experts=4))
    x, weight = _inputs()

    def host_read(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host")

    for name in _HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, host_read)
    out, bias = mlp(x.requires_grad_())
    ((out + bias) * weight).sum().backward()
    with pytest.raises(AssertionError, match="read back to the host"):
        loop(x)


def test_every_expert_parameter_reaches_a_forward_pre_hook():
    """The DDP wrapper's --overlap-param-gather pre-hook waits for the parameters of the
    module called and for parameters passed to it: all expert parameters must be among
    them, though the grouped dispatch never calls the experts' modules."""
    mlp = _switch(experts=3)
    seen = set()

    def hook(module, args):
        seen.update(id(t) for t in [*module._parameters.values(), *args]
                    if isinstance(t, torch.nn.Parameter))

    for sub in mlp.modules():
        sub.register_forward_pre_hook(hook)
    mlp(_inputs()[0])
    assert seen == {id(p) for p in mlp.parameters()}


def test_no_stacked_copy_of_the_expert_weights_is_kept_for_the_backward():
    """The grouped products stack the experts' weights again in the backward: a saved
    [E, n, k] stack would keep a second copy of every expert's weights per layer."""
    mlp = _switch(experts=4)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(_inputs()[0].requires_grad_())
    assert saved and not [s for s in saved if len(s) == 3 and s[0] == 4], saved


def test_the_loop_is_kept_where_the_grouped_gemm_cannot_run(monkeypatch):
    bf16 = _switch(experts=2, dtype=torch.bfloat16, hidden=12, ffn=20)  # 24-byte rows
    assert not bf16.grouped_dispatch() and not bf16.sync_free()
    x = _inputs(12, torch.bfloat16)[0]
    assert bf16(x)[0].shape == x.shape
    monkeypatch.setattr(grouped_experts, "_GROUPED_MM", None)
    grouped_experts.grouped_mm_works.cache_clear()
    try:
        mlp = _switch(experts=2)
        assert not mlp.grouped_dispatch()
        assert mlp(_inputs()[0])[0].shape == (8, 3, H)
    finally:
        grouped_experts.grouped_mm_works.cache_clear()


# ------------------------------------------------------------------ 3. CUDA graphs
def test_experts_rule_out_a_captured_step_only_without_the_host_free_dispatch():
    from megatron.arguments import ArgumentsError, parse_and_validate
    from megatron.core.models.gpt.grouped_experts import experts_sync_free
    from megatron.step_graph import settings_reason

    base = dict(device_type="cuda", world_size=1, hidden_dropout=0.0, attention_dropout=0.0,
                nan_loss_policy="stop", timing_log_level=0, rampup_batch_size=None,
                empty_unused_memory_level=0, compile_mode="default", adam_kernel="auto",
                optimizer="adam", num_experts=4)
    assert "--num-experts 4: the switch MLP's tokens per expert are counted on the host" in \
        settings_reason(**base)
    assert settings_reason(**base, experts_sync_free=True) is None
    mlp = _switch(experts=2)
    assert experts_sync_free(torch.nn.ModuleList([mlp]))  # the CPU: grouped, host-free
    mlp.dispatch = "loop"
    assert not experts_sync_free(torch.nn.ModuleList([mlp]))

    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --lr 1e-3 --train-iters 1 "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 127 --hidden-dropout 0 "
            "--attention-dropout 0 --num-experts 4 --cuda-graph-step on").split()
    parse_and_validate(argv + ["--bf16"], cuda_available=True, env={})
    with pytest.raises(ArgumentsError, match="--num-experts 4: the switch MLP's tokens"):
        parse_and_validate(argv, cuda_available=True, env={})


# --------------------------------------------------------------------------- 4. CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_grouped_dispatch_on_cuda_matches_the_loop_without_syncs():
    def build():
        return _switch("gelu", True, 8, dtype=torch.bfloat16, device="cuda", hidden=64,
                       ffn=256)

    if not build().sync_free():
        pytest.skip("no host-free grouped GEMM on this GPU / torch")
    mlp, loop = _pair(build)
    x, weight = _inputs(64, torch.bfloat16, "cuda")
    _compare(mlp, loop, x, weight, tol=2e-2)  # bf16: another summation order
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, bias = mlp(x.requires_grad_())
        ((out + bias) * weight).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
