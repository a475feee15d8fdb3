"""--compile-scope: the whole layer stack compiled as one graph ("block") computes what the
eager layers and the per-layer graphs compute (CPU inductor, fp32: loss and every grad
within 1e-5), and the combination it cannot honour is refused with the fix named. The
layer scope compiles one graph that every layer shares, from a layer's input norm to the
next norm, and gives the eager results with and without a final norm and with post-LN
residuals (which keep the plain per-layer graphs); under tensor parallelism (gloo, tp 2,
with and without sequence parallelism) compiled training steps give the eager losses, and
the layer compiles as one graph whose collectives keep their overlap (torch >= 2.13)."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from megatron.arguments import ArgumentsError, parse_and_validate
from megatron.core.config import ModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.transformer import (
    ParallelAttention,
    TransformerBlock,
    compile_layers,
)
from megatron.core.tensor_parallel.mappings import TRACED_COLLECTIVES
from megatron.core.tensor_parallel.random import RNGStatesTracker, model_parallel_seed
from tests.dist_utils import run_distributed
from tests.gpt_helpers import cli_trainer, train_steps
from tests.test_attention_backend import BASE


def _loss_and_grads(compile_layers: bool, scope: str):
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, padded_vocab_size=128,
                      seq_length=16, max_position_embeddings=16, hidden_dropout=0.0,
                      attention_dropout=0.0, use_cpu_initialization=True,
                      compile_layers=compile_layers, compile_scope=scope)
    model = GPTModel(cfg, device="cpu")
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second call runs the compiled code without recompiling
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_block_scope_equals_layer_scope_and_eager():
    torch._dynamo.reset()
    loss_e, grads_e = _loss_and_grads(False, "layer")
    for scope in ("layer", "block"):
        loss, grads = _loss_and_grads(True, scope)
        assert torch.allclose(loss, loss_e, atol=1e-5, rtol=0), scope
        for name, g in grads_e.items():
            assert torch.allclose(grads[name], g, atol=1e-5, rtol=1e-4), (scope, name)


def _block_out_and_grads(compile_layers: bool, post_process: bool, post_ln: bool = False):
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, padded_vocab_size=128,
                      seq_length=16, max_position_embeddings=16, use_cpu_initialization=True,
                      hidden_dropout=0.0, attention_dropout=0.0, compile_layers=compile_layers,
                      compile_scope="layer", apply_residual_connection_post_layernorm=post_ln)
    block = TransformerBlock(cfg, num_layers=3, post_process=post_process, device="cpu")
    x = torch.randn(16, 2, 32, generator=torch.Generator().manual_seed(2), requires_grad=True)
    out = block(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    grads["input"] = x.grad.clone()
    return block, out.detach(), grads


@pytest.mark.parametrize("post_process,post_ln", [(True, False), (False, False), (True, True)])
def test_layer_scope_shares_one_graph_and_equals_eager(post_process, post_ln):
    torch._dynamo.reset()
    counters.clear()
    _, out_e, grads_e = _block_out_and_grads(False, post_process, post_ln)
    block, out, grads = _block_out_and_grads(True, post_process, post_ln)
    assert torch.allclose(out, out_e, atol=1e-5, rtol=0)
    for name, g in grads_e.items():
        assert torch.allclose(grads[name], g, atol=1e-5, rtol=1e-4), name
    fused = not post_ln
    assert (block._compiled_unit is not None) == fused
    # One graph for the three layers; a stage without a final norm compiles its last layer
    # (no norm after it) as a second one.
    expected = 1 if (post_process or not fused) else 2
    assert counters["stats"]["unique_graphs"] == expected


def _main_grads_after_two_micro_batches(compile_layers: bool):
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, padded_vocab_size=128,
                      seq_length=16, max_position_embeddings=16, use_cpu_initialization=True,
                      hidden_dropout=0.0, attention_dropout=0.0, compile_layers=compile_layers,
                      compile_scope="layer", gradient_accumulation_fusion=True)
    block = TransformerBlock(cfg, num_layers=3, device="cpu")
    for p in block.parameters():
        p.main_grad = torch.zeros_like(p)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x = torch.randn(16, 2, 32, generator=gen, requires_grad=True)
        block(x).square().sum().backward()
    assert all(p.grad is None for p in block.parameters())  # everything went to main_grad
    return block, {n: p.main_grad.clone() for n, p in block.named_parameters()}


def test_layer_scope_adds_norm_grads_into_main_grad_inside_the_graph():
    """With gradient-accumulation fusion the norm parameters' grads are added into
    main_grad by the compiled backward itself (no graph break, no autograd grad): two
    accumulated micro-batches give the eager main_grads (fp32, within 1e-5)."""
    torch._dynamo.reset()
    counters.clear()
    _, eager = _main_grads_after_two_micro_batches(False)
    block, compiled = _main_grads_after_two_micro_batches(True)
    assert block._compiled_unit is not None
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    for name, g in eager.items():
        assert g.abs().sum() > 0, name
        assert torch.allclose(compiled[name], g, atol=1e-5, rtol=1e-4), name


def test_selective_recompute_in_a_compiled_layer_backpropagates_the_forward_dropout_mask():
    """Selective recompute inside a compiled layer (the default on GPUs) with attention
    dropout: the backward differentiates the attention probabilities the forward used.
    Without biases the output is linear in the value rows W_v of the QKV weight (the
    queries and keys do not depend on them): out = dense(dropout(softmax(q k^T)) x W_v^T),
    so <out, G> = <W_v, W_v.grad> exactly when the backward's mask is the forward's. The
    tracker's fork, taken inside the checkpoint, made torch.compile's recompute draw
    another mask: the two sides differed by the size of the sum itself."""
    torch._dynamo.reset()
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, padded_vocab_size=128,
                      seq_length=16, max_position_embeddings=16, use_cpu_initialization=True,
                      hidden_dropout=0.0, attention_dropout=0.5, add_bias_linear=False,
                      recompute_granularity="selective")
    tracker = model_parallel_seed(1234, 0, RNGStatesTracker("cpu"))
    torch.manual_seed(0)
    attn = ParallelAttention(cfg, rng_tracker=tracker, device="cpu")
    run = compile_layers(attn)
    gen = torch.Generator().manual_seed(3)
    x, grad = torch.randn(16, 2, 32, generator=gen), torch.randn(16, 2, 32, generator=gen)
    outs = []
    for _ in range(2):  # the second call runs the compiled code without recompiling
        attn.zero_grad(set_to_none=True)
        out, _ = run(x)
        (out * grad).sum().backward()
        w = attn.query_key_value.weight  # rows per head: q (8), k (8), v (8)
        value_rows = torch.arange(w.shape[0]) % 24 >= 16
        torch.testing.assert_close((w * w.grad)[value_rows].sum(), (out.detach() * grad).sum(),
                                   rtol=1e-5, atol=1e-4)
        outs.append(out.detach())
    assert not torch.equal(*outs), "each call draws new masks"



@pytest.mark.parametrize("attention_dropout,compiled_checkpoints", [(0.5, 0), (0.0, 1)])
def test_compiled_selective_recompute_leaves_a_dropout_attention_core_alone(
        monkeypatch, attention_dropout, compiled_checkpoints):
    """Compiled, selective recompute does not checkpoint the attention core while attention
    dropout is on: torch.compile recomputed the fused CUDA kernels in backward with a
    fresh draw of their own dropout RNG (benchmarks/grad_audit.py on an H100, fp32:
    directional error ~1 for compiled selective recompute, 1e-4 without it). Without
    dropout it does, and eagerly always (torch's checkpoint replays the generators)."""
    from megatron.core.models.gpt import transformer

    calls = []
    checkpoint = transformer.recompute_checkpoint

    def counted(*args, **kwargs):
        calls.append(1)
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(transformer, "recompute_checkpoint", counted)
    torch._dynamo.reset()
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, padded_vocab_size=128,
                      seq_length=16, max_position_embeddings=16, use_cpu_initialization=True,
                      hidden_dropout=0.0, attention_dropout=attention_dropout,
                      recompute_granularity="selective")
    attn = ParallelAttention(cfg, rng_tracker=model_parallel_seed(1, 0, RNGStatesTracker("cpu")),
                             device="cpu")
    x = torch.randn(16, 2, 32)
    torch.compile(attn, backend="eager")(x)
    assert len(calls) == compiled_checkpoints
    attn(x)
    assert len(calls) == compiled_checkpoints + 1

def test_block_scope_compiles_one_graph_for_the_stack():
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_attention_heads=4, padded_vocab_size=128,
                      seq_length=16, max_position_embeddings=16, use_cpu_initialization=True,
                      compile_layers=True, compile_scope="block")
    block = GPTModel(cfg, device="cpu").language_model.encoder
    x = torch.randn(16, 2, 32, requires_grad=True)
    block(x).sum().backward()
    assert block._compiled is None and block._compiled_block is not None


def test_block_scope_refused_with_full_recompute():
    with pytest.raises(ArgumentsError, match="use --compile-scope layer"):
        parse_and_validate(BASE + ["--compile-scope", "block", "--recompute-granularity", "full",
                                   "--recompute-method", "uniform"], cuda_available=False)


@pytest.mark.parametrize("extra,scope", [
    ([], "layer"),
    (["--compile-scope", "block"], "block"),
    (["--overlap-grad-reduce"], "layer"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], "layer"),
    (["--compile-scope", "layer"], "layer"),
])
def test_auto_scope_resolution(extra, scope):
    cfg = parse_and_validate(BASE + extra, cuda_available=False)
    assert cfg.model.compile_scope == scope


TP_ARGV = ["--num-layers", "3", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--train-iters", "8", "--lr", "3e-3", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--seed", "5",
           "--hidden-dropout", "0", "--attention-dropout", "0",
           "--tensor-model-parallel-size", "2"]


def _tp_compiled_worker(rank, world, extra):
    from megatron.training import data_iterator

    losses = {}
    for name, flags in (("eager", ["--no-compile"]),
                        ("layer", ["--compile", "--compile-scope", "layer"])):
        torch._dynamo.reset()
        counters.clear()
        cfg, rt, tr = cli_trainer(TP_ARGV + extra + flags, world_size=world, rank=rank)
        assert tr.config.model.compile_layers == (name == "layer")
        losses[name] = train_steps(tr, data_iterator(cfg, rt, "train", 0), 3)
    return losses, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.parametrize("extra", [[], ["--sequence-parallel"]])
def test_layer_scope_under_tensor_parallelism_equals_eager(extra):
    """Compiled TP layers give the eager losses on both ranks, and the layer compiles as
    one graph (no break) with and without sequence parallelism: under compilation the
    linears' collectives are functional ones, waited for where the eager code waits
    (torch >= 2.13; before, such layers are not compiled)."""
    for losses, graphs, breaks in run_distributed(_tp_compiled_worker, 2, extra):
        assert torch.allclose(torch.tensor(losses["layer"]), torch.tensor(losses["eager"]),
                              rtol=0, atol=1e-5)
        # before torch 2.13 layers with TP collectives are left uncompiled
        assert (graphs, breaks) == ((1, 0) if TRACED_COLLECTIVES else (0, 0))


def _tp_linear_backward_code_worker(rank, world):
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    from megatron.core.tensor_parallel import ColumnParallelLinear

    torch._dynamo.reset()
    layer = ColumnParallelLinear(32, 64, gather_output=False, tp_group=dist.group.WORLD, bias=False,
                                 init_method=torch.nn.init.ones_, use_cpu_initialization=True,
                                 gradient_accumulation_fusion=True)
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    step = torch.compile(lambda x: layer(x)[0].square().sum())

    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    (grad,), codes = run_and_get_code(lambda: torch.autograd.grad(step(x), [x]))
    full = torch.ones(64, 32)  # both ranks' shards together, single-process reference
    ref = 2 * (x.detach() @ full.t()) @ full
    return torch.allclose(grad, ref, rtol=1e-5), codes


@pytest.mark.skipif(not TRACED_COLLECTIVES, reason="collectives are traced from torch 2.13")
def test_compiled_tp_linear_waits_for_its_all_reduce_after_the_weight_grad():
    """The overlap survives compilation: in the compiled backward of a column-parallel
    linear the input-grad all-reduce is issued before the weight-grad GEMM and waited for
    after it; the input grads equal the single-process ones."""
    results = run_distributed(_tp_linear_backward_code_worker, 2)
    backward = [c for c in results[0][1] if "accumulate_weight_grad" in c]
    assert backward, "no compiled backward with the weight-grad operator"
    code = backward[0]
    issue = code.index("_c10d_functional.all_reduce")
    wgrad = code.index("megatron.accumulate_weight_grad")
    wait = code.index("_c10d_functional.wait_tensor", issue)
    assert issue < wgrad < wait
    assert all(ok for ok, _ in results)  # input grads = the single-process ones


def _sp_linear_backward_code_worker(rank, world):
    import torch.distributed as dist
    from torch._inductor.utils import run_and_get_code

    from megatron.core.models.gpt.transformer import compile_layers
    from megatron.core.tensor_parallel import ColumnParallelLinear

    torch._dynamo.reset()
    layer = ColumnParallelLinear(32, 48, gather_output=False, tp_group=dist.group.WORLD, bias=False,
                                 init_method=torch.nn.init.ones_, use_cpu_initialization=True,
                                 gradient_accumulation_fusion=True, sequence_parallel=True)
    layer.weight.main_grad = torch.zeros_like(layer.weight)
    c_full = torch.randn(16, 2, 48, generator=torch.Generator().manual_seed(7))
    c = c_full[..., rank * 24:(rank + 1) * 24]  # this rank's output columns
    step = compile_layers(lambda x: (layer(x)[0] * c).sum(), "default", tp_collectives=True)
    x = torch.randn(8, 2, 32, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        loss = step(x)
    (grad,), codes = run_and_get_code(lambda: torch.autograd.grad(loss, [x]))
    return dict(x=x.detach(), grad=grad, main_grad=layer.weight.main_grad, c=c, saved=saved,
                codes=codes)


@pytest.mark.skipif(not TRACED_COLLECTIVES, reason="collectives are traced from torch 2.13")
def test_compiled_sp_linear_regathers_its_input_in_the_backward_overlapped():
    """Sequence parallelism under compilation keeps its memory saving and its overlap:
    the column-parallel linear saves only its sequence shard of the input (not the
    gathered whole sequence), re-gathers it in the backward started before the input-grad
    GEMM and waited for after it, and reduce-scatters the input grad while the weight-grad
    GEMM runs; input and weight grads equal the single-process ones."""
    results = run_distributed(_sp_linear_backward_code_worker, 2)
    for r in results:
        assert torch.Size([8, 2, 32]) in r["saved"]  # the shard, not the gathered input
        assert all(s.numel() != 16 * 2 * 32 for s in r["saved"]), r["saved"]
    code = next(c for c in results[0]["codes"] if "accumulate_weight_grad" in c)
    gather = code.index("megatron.all_gather_dim0_after")
    dgrad = code.index("extern_kernels.mm(", gather)
    gather_wait = code.index("_c10d_functional.wait_tensor", gather)
    scatter = code.index("_c10d_functional.reduce_scatter_tensor")
    wgrad = code.index("megatron.accumulate_weight_grad.default(")
    scatter_wait = code.index("_c10d_functional.wait_tensor", scatter)
    assert gather < dgrad < gather_wait < scatter < wgrad < scatter_wait

    x_full = torch.cat([r["x"] for r in results])  # single-process reference
    c_full = torch.cat([r["c"] for r in results], dim=-1)
    grad_full = c_full @ torch.ones(48, 32)
    for rank, r in enumerate(results):
        assert torch.allclose(r["grad"], grad_full[rank * 8:(rank + 1) * 8], rtol=1e-5, atol=1e-5)
        ref = r["c"].reshape(-1, 24).t() @ x_full.reshape(-1, 32)
        assert torch.allclose(r["main_grad"], ref, rtol=1e-5, atol=1e-4)
