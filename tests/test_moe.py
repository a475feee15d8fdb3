"""--num-experts: Megatron-LM 23.05's top-1 switch MLP (megatron/core/models/gpt/transformer.py).

1. Units: the switch MLP equals a per-token reference written here (fp32, within 1e-6,
   output, separate bias and every gradient, the router's included); an expert that gets
   no tokens gets exactly zero gradient and training still steps, with grad buffers,
   gradient-accumulation fusion, the overlapped bucketed all-reduce and the distributed
   optimizer; compiled layers (CPU inductor) leave the switch MLP eager and give the eager
   results.
2. Parity: TP2 x PP2 x DP2 with the distributed optimizer and the overlapped all-reduce,
   and TP2 with full recompute, reproduce the single-process losses and gradients from
   the same weights. Tolerance as the other parity tests: fp32 in another reduction order
   -> rtol 1e-5 on losses, max abs diff <= 1e-5 * (1 + max|g|) on gradients.
3. Checkpoints and tools: saved at TP2, resumed at TP1 (resharded on load) with the same
   losses (rtol 1e-5); pretrain_gpt.py trains (loss falls), resumes bit-identically;
   to-megatron writes Megatron's key names; to-hf refuses; --dry-run counts E experts;
   --sequence-parallel is refused.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import ModelConfig
from megatron.core.models.gpt.transformer import SwitchMLP
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.initialize import Runtime, set_random_seed
from megatron.training import build_trainer, data_iterator, train_step
from tests import forked_script
from tests.dist_utils import cpu_env, run_distributed
from tests.forked_script import PRETRAIN
from tests.gpt_helpers import full_named_grads, full_tensor
from tests.test_pipeline_parallel import (
    LAYERS,
    _cfg,
    _full_name,
    _load_reference,
    _reference_weights,
)

ROOT = Path(__file__).resolve().parents[1]
EXPERTS = 4


# ------------------------------------------------------------------------------ 1. units
def _switch(activation="gelu", bias=True, experts=3) -> SwitchMLP:
    torch.manual_seed(0)
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, padded_vocab_size=32,
                      seq_length=8, max_position_embeddings=8, ffn_hidden_size=24,
                      activation=activation, add_bias_linear=bias, num_experts=experts,
                      init_method_std=0.1, use_cpu_initialization=True)
    mlp = SwitchMLP(cfg, device="cpu")
    with torch.no_grad():
        mlp.router.weight.mul_(8)  # spread the tokens over every expert
    return mlp


def _expert_ref(expert, x_h: torch.Tensor):
    """(fc2 output without its bias, fc2 bias or None) of one expert for one token."""
    fc1, fc2 = expert.dense_h_to_4h, expert.dense_4h_to_h
    h = F.linear(x_h, fc1.weight, fc1.bias)
    if expert.swiglu:
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h)
    return F.linear(h, fc2.weight), fc2.bias


def _reference(mlp: SwitchMLP, x_sbh: torch.Tensor):
    """Token by token: p, e = max(softmax(router(x))); p * expert_e(x), p * bias_e."""
    outs, biases, chosen = [], [], []
    for x_h in x_sbh.reshape(-1, x_sbh.shape[-1]):
        probs = torch.softmax(F.linear(x_h, mlp.router.weight, mlp.router.bias), dim=-1)
        p, e = probs.max(dim=-1)
        out, bias = _expert_ref(mlp.experts[int(e)], x_h)
        outs.append(p * out)
        biases.append(None if bias is None else p * bias)
        chosen.append(int(e))
    out = torch.stack(outs).view_as(x_sbh)
    bias = None if biases[0] is None else torch.stack(biases).view_as(x_sbh)
    return out, bias, chosen


@pytest.mark.parametrize("activation,bias", [("gelu", True), ("swiglu", False)])
def test_switch_mlp_equals_per_token_reference(activation, bias):
    mlp = _switch(activation, bias)
    x = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weight = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(2))
    out, out_bias = mlp(x)
    ref, ref_bias, chosen = _reference(mlp, x)
    assert set(chosen) == {0, 1, 2}, chosen  # every expert has tokens
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    if bias:
        torch.testing.assert_close(out_bias, ref_bias, rtol=0, atol=1e-6)
    else:
        assert out_bias is None and ref_bias is None

    def grads(o, b):
        loss = ((o if b is None else o + b) * weight).sum()
        return torch.autograd.grad(loss, [x, *mlp.parameters()])

    got, want = grads(out, out_bias), grads(ref, ref_bias)
    names = ["input"] + [n for n, _ in mlp.named_parameters()]
    for name, g, w in zip(names, got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6, msg=name)
    assert got[1].abs().sum() > 0 and got[2].abs().sum() > 0  # router weight and bias


def _step_worker(rank, world, fusion, parallel, split=False):
    """A few steps with every token sent to expert 0 (router bias; to expert `rank` with
    `split`): the other experts get no tokens. Returns the losses, per expert the largest
    |main_grad| of the last step, the parameters that moved and the experts' weights."""
    torch.manual_seed(0)
    cfg = _cfg(world, 1, 1, False, model_kw=dict(num_experts=EXPERTS,
                                                 gradient_accumulation_fusion=fusion),
               **parallel)
    ps = ParallelState.build(world, rank)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    module = tr.model.unwrapped()[0]
    with torch.no_grad():
        for layer in module.language_model.encoder.layers:
            bias = torch.full((EXPERTS,), -50.0)
            bias[rank if split else 0] = 50.0
            layer.mlp.router.bias.copy_(bias)
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    data = data_iterator(cfg, rt, "train", 0)
    losses = []
    for _ in range(3):
        loss, ok, _, _ = train_step(tr, data)
        assert ok
        losses.append(float(loss))
    grads = {}
    for name, p in module.named_parameters():
        m = re.search(r"mlp\.experts\.(\d+)\.", name)
        if m:
            e = int(m.group(1))
            grads[e] = max(grads.get(e, 0.0), p.main_grad.abs().max().item())
    moved = {n for n, p in module.named_parameters() if not torch.equal(p, before[n])}
    experts = {n: p.detach().clone() for n, p in module.named_parameters() if "experts" in n}
    return {"losses": losses, "grads": grads, "moved": moved, "experts": experts}


@pytest.mark.parametrize("fusion", [False, True])
def test_expert_without_tokens_gets_zero_grad_and_training_steps(fusion):
    out = _step_worker(0, 1, fusion, {})
    assert out["grads"][0] > 0
    assert all(out["grads"][e] == 0.0 for e in range(1, EXPERTS)), out["grads"]
    assert any("experts.0." in n for n in out["moved"])
    assert all(torch.isfinite(torch.tensor(out["losses"])))


def test_idle_experts_with_overlapped_buckets_and_distributed_optimizer():
    parallel = dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                    ddp_bucket_size=2000)
    ref = _step_worker(0, 1, True, parallel)
    for rank, got in enumerate(run_distributed(_step_worker, 2, True, parallel)):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=0, msg=f"rank {rank}")
        assert all(got["grads"][e] == 0.0 for e in range(1, EXPERTS)), got["grads"]


def test_data_parallel_ranks_with_different_idle_experts():
    """Rank 0 routes every token to expert 0, rank 1 to expert 1: each rank's grad hooks
    still fire for every expert, so both launch the same buckets in the same order; the
    reduced expert weights stay equal on both ranks, the idle experts 2, 3 get zero grads.
    (The plain optimizer: the distributed one would hand both ranks rank 0's router after
    the first step, the parameter owner's copy.)"""
    parallel = dict(overlap_grad_reduce=True, ddp_bucket_size=2000)
    first, second = run_distributed(_step_worker, 2, True, parallel, True)
    for got in (first, second):
        assert got["grads"][0] > 0 and got["grads"][1] > 0
        assert got["grads"][2] == got["grads"][3] == 0.0, got["grads"]
    for name, w in first["experts"].items():
        assert torch.equal(w, second["experts"][name]), name


def _loss_and_grads(compile_layers: bool, scope: str = "layer"):
    torch.manual_seed(0)
    cfg = _cfg(1, 1, 1, False, model_kw=dict(num_experts=EXPERTS, compile_layers=compile_layers,
                                             compile_scope=scope)).model
    from megatron.core.models.gpt.gpt_model import GPTModel

    model = GPTModel(cfg, device="cpu")
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_compiled_layers_leave_the_switch_mlp_eager_with_the_same_results():
    torch._dynamo.reset()
    loss_e, grads_e = _loss_and_grads(False)
    for scope in ("layer", "block"):
        loss, grads = _loss_and_grads(True, scope)
        assert torch.allclose(loss, loss_e, atol=1e-5, rtol=0), scope
        for name, g in grads_e.items():
            assert torch.allclose(grads[name], g, atol=1e-5, rtol=1e-4), (scope, name)


DENSE_THEN_SWITCH = """
import sys
import torch
from megatron.core.config import ModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.transformer import SwitchMLP
kw = dict(num_layers=1, hidden_size=16, num_attention_heads=2, padded_vocab_size=32,
          seq_length=8, max_position_embeddings=8)
GPTModel(ModelConfig(**kw), device="cpu")(torch.zeros(1, 8, dtype=torch.long))
print("dense:", "torch._dynamo" in sys.modules)
GPTModel(ModelConfig(num_experts=2, **kw), device="cpu")
print("switch:", getattr(SwitchMLP.forward, "_torchdynamo_disable", False))
"""


def test_switch_mlp_is_kept_eager_without_slowing_a_dense_model_start_up():
    """SwitchMLP.forward is excluded from torch.compile once a switch MLP is built, not when
    the module is imported: torch.compiler.disable imports torch._dynamo, about a second of
    the start-up of every process that builds a model (generation, conversion), dense ones
    included."""
    out = subprocess.run([sys.executable, "-c", DENSE_THEN_SWITCH], capture_output=True,
                         text=True, timeout=120, cwd=ROOT, env=cpu_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["dense:", "False", "switch:", "True"], out.stdout


# ----------------------------------------------------------------------------- 2. parity
def _parity_worker(rank, world, tp, pp, model_kw, parallel, iters=3):
    """Train `iters` steps from the single-process model's initial weights."""
    torch.manual_seed(0)
    model_kw = dict(num_experts=EXPERTS, **model_kw)
    full = _reference_weights(model_kw)
    cfg = _cfg(world, tp, pp, False, model_kw=model_kw, **parallel)
    ps = ParallelState.build(world, rank, tp_size=tp, pp_size=pp)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    offset = ps.pp_rank * LAYERS // pp
    _load_reference(tr, ps, full, [offset])
    data = data_iterator(cfg, rt, "train", 0)
    losses = []
    for _ in range(iters):
        loss, ok, _, _ = train_step(tr, data)
        assert ok
        losses.append(float(loss))
    module = tr.model.unwrapped()[0]
    grads = {_full_name(n, offset): g
             for n, g in full_named_grads(module, ps.tp_group).items()}
    routers = {n: p.detach().clone() for n, p in module.named_parameters() if "router" in n}
    params = {_full_name(n, offset): full_tensor(p, p, ps.tp_group)
              for n, p in module.named_parameters()}
    return {"losses": losses, "grads": grads, "routers": routers, "params": params}


def _check_parity(ref, results, what, grads=True):
    covered = set()
    for rank, got in enumerate(results):
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                                   rtol=1e-5, atol=0, msg=f"{what} rank {rank}: losses")
        for name, g in got["grads"].items() if grads else ():
            r = ref["grads"][name]
            diff = (g - r).abs().max().item()
            assert diff <= 1e-5 * (1 + r.abs().max().item()), f"{what}: {name} off by {diff}"
        for name, w in got["params"].items():  # the weights after the last step
            r = ref["params"][name]
            diff = (w - r).abs().max().item()
            assert diff <= 1e-5 * (1 + r.abs().max().item()), f"{what}: {name} off by {diff}"
        covered |= set(got["params"])
    assert covered == set(ref["params"]), set(ref["params"]) - covered


def test_tp2_pp2_dp2_distributed_optimizer_overlap_matches_single_process():
    parallel = dict(use_distributed_optimizer=True, overlap_grad_reduce=True,
                    ddp_bucket_size=20000)
    ref = _parity_worker(0, 1, 1, 1, {}, {})
    results = run_distributed(_parity_worker, 8, 2, 2, {}, parallel)
    # main_grad under the distributed optimizer is reduced only on the owned shard:
    # compare the losses and the weights after the last step
    _check_parity(ref, results, "tp2 pp2 dp2 distopt overlap", grads=False)
    for tp_pair in ((0, 1), (2, 3), (4, 5), (6, 7)):  # ranks of one TP group: same router
        a, b = (results[r]["routers"] for r in tp_pair)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("model_kw,parallel", [
    (dict(recompute_granularity="selective"), {}),
    (dict(recompute_granularity="full", recompute_method="uniform",
          distribute_saved_activations=True, gradient_accumulation_fusion=True,
          activation="swiglu", ffn_hidden_size=48, add_bias_linear=False), {}),
], ids=["tp2-selective-recompute", "tp2-full-recompute-distributed-swiglu-fusion"])
def test_tp2_matches_single_process(model_kw, parallel):
    ref = _parity_worker(0, 1, 1, 1, model_kw, {})
    _check_parity(ref, run_distributed(_parity_worker, 2, 2, 1, model_kw, parallel),
                  f"tp2 {model_kw}")


# ----------------------------------------------------------------- 3. checkpoints, tools
MOE_FLAGS = f"--num-experts {EXPERTS}"


def test_saved_at_tp2_resumes_resharded_with_the_same_losses(tmp_path):
    """Experts split like the dense MLP (SwiGLU's interleaved fc1 included), the router
    kept whole: TP2 -> TP1 and TP2 -> PP2 with the distributed optimizer on load, and
    TP2 -> TP1 offline (tools/checkpoint_convert.py reshard)."""
    from tests.test_reshard import _load_and_continue, _run, _save_and_continue
    from tools import checkpoint_convert

    src = f"{MOE_FLAGS} --swiglu --tensor-model-parallel-size 2"
    root = str(tmp_path / "tp2")
    expected = _run(_save_and_continue, 2, src, root)
    for world, dst in ((1, f"{MOE_FLAGS} --swiglu"),
                       (2, f"{MOE_FLAGS} --swiglu --pipeline-model-parallel-size 2 "
                           "--use-distributed-optimizer")):
        losses, converted = _run(_load_and_continue, world, dst, root)
        assert converted is not None and "resharded" in converted
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5,
                                   atol=0, msg=dst)
    out = str(tmp_path / "offline-tp1")  # tools/checkpoint_convert.py reshard, then a plain load
    assert checkpoint_convert.main(["reshard", "--load", root, "--save", out,
                                    "--target-tensor-model-parallel-size", "1",
                                    "--target-pipeline-model-parallel-size", "1"]) == 0
    losses, converted = _run(_load_and_continue, 1, f"{MOE_FLAGS} --swiglu", out)
    assert converted is None
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)


def _validate(extra: str, world: int = 1):
    from megatron.arguments import parse_and_validate

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --lr 1e-3 --train-iters 1 "
            "--mock-data --tokenizer-type NullTokenizer --vocab-size 127 "
            "--make-vocab-size-divisible-by 64")
    return parse_and_validate(f"{base} {extra}".split(), world_size=world, env={},
                              cuda_available=False)


def test_dry_run_counts_every_expert():
    from megatron.arguments import dry_run_report
    from megatron.core.models.gpt.gpt_model import GPTModel

    def total(extra, world=1):
        cfg = _validate(extra, world)
        report = dry_run_report(cfg, world)
        count = int(re.search(r"parameters: ([\d,]+) total", report).group(1).replace(",", ""))
        return cfg, report, count

    _, _, dense = total("")
    cfg, report, moe = total(MOE_FLAGS)
    built = sum(p.numel() for p in GPTModel(cfg.model, device="meta").parameters())
    assert moe == built > dense
    h, f = 32, 128  # per layer: 3 more MLPs (weights and biases) and the router
    assert moe - dense == 2 * (3 * (2 * h * f + f + h) + EXPERTS * (h + 1))
    assert f"switch MLP of {EXPERTS} experts (top-1)" in report
    _, _, moe_tp2 = total(f"{MOE_FLAGS} --tensor-model-parallel-size 2", 2)
    assert moe_tp2 == moe


def test_sequence_parallel_with_experts_is_refused():
    from megatron.arguments import ArgumentsError

    with pytest.raises(ArgumentsError, match="--sequence-parallel cannot be used with "
                                             f"--num-experts {EXPERTS}.*drop --sequence-parallel"):
        _validate(f"{MOE_FLAGS} --tensor-model-parallel-size 2 --sequence-parallel", 2)
    with pytest.raises(ArgumentsError, match="--num-experts 0 must be >= 1"):
        _validate("--num-experts 0")
    with pytest.raises(ArgumentsError, match="expert model parallelism is not supported"):
        _validate(f"{MOE_FLAGS} --expert-model-parallel-size 2", 2)


def test_layout_parity_leaves_sequence_parallelism_out_with_experts():
    from tools import layout_parity as lp

    lay = lp.parse_layout("tp2")
    assert "--sequence-parallel" in lp.layout_flags(lay, ["--num-layers", "2"])
    assert "--sequence-parallel" not in lp.layout_flags(lay, ["--num-experts", "4"])


def test_flops_count_one_expert_and_the_router():
    from megatron.logging_utils import flops_per_token

    dense = flops_per_token(4, 64, 128, 1024)
    assert flops_per_token(4, 64, 128, 1024, EXPERTS) == pytest.approx(
        dense + 6 * 4 * 64 * EXPERTS)


def test_to_hf_refuses_a_switch_mlp_checkpoint(tmp_path):
    from megatron import hf_convert, hf_interop

    with pytest.raises(ValueError, match=f"--num-experts {EXPERTS}.*no Hugging Face GPT-2 or "
                                         "Llama class has that MLP"):
        hf_convert.refuse_switch_mlp({"num_experts": EXPERTS})
    hf_convert.refuse_switch_mlp({"num_experts": None})
    problems = hf_interop.family_problems(_validate(MOE_FLAGS).model, "gpt2")
    assert any("top-1 switch MLP" in p for p in problems)


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--lr", "1e-2", "--lr-warmup-iters", "1",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "127",
         "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--num-workers", "0", "--num-experts", str(EXPERTS)]


def _pretrain(*args) -> dict:
    """pretrain_gpt.py as one process, forked from this one (tests/forked_script.py: its
    imports come free); {iteration: printed lm loss}."""
    proc = forked_script.run([sys.executable, PRETRAIN, *MODEL, *map(str, args)], cpu_env(),
                             timeout=600, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    found = re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", out)
    return {int(i): v for i, v in found}


@pytest.mark.slow
def test_pretrain_gpt_trains_resumes_converts_and_generates(tmp_path, capsys):
    from megatron.checkpoint_files import megatron_globals
    from tests.test_end_to_end import rewind_to
    from tools import checkpoint_convert, generate

    ckpt, mega = tmp_path / "ckpt", tmp_path / "megatron"
    ref = _pretrain("--train-iters", 8, "--save", ckpt, "--save-interval", 4)
    assert float(ref[8]) < float(ref[1]) - 0.3, ref
    assert checkpoint_convert.main(["to-megatron", "--load", str(ckpt), "--save", str(mega),
                                    "--iteration", "4"]) == 0
    rewind_to(ckpt, 4)
    assert _pretrain("--train-iters", 8, "--load", ckpt) == {i: ref[i] for i in range(5, 9)}

    path = mega / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt"
    with torch.serialization.safe_globals(megatron_globals()):
        encoder = torch.load(path, weights_only=True)["model"]["language_model"]["encoder"]
    names = {"layers.1.mlp.router.weight", "layers.1.mlp.router.bias"} | {
        f"layers.1.mlp.experts.{e}.{fc}.{kind}" for e in range(EXPERTS)
        for fc in ("dense_h_to_4h", "dense_4h_to_h") for kind in ("weight", "bias")}
    assert names <= set(encoder), sorted(encoder)
    assert not any(".mlp.dense_h_to_4h" in k and "experts" not in k for k in encoder)
    # Megatron-LM's form loads here too and continues exactly
    assert _pretrain("--train-iters", 8, "--load", mega) == {i: ref[i] for i in range(5, 9)}

    with pytest.raises(SystemExit, match="no Hugging Face GPT-2 or Llama class has that MLP"):
        checkpoint_convert.main(["to-hf", "--load", str(ckpt), "--output", str(tmp_path / "hf")])
    assert not (tmp_path / "hf" / "config.json").exists()
    capsys.readouterr()
    assert generate.main(["--load", str(ckpt), "--prompt-ids", "5,6,7", "--max-new-tokens", "4",
                          "--greedy", "--no-stop-at-eod", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["generated_ids"]) == 4
