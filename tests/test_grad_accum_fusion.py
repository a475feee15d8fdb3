"""Gradient accumulation fusion (--gradient-accumulation-fusion): the parallel linear layers
add their weight grads straight into `param.main_grad` and produce no `.grad`.

The fused GPT must give the same main grads as the unfused one, micro-batches accumulated
in the DDP grad buffer: fp32 -> identical for every weight but the tied word embedding,
whose two contributions (lookup and output layer) are summed in another order (rtol 1e-6);
bf16 parameters with fp32 main grads -> rtol 1e-2. With DP=2, overlapped bucketed
reduction and the distributed optimizer's reduce-scatter, the fused grads still reach every
bucket's hook (all buckets start during the backward) and equal the single-process
full-batch grads (fp32, max abs diff <= 1e-5 * (1 + max|g|)). Full activation recompute
keeps the fused path (eager, compiled, TP=2 with distributed inputs): its main grads equal
the fused run's without recompute (fp32 eager bit for bit).
"""
from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from typing import NamedTuple

import pytest
import torch

from megatron.arguments import parse_and_validate
from megatron.core.config import ModelConfig, ParallelConfig
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 128
EMBEDDING = "language_model.embedding.word_embeddings.weight"


def _model(fusion: bool, dtype=torch.float32) -> GPTModel:
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                      padded_vocab_size=VOCAB, seq_length=SEQ, max_position_embeddings=SEQ,
                      hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                      params_dtype=dtype, gradient_accumulation_fusion=fusion)
    return GPTModel(cfg, device="cpu")


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))


def _loss(model, tokens):
    return model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()


def _ddp_grads(fusion, ps, parallel: ParallelConfig, tokens, num_micro=2, dtype=torch.float32):
    """Main grads after one iteration of `num_micro` micro-batches (all but the last in
    no_sync), and whether every bucket had started before finish_grad_sync."""
    model = _model(fusion, dtype)
    ddp = DistributedDataParallel(model, ps, parallel)
    ddp.zero_grad_buffer()
    for m, micro in enumerate(tokens.chunk(num_micro)):
        with ddp.no_sync() if m < num_micro - 1 else nullcontext():
            (_loss(ddp, micro) / num_micro).backward()
    started = all(b._started for b in ddp.buckets)
    ddp.finish_grad_sync()
    assert all(p.grad is None for p in model.parameters())
    grads = {}
    for name, p in model.named_parameters():
        bucket = p.grad_bucket
        start, end = bucket.param_ranges[p]
        lo, hi = bucket.shard_range  # the elements this rank holds reduced
        a, b = max(start, lo) - start, min(end, hi) - start
        grads[name] = (p.main_grad.reshape(-1)[a:b].clone(), a, b)
    return grads, started


def _compare(got, ref, what, rtol):
    for name, (g, a, b) in got.items():
        expected = ref[name][0][a:b]
        if rtol == 0 and name != EMBEDDING:
            assert torch.equal(g, expected), f"{what}: {name} differs"
        else:
            diff = (g - expected).abs().max().item() if g.numel() else 0.0
            bound = max(rtol, 1e-6) * (1 + expected.abs().max().item()) if g.numel() else 0
            assert diff <= bound, f"{what}: {name} off by {diff}"


def test_fused_layers_write_main_grad_only():
    for fusion in (True, False):
        model = _model(fusion)
        for p in model.parameters():
            p.main_grad = torch.zeros_like(p)
        _loss(model, _tokens()).backward()
        fc1 = model.language_model.encoder.layers[0].mlp.dense_h_to_4h
        assert fc1.gradient_accumulation_fusion is fusion
        assert (fc1.weight.grad is None) is fusion
        assert bool(fc1.weight.main_grad.abs().sum() > 0) is fusion
        norm = model.language_model.encoder.layers[0].input_layernorm
        for p in (fc1.bias, norm.weight, norm.bias):  # biases and norms: into main_grad too
            assert (p.grad is None) is fusion
            assert bool(p.main_grad.abs().sum() > 0) is fusion


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 0.0), (torch.bfloat16, 1e-2)])
def test_fused_equals_unfused_single_process(dtype, rtol):
    ps = ParallelState.build()
    parallel = ParallelConfig(accumulate_allreduce_grads_in_fp32=True)
    ref, _ = _ddp_grads(False, ps, parallel, _tokens(), dtype=dtype)
    got, _ = _ddp_grads(True, ps, parallel, _tokens(), dtype=dtype)
    assert all(g.dtype == torch.float32 for g, _, _ in got.values())
    _compare(got, ref, f"{dtype}", rtol)


def _dp_worker(rank, world):
    ps = ParallelState.build(world, rank)
    tokens = _tokens()
    local = tokens[rank * GLOBAL_BATCH // world:(rank + 1) * GLOBAL_BATCH // world]
    out = {}
    for name, distributed in (("allreduce", False), ("reduce_scatter", True)):
        parallel = ParallelConfig(dp_size=world, world_size=world, overlap_grad_reduce=True,
                                  ddp_bucket_size=3000, use_distributed_optimizer=distributed)
        out[name] = _ddp_grads(True, ps, parallel, local)
    return out


def test_fused_grads_reduce_over_dp_with_overlap_and_reduce_scatter():
    single, _ = _ddp_grads(False, ParallelState.build(), ParallelConfig(), _tokens(),
                           num_micro=4)
    for rank, out in enumerate(run_distributed(_dp_worker, 2)):
        for name, (grads, started) in out.items():
            assert started, f"{name}: a bucket waited for finish_grad_sync (hook missed)"
            _compare(grads, single, f"dp=2 {name} rank={rank}", rtol=1e-5)


class _Iterations(NamedTuple):
    grads: dict  # name -> main grad after the second iteration
    stale_left: int  # main grads still listed as stale after it
    through_grad: set  # names whose gradient reached autograd's `.grad` (the hook moved it)
    hook_calls: Counter  # name -> grad-hook calls (what marks a parameter ready)


def _two_iterations(fusion: bool, compile_layers: bool = False, dtype=torch.float32,
                    ps=None, parallel=None, **model_kwargs) -> _Iterations:
    """Two DDP iterations of 2 micro-batches each (different tokens): see _Iterations.
    `ps`, `parallel`: a tensor-parallel layout (default: one process); `model_kwargs`:
    more ModelConfig fields (e.g. activation recompute)."""
    from megatron.core.distributed import stale_grads
    from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_seed

    ps = ParallelState.build() if ps is None else ps
    tracker = model_parallel_seed(0, ps.tp_rank, RNGStatesTracker("cpu"))
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                      padded_vocab_size=VOCAB, seq_length=SEQ, max_position_embeddings=SEQ,
                      hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                      params_dtype=dtype, gradient_accumulation_fusion=fusion,
                      compile_layers=compile_layers, **model_kwargs)
    model = GPTModel(cfg, tp_group=ps.tp_group, rng_tracker=tracker, device="cpu")
    through_grad, hook_calls = set(), Counter()

    def record(name, p):
        hook_calls[name] += 1
        if p.grad is not None:
            through_grad.add(name)

    for name, p in model.named_parameters():  # runs before the DDP hook, which clears .grad
        p.register_post_accumulate_grad_hook(lambda p, name=name: record(name, p))
    parallel = ParallelConfig(accumulate_allreduce_grads_in_fp32=True) if parallel is None \
        else parallel
    ddp = DistributedDataParallel(model, ps, parallel)
    for seed in (3, 4):
        tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1),
                               generator=torch.Generator().manual_seed(seed))
        ddp.zero_grad_buffer()
        for m, micro in enumerate(tokens.chunk(2)):
            with ddp.no_sync() if m == 0 else nullcontext():
                (_loss(ddp, micro) / 2).backward()
        ddp.finish_grad_sync()
    return _Iterations({n: p.main_grad.clone() for n, p in model.named_parameters()},
                       sum(stale_grads.pending(p.main_grad) for p in model.parameters()),
                       through_grad, hook_calls)


@pytest.mark.parametrize("compile_layers", [False, True])
def test_stale_weight_grads_are_overwritten_by_the_first_product(compile_layers):
    """The grad buffer does not zero the fused linear weights' main grads at the start of
    an iteration; their first weight-grad product overwrites the previous iteration's
    values. Second-iteration grads equal the unfused ones (which are zeroed and added):
    fp32, eager exactly (the tied embedding within 1e-6), compiled layers within 1e-5;
    nothing is left listed as stale."""
    ref = _two_iterations(False).grads
    got, left = _two_iterations(True, compile_layers)[:2]
    assert left == 0
    for name, g in ref.items():
        if compile_layers or name == EMBEDDING:
            assert torch.allclose(got[name], g, rtol=1e-5, atol=1e-6), name
        else:
            assert torch.equal(got[name], g), name


EMBEDDINGS = {EMBEDDING, "language_model.embedding.position_embeddings.weight"}
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_num_layers": 1}


def _check_fused_path_kept(got: _Iterations, ref: _Iterations, what, rtol=0.0, atol=0.0):
    """`got` (recompute) kept the fused path as `ref` (no recompute) did: only the unfused
    embeddings' grads reached `.grad`, every grad hook fired as often (each parameter is
    marked ready), nothing is left stale, and the main grads match (exactly when rtol 0)."""
    assert ref.through_grad == EMBEDDINGS, what
    assert got.through_grad == EMBEDDINGS, (what, sorted(got.through_grad - EMBEDDINGS))
    assert got.hook_calls == ref.hook_calls and got.stale_left == 0, what
    for name, g in ref.grads.items():
        if rtol == 0:
            assert torch.equal(got.grads[name], g), (what, name)
        else:
            assert torch.allclose(got.grads[name], g, rtol=rtol, atol=atol), (what, name)


@pytest.mark.parametrize("method,dtype,activation", [
    ("uniform", torch.float32, "gelu"), ("block", torch.float32, "gelu"),
    ("uniform", torch.bfloat16, "gelu"), ("block", torch.bfloat16, "gelu"),
    ("uniform", torch.float32, "openai_gelu"),  # fc1/fc2 through the GeLU-epilogue pair
], ids=["uniform", "block", "uniform-bf16", "block-bf16", "uniform-gelu-epilogue"])
def test_full_recompute_keeps_the_fused_path(method, dtype, activation):
    """Under full activation recompute (torch's non-reentrant checkpoint) the backward gets
    a recomputed alias of each saved parameter, without `main_grad`; the layers write into
    the grad buffer recorded at forward time instead, so no fused gradient goes through
    `.grad` and the grad hook. Over two iterations of two micro-batches (the first product
    of the second overwrites the stale buffer) the main grads equal the run without
    recompute: fp32 bit for bit; bf16 parameters (fp32 main grads) within rtol 1e-2,
    atol 1e-5 (the same operations, so equal in practice)."""
    ref = _two_iterations(True, dtype=dtype, activation=activation)
    got = _two_iterations(True, dtype=dtype, activation=activation, recompute_method=method,
                          **FULL_RECOMPUTE)
    bf16 = dtype == torch.bfloat16
    _check_fused_path_kept(got, ref, method, rtol=1e-2 if bf16 else 0.0, atol=1e-5)


def test_full_recompute_keeps_the_fused_path_in_compiled_layers():
    """Compiled layers under full recompute (the checkpoint wraps each compiled layer): the
    compiled backward takes main_grad from the forward's inputs, which the recompute saves
    again as an alias of the same buffer, so the fused path holds there without the
    forward-time record. Main grads equal the compiled run without recompute within
    rtol 1e-5, atol 1e-6 (that run compiles from norm to norm across layer boundaries, so
    its kernels round differently)."""
    ref = _two_iterations(True, compile_layers=True)
    got = _two_iterations(True, compile_layers=True, recompute_method="uniform",
                          **FULL_RECOMPUTE)
    _check_fused_path_kept(got, ref, "compiled", rtol=1e-5, atol=1e-6)


def _tp2_recompute_worker(rank, world):
    ps = ParallelState.build(world, rank, tp_size=world)
    parallel = ParallelConfig(tp_size=world, world_size=world)
    return {name: _two_iterations(True, ps=ps, parallel=parallel, **kw) for name, kw in (
        ("none", {}),
        ("full", dict(recompute_method="uniform", **FULL_RECOMPUTE)),
        ("distributed", dict(recompute_method="uniform", distribute_saved_activations=True,
                             **FULL_RECOMPUTE)))}


def test_tp2_full_recompute_and_distributed_inputs_keep_the_fused_path():
    """TP=2 on gloo: full recompute keeps the fused path as on one process; so does
    --distribute-saved-activations, whose backward reruns the layer on the parameters
    themselves (it did before the forward-time record too). Each rank's main grads equal
    its run without recompute bit for bit (fp32)."""
    for rank, out in enumerate(run_distributed(_tp2_recompute_worker, 2)):
        for name in ("full", "distributed"):
            _check_fused_path_kept(out[name], out["none"], f"rank {rank} {name}")


def _fused_pair(fill: float):
    """Two fused column-parallel linears under DDP, the grad buffer filled with `fill`
    (stale values from an earlier step)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    torch.manual_seed(0)
    init = torch.nn.init.normal_
    pair = torch.nn.ModuleList([ColumnParallelLinear(8, 6, gather_output=False,
                                                     bias=False, init_method=init,
                                                     gradient_accumulation_fusion=True,
                                                     device="cpu")
                                for _ in range(2)])
    ddp = DistributedDataParallel(pair, ParallelState.build(), ParallelConfig())
    for buffer in ddp.grad_buffers.values():
        buffer.data.fill_(fill)
    return pair, ddp


def test_stale_grads_nobody_writes_are_zeroed_and_other_writers_copy():
    """A fused weight that gets no gradient this iteration ends with a zero main grad, not
    the stale one; a fused weight whose gradient arrives through autograd instead (the
    layer's fusion switched off) is copied, not added, by the grad hook."""
    pair, ddp = _fused_pair(7.0)
    x = torch.randn(5, 8)
    ddp.zero_grad_buffer()
    pair[0].gradient_accumulation_fusion = False  # its grad comes through .grad now
    pair[0](x)[0].sum().backward()
    ddp.finish_grad_sync()
    expected = torch.ones(5, 6).t() @ x
    assert torch.allclose(pair[0].weight.main_grad, expected, rtol=1e-6)
    assert torch.equal(pair[1].weight.main_grad, torch.zeros(6, 8))


def test_a_fused_weight_routed_another_way_is_refused():
    """Adding into a stale main grad would keep the previous step's values: routing a
    fused weight through grad_into_main_grad is refused, and a grad hook that finds its
    main grad never claimed (the product wrote a copy of the buffer) raises."""
    from megatron.core.distributed import stale_grads
    from megatron.core.tensor_parallel.layers import grad_into_main_grad

    pair, ddp = _fused_pair(7.0)
    ddp.zero_grad_buffer()
    with pytest.raises(ValueError, match="grad_overwrites_stale"):
        grad_into_main_grad(pair[0].weight, True)
    with pytest.raises(RuntimeError, match="without claiming its stale main_grad"):
        ddp._grad_hook(pair[1].weight)  # .grad None, main grad still listed
    ddp.finish_grad_sync()
    assert not any(stale_grads.pending(p.main_grad) for p in pair.parameters())


def test_the_stale_list_holds_its_tensors_weakly():
    """A main grad listed and then dropped before any write claimed it (a buffer freed
    mid-step) leaves no entry behind: its memory, reused, cannot pass for it."""
    from megatron.core.distributed import stale_grads

    kept, dropped = torch.zeros(4, 8), torch.zeros(3, 8)
    stale_grads.mark([kept, dropped])
    key = (dropped.data_ptr(), dropped.numel())
    del dropped
    assert key not in stale_grads._STALE and stale_grads.pending(kept)
    stale_grads.settle([kept])
    assert not stale_grads.pending(kept)


def test_cli_flag_maps_to_model_config():
    base = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--max-position-embeddings 32 --micro-batch-size 2 --lr 1e-3 --train-iters 10 "
            "--tokenizer-type NullTokenizer --vocab-size 100 --mock-data").split()
    run = lambda extra: parse_and_validate(base + extra, world_size=1, env={},  # noqa: E731
                                           cuda_available=False)
    assert run([]).model.gradient_accumulation_fusion is True  # Megatron's default
    assert run(["--no-gradient-accumulation-fusion"]).model.gradient_accumulation_fusion is False


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp32-output GEMM is CUDA-only")
def test_cuda_gemm_overwrites_a_stale_fp32_main_grad():
    """A main grad listed as stale gets the product written over it (beta 0) by the first
    call, the second call adds: two products of bf16 operands within 1e-5 of float64."""
    from megatron.core.distributed import stale_grads
    from megatron.core.tensor_parallel.layers import accumulate_weight_grad

    gen = torch.Generator(device="cuda").manual_seed(8)
    main_grad = torch.full((96, 64), 1e3, device="cuda")
    pairs = [(torch.randn(512, 96, device="cuda", generator=gen).bfloat16(),
              torch.randn(512, 64, device="cuda", generator=gen).bfloat16()) for _ in range(2)]
    stale_grads.mark([main_grad])
    for dy, x in pairs:
        accumulate_weight_grad(main_grad, dy, x)
    assert not stale_grads.pending(main_grad)
    ref = sum(dy.double().t() @ x.double() for dy, x in pairs)
    err = (main_grad.double() - ref).norm() / ref.norm()
    assert err < 1e-5, err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp32-accumulating GEMM is CUDA-only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_gemm_accumulates_into_fp32_main_grad(dtype):
    """On CUDA the weight grad is accumulated by the GEMM into the fp32 main_grad: two
    micro-batches summed equal the float64 reference within bf16/fp16 operand rounding
    (relative error < 1e-2 on the operands as given, far under for fp32 accumulation)."""
    from megatron.core.tensor_parallel.layers import accumulate_weight_grad

    gen = torch.Generator(device="cuda").manual_seed(7)
    main_grad = torch.randn(96, 64, device="cuda", generator=gen)
    start = main_grad.clone()
    pairs = [(torch.randn(512, 96, device="cuda", generator=gen).to(dtype),
              torch.randn(512, 64, device="cuda", generator=gen).to(dtype)) for _ in range(2)]
    for dy, x in pairs:
        accumulate_weight_grad(main_grad, dy, x)
    ref = start.double() + sum(dy.double().t() @ x.double() for dy, x in pairs)
    assert main_grad.dtype == torch.float32
    err = (main_grad.double() - ref).norm() / ref.norm()
    assert err < 1e-5, err  # operands are exact in fp64; only fp32 accumulation rounds


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the in-place GEMM path is CUDA-only")
def test_cuda_gemm_writes_and_accumulates_into_an_fp16_main_grad():
    """fp16's 16-bit grad buffer is the GEMM's own output: stale, the first product is
    written over it; the second is added before rounding (beta 1). Within one fp16
    rounding (relative 1e-3) of float64, and the buffer tensor is the same object."""
    from megatron.core.distributed import stale_grads
    from megatron.core.tensor_parallel.layers import accumulate_weight_grad

    gen = torch.Generator(device="cuda").manual_seed(9)
    main_grad = torch.full((96, 64), 7.0, device="cuda", dtype=torch.float16)
    ptr = main_grad.data_ptr()
    pairs = [(torch.randn(512, 96, device="cuda", generator=gen).half(),
              torch.randn(512, 64, device="cuda", generator=gen).half()) for _ in range(2)]
    stale_grads.mark([main_grad])
    for dy, x in pairs:
        accumulate_weight_grad(main_grad, dy, x)
    assert not stale_grads.pending(main_grad) and main_grad.data_ptr() == ptr
    ref = sum(dy.double().t() @ x.double() for dy, x in pairs)
    err = (main_grad.double() - ref).norm() / ref.norm()
    assert err < 1e-3, err
