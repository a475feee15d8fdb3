"""Mixed precision and data parallelism at scale (issue 5).

* fp16 from the command line: the dynamic loss scale starts at 2^32, the first iterations
  overflow and are skipped ("number of skipped iterations" counts them per log interval,
  as Megatron's line does; "loss scale" and the tensorboard `loss-scale` scalar fall),
  then training proceeds. For a scripted overflow pattern each line's loss scale and
  learning rate are Megatron's (a reference written from its rules), also across a resume.
* The precision flags change what they say: --fp16-lm-cross-entropy (loss computed in
  fp16), --fp32-residual-connection (fp32 residual stream, bf16 layers),
  --embedding-weights-in-fp32 (fp32 table, tied output cast to bf16); the two attention
  flags are documented no-ops because scaled_dot_product_attention already computes the
  softmax in fp32 (checked here on CPU).
* The initialisation and activation flags.
* Norms under TP x PP and TP x DP with the distributed optimizer equal the single-process
  values (replicated parameters once, the tied embedding once); the zero count too.
* DP=4 with and without --overlap-grad-reduce, and --data-parallel-random-init, against
  the single-process run (fp32: rtol 1e-5 on losses, 1e-5 * (1 + max|g|) on grads).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.models.gpt.gpt_model import GPTModel, half_precision_cross_entropy
from megatron.core.models.gpt.transformer import LayerNorm1P, ParallelMLP, init_methods
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel import shard_of_full_weight, vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.initialize import Runtime, set_random_seed
from megatron.logging_utils import read_scalars
from megatron.training import build_trainer, data_iterator, train_step
from tests.dist_utils import run_distributed
from tests.gpt_helpers import full_named_grads, tiny_config

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "100", "--num-workers", "0", "--eval-iters", "0"]


def _config(world=1, tp=1, pp=1, dtype=torch.float32, parallel=None, optim=None, **model_kw):
    cfg = tiny_config(world_size=world, tp=tp, pp=pp, params_dtype=dtype, **model_kw)
    cfg.data.num_workers = 0
    half = dtype != torch.float32
    cfg.optimizer = dataclasses.replace(cfg.optimizer, fp16=dtype == torch.float16,
                                        bf16=dtype == torch.bfloat16, **(optim or {}))
    cfg.parallel = dataclasses.replace(cfg.parallel, accumulate_allreduce_grads_in_fp32=half,
                                       **(parallel or {}))
    return cfg


def _trainer(cfg, rank=0, dp_random_init=False):
    p = cfg.parallel
    ps = ParallelState.build(p.world_size, rank, tp_size=p.tp_size, pp_size=p.pp_size)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt, dp_random_init)
    return build_trainer(cfg, rt), data_iterator(cfg, rt, "train", 0)


# ------------------------------------------------------------------------- fp16 from the CLI
def _lines(out: str):
    return [line for line in out.splitlines() if line.startswith(" iteration ")]


def _field(line: str, name: str) -> float:
    return float(line.split(f" {name}: ")[1].split(" |")[0])


def test_fp16_cli_skips_overflowing_iterations_and_backs_off(tmp_path, capsys):
    import pretrain_gpt

    tb = tmp_path / "tb"
    assert pretrain_gpt.main(TINY + ["--fp16", "--train-iters", "24", "--log-interval", "4",
                                     "--tensorboard-dir", str(tb)]) == 0
    lines = _lines(capsys.readouterr().out)
    assert len(lines) == 6
    skipped = [_field(line, "number of skipped iterations") for line in lines]
    scales = [_field(line, "loss scale") for line in lines]
    # 2^32 overflows fp16 activations' grads: early steps are skipped and the scale halves
    # after each overflow (hysteresis 2: the first one is tolerated). Each line counts the
    # skips of its own interval, as Megatron's does: all 4 steps of the first one.
    assert skipped[0] == 4 and skipped[1] >= 1, skipped
    assert scales[0] < 2.0**32 and scales[1] < scales[0], scales
    assert all(b <= a for a, b in zip(scales, scales[1:])), scales
    # ... until it fits: the last steps update the weights (a loss is averaged again).
    assert skipped[-1] == 0 and sum(skipped) < 24, skipped
    assert "lm loss" in lines[-1] and "grad norm" in lines[-1]
    scalars = read_scalars(str(tb))
    tb_scales = [v for _, v in sorted(scalars["loss-scale"])]
    assert len(tb_scales) == 24 and tb_scales[0] == 2.0**32
    assert tb_scales[-1] == scales[-1] and min(tb_scales) >= 1.0
    assert all(b <= a for a, b in zip(tb_scales, tb_scales[1:]))


def _megatron_scales_and_lrs(skips, init, window, hysteresis, lr, warmup, iters):
    """Megatron-LM 23.05's loss scale and learning rate after each iteration, given which
    iterations skipped (written from its rules, not from our code): an overflow resets
    the growth count and spends one hysteresis; at <= 0 left the scale halves (floor 1);
    `window` clean steps in a row double it and restore the hysteresis. Only an
    updated step advances the linear schedule (warmup then decay to 0 at `iters`)."""
    scale, growth, hyst, steps, out = init, 0, hysteresis, 0, []
    for skipped in skips:
        if skipped:
            growth, hyst = 0, hyst - 1
            scale = max(scale * 0.5, 1.0) if hyst <= 0 else scale
        else:
            growth, steps = growth + 1, steps + 1
            if growth == window:
                growth, hyst, scale = 0, hysteresis, scale * 2.0
        if steps <= warmup:
            rate = lr * steps / warmup
        else:
            rate = lr * (1.0 - (steps - warmup) / (iters - warmup))
        out.append((scale, f"{rate:.3E}"))
    return out


OVERFLOWS = [1, 0, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0]  # the iterations given an inf grad


def _script_overflows(monkeypatch, calls):
    """An inf in one main grad at each iteration `OVERFLOWS` marks: the optimizer's own
    check must find it (fp16 at a small loss scale overflows nothing by itself)."""
    from megatron.core.optimizer import MixedPrecisionOptimizer

    copy = MixedPrecisionOptimizer._copy_model_grads_to_main_grads

    def copy_and_poison(self):
        aliased = copy(self)
        calls["n"] += 1
        if OVERFLOWS[calls["n"] - 1]:
            next(p for p in self.get_parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
        return aliased

    monkeypatch.setattr(MixedPrecisionOptimizer, "_copy_model_grads_to_main_grads",
                        copy_and_poison)


def test_fp16_cli_loss_scale_and_lr_sequence_follow_megatron(tmp_path, capsys, monkeypatch):
    """Each iteration's printed loss scale and learning rate equal Megatron's for a
    scripted overflow pattern (hysteresis 2, window 3: a tolerated overflow, a clean step
    that does not restore the hysteresis, a back-off, growths). A skipped iteration
    consumes its samples but leaves the lr and the schedule where they were, and prints
    no loss and no grad norm. A resume from a checkpoint saved mid-way prints the same."""
    import pretrain_gpt

    calls = {"n": 0}
    _script_overflows(monkeypatch, calls)
    args = TINY + ["--fp16", "--train-iters", "16", "--log-interval", "1",
                   "--initial-loss-scale", "256", "--loss-scale-window", "3",
                   "--hysteresis", "2", "--lr-warmup-iters", "2", "--lr-decay-style", "linear"]
    assert pretrain_gpt.main(args) == 0
    lines = _lines(capsys.readouterr().out)
    skips = [int(_field(line, "number of skipped iterations")) for line in lines]
    assert skips == OVERFLOWS
    expected = _megatron_scales_and_lrs(skips, 256.0, 3, 2, 1e-3, 2, 16)
    for i, (line, skipped, (scale, lr)) in enumerate(zip(lines, skips, expected), 1):
        assert _field(line, "loss scale") == scale, (i, line)
        assert f"learning rate: {lr} |" in line, (i, lr, line)
        assert _field(line, "consumed samples") == 4 * i, line
        assert ("lm loss" in line) == ("grad norm" in line) == (not skipped), line
    ck, calls["n"] = str(tmp_path / "ck"), 0
    assert pretrain_gpt.main(args + ["--save", ck, "--save-interval", "7",
                                     "--exit-interval", "7"]) == 0
    calls["n"] = 7
    assert pretrain_gpt.main(args + ["--load", ck]) == 0
    both = _lines(capsys.readouterr().out)

    def untimed(line):
        return line.split(" elapsed")[0] + line.split("learning rate")[1].split(" tokens/s")[0]

    assert [untimed(line) for line in both] == [untimed(line) for line in lines]


# ------------------------------------------------------------------------- precision flags
def test_sdpa_softmax_is_fp32_for_half_inputs():
    """--attention-softmax-in-fp32 is a no-op: for fp16/bf16 inputs SDPA's error is that of
    an fp32 softmax, ten times below a softmax computed in the input dtype."""
    torch.manual_seed(0)
    b, n, s, d = 1, 4, 256, 64
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (torch.randn(b, n, s, d) * (3 if i < 2 else 1) for i in range(3))
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)

        def naive(acc):
            scores = (q.to(acc) @ k.to(acc).transpose(-1, -2) / math.sqrt(d)).masked_fill(
                ~mask, float("-inf"))
            return (torch.softmax(scores, -1).to(dtype).to(acc) @ v.to(acc)).to(dtype)

        err_low = (naive(dtype).double() - ref).abs().max().item()
        err_fp32 = (naive(torch.float32).double() - ref).abs().max().item()
        for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION):
            with sdpa_kernel(backend):
                for kw in ({"is_causal": True}, {"attn_mask": mask}):
                    out = F.scaled_dot_product_attention(q, k, v, **kw)
                    err = (out.double() - ref).abs().max().item()
                    assert err <= 1.5 * err_fp32 and err < 0.2 * err_low, (dtype, backend, err)


def test_half_precision_cross_entropy_matches_fp32_and_stays_fp16():
    torch.manual_seed(0)
    logits = (torch.randn(8, 2, 96) * 4).half().requires_grad_()
    labels = torch.randint(0, 96, (8, 2))
    loss = half_precision_cross_entropy(logits, labels)
    ref_logits = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten(), reduction="none")
    assert loss.dtype == torch.float16
    torch.testing.assert_close(loss.float(), ref.view(8, 2), rtol=2e-3, atol=2e-3)
    loss.float().sum().backward()
    ref.sum().backward()
    assert logits.grad.dtype == torch.float16
    torch.testing.assert_close(logits.grad.float(), ref_logits.grad, rtol=0, atol=2e-3)


def test_fp16_lm_cross_entropy_model_returns_fp16_losses():
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (2, 16))
    losses = {}
    for flag in (False, True):
        cfg = _config(dtype=torch.float16, fp16_lm_cross_entropy=flag)
        torch.manual_seed(1)
        losses[flag] = GPTModel(cfg.model)(tokens, labels=tokens)
    assert losses[False].dtype == torch.float32 and losses[True].dtype == torch.float16
    torch.testing.assert_close(losses[True].float(), losses[False], rtol=0, atol=1e-2)


def _dtypes_seen(module, store, key):
    module.register_forward_hook(
        lambda m, i, o: store.setdefault(key, (o[0] if isinstance(o, tuple) else o).dtype)
        and None)


def _train_bf16(iters=6, lr=1e-2, **model_kw):
    cfg = _config(dtype=torch.bfloat16, **model_kw)
    cfg.optimizer = dataclasses.replace(cfg.optimizer, lr=lr)
    tr, data = _trainer(cfg)
    seen = {}
    layer = tr.model.module.language_model.encoder.layers[0]
    _dtypes_seen(layer, seen, "layer output (residual)")
    _dtypes_seen(layer.self_attention, seen, "attention")
    _dtypes_seen(layer.mlp, seen, "mlp")
    _dtypes_seen(layer.input_layernorm, seen, "layernorm")
    losses = []
    for _ in range(iters):
        loss, ok, _, _ = train_step(tr, data)
        assert ok
        losses.append(float(loss))
    return tr, seen, losses


def test_fp32_residual_connection_keeps_residual_fp32_and_layers_bf16():
    for norm in ("LayerNorm", "RMSNorm"):
        _, seen, losses = _train_bf16(fp32_residual_connection=True, normalization=norm)
        assert seen == {"layer output (residual)": torch.float32, "attention": torch.bfloat16,
                        "mlp": torch.bfloat16, "layernorm": torch.bfloat16}, (norm, seen)
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    _, seen, _ = _train_bf16(iters=1)
    assert seen["layer output (residual)"] == torch.bfloat16  # without the flag


def test_embedding_weights_in_fp32_with_tied_bf16_output():
    tr, seen, losses = _train_bf16(embedding_weights_in_fp32=True)
    model = tr.model.module
    word = model.language_model.embedding.word_embeddings.weight
    assert word.dtype == torch.float32
    assert model.language_model.embedding.position_embeddings.weight.dtype == torch.bfloat16
    assert model.language_model.encoder.layers[0].mlp.dense_h_to_4h.weight.dtype == torch.bfloat16
    assert seen["layer output (residual)"] == torch.bfloat16
    assert losses[-1] < losses[0], losses
    assert word.main_grad.abs().sum() > 0  # the output layer's grad reached the fp32 table
    # A last pipeline stage keeps its copy of the tied table in the same dtype.
    cfg = _config(dtype=torch.bfloat16, embedding_weights_in_fp32=True)
    last = GPTModel(cfg.model, pre_process=False, post_process=True)
    assert last.word_embeddings_for_head.weight.dtype == torch.float32


# ------------------------------------------------------------------ init and activation flags
def test_xavier_uniform_and_no_initialization():
    cfg = _config(init_method_xavier_uniform=True)
    torch.manual_seed(0)
    model = GPTModel(cfg.model)
    w = model.language_model.encoder.layers[0].mlp.dense_h_to_4h.weight  # [128, 32]
    bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert abs(w.std().item() - bound / math.sqrt(3)) < 0.1 * bound
    # --no-initialization draws nothing from the RNG: the weights are left for a checkpoint.
    cfg = _config(perform_initialization=False)
    torch.manual_seed(0)
    GPTModel(cfg.model)
    after = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(4))
    init, output_init = init_methods(cfg.model)
    t = torch.full((2, 2), 7.0)
    assert torch.equal(init(t), torch.full((2, 2), 7.0)) and output_init is init


def test_activation_flags_and_layernorm_1p():
    x = torch.randn(4, 2, 32)
    for act, fn in (("openai_gelu", lambda h: 0.5 * h * (1 + torch.tanh(
            math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))),
                    ("squared_relu", lambda h: torch.relu(h) ** 2), ("gelu", F.gelu)):
        cfg = _config(activation=act, add_bias_linear=False)
        mlp = ParallelMLP(cfg.model)
        out, _ = mlp(x)
        ref = fn(x @ mlp.dense_h_to_4h.weight.t()) @ mlp.dense_4h_to_h.weight.t()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=act)
    norm = LayerNorm1P(32)
    assert torch.equal(norm.weight, torch.zeros(32))
    torch.testing.assert_close(norm(x), F.layer_norm(x, (32,)))


# ------------------------------------------------------------------------ norms under TP/PP/DP
def _stage_name(name: str, offset: int) -> str:
    if name == "word_embeddings_for_head.weight":
        return "language_model.embedding.word_embeddings.weight"
    prefix = "language_model.encoder.layers."
    if name.startswith(prefix):
        index, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{int(index) + offset}.{rest}"
    return name


def _norms(rank, world, tp, pp, parallel):
    """Per model (tied and untied embeddings): loss, grad norm, zero count and params
    norm (before and after) of one step, every layout from the same weights (the
    single-process model's, sharded)."""
    return [_norms_of(rank, world, tp, pp, parallel, untie) for untie in (False, True)]


def _norms_of(rank, world, tp, pp, parallel, untie):
    kw = {"untie_embeddings_and_output_weights": untie}
    torch.manual_seed(0)
    full = GPTModel(_config(**kw).model).state_dict()  # use_cpu_initialization: TP=1 draw
    cfg = _config(world, tp, pp, parallel=parallel, optim={"log_num_zeros_in_grad": True, "lr": 0.05}, **kw)
    cfg.data.vocab_size = 100  # tokens < 100: rows 100..127 of an untied table get no grad
    tr, data = _trainer(cfg, rank)
    ps = tr.rt.ps
    offset = (cfg.model.num_layers // pp) * ps.pp_rank
    with torch.no_grad():
        for name, p in tr.model.module.named_parameters():
            w = full[_stage_name(name, offset)]
            if getattr(p, "tensor_model_parallel", False) and ps.tp_size > 1:
                w = shard_of_full_weight(w, p.partition_dim, p.partition_stride, ps.tp_rank,
                                         ps.tp_size)
            p.copy_(w)
    tr.optimizer.reload_model_params()
    before = float(tr.optimizer.get_params_norm())
    for _ in range(2):  # the first step has lr 0 (warmup)
        loss, ok, grad_norm, zeros = train_step(tr, data)
        assert ok
    return [float(loss), float(grad_norm), float(zeros), before,
            float(tr.optimizer.get_params_norm())]


def test_params_norm_is_the_l2_norm_of_the_weights():
    for dtype in (torch.float32, torch.bfloat16):
        tr, _ = _trainer(_config(dtype=dtype))
        weights = [p.detach().float() for p in tr.model.module.parameters()]
        expected = torch.linalg.vector_norm(torch.cat([w.flatten() for w in weights]))
        # fp32 main copies of bf16 weights are the bf16 values, so the norms agree closely
        torch.testing.assert_close(tr.optimizer.get_params_norm(), expected, rtol=1e-5, atol=0)


def test_norms_and_zero_count_match_single_process_under_tp_pp_dp():
    ref = _norms(0, 1, 1, 1, None)
    assert ref[1][2] >= 28 * 32  # untied: the table rows of tokens never drawn
    assert abs(ref[0][4] - ref[0][3]) > 1e-3  # the second step moved the weights
    layouts = {"tp2 x pp2": (2, 2, None),
               "tp2 x dp2, distributed optimizer": (2, 1, {"use_distributed_optimizer": True})}
    names = ("loss", "grad norm", "num zeros", "params norm", "params norm after step")
    for what, (tp, pp, parallel) in layouts.items():
        for rank, got in enumerate(run_distributed(_norms, 4, tp, pp, parallel)):
            for tied, model_got, model_ref in zip(("tied", "untied"), got, ref):
                for name, a, b in zip(names, model_got, model_ref):
                    # A grad entry can cancel to exactly 0.0 in one summation order only.
                    tol = 2 if name == "num zeros" else 1e-5 * (1 + abs(b))
                    assert abs(a - b) <= tol, f"{what} {tied} rank {rank}: {name} {a} != {b}"


# ------------------------------------------------------------------------- DP=4 parity
def _dp_run(rank, world, variants, iters=3):
    out = {}
    for name, parallel, random_init in variants:
        cfg = _config(world, mbs=1, gbs=8, parallel=parallel)
        cfg.training.data_parallel_random_init = random_init
        tr, data = _trainer(cfg, rank, dp_random_init=random_init)
        first = next(tr.model.module.parameters()).detach().clone()
        losses = []
        for _ in range(iters):
            loss, ok, _, _ = train_step(tr, data)
            assert ok
            losses.append(float(loss))
        out[name] = {"losses": losses, "first_param": first,
                     "grads": full_named_grads(tr.model.module, None)}
    return out


def _close(ref, got, what):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0, msg=f"{what}: losses differ")
    for name, g in ref["grads"].items():
        diff = (got["grads"][name] - g).abs().max().item()
        assert diff <= 1e-5 * (1 + g.abs().max().item()), f"{what}: grad of {name} off by {diff}"


def test_dp4_with_and_without_overlap_and_random_init_match_single_process():
    ref = _dp_run(0, 1, [("ref", None, False)])["ref"]
    variants = [("plain", None, False),
                ("overlap", {"overlap_grad_reduce": True, "ddp_bucket_size": 2000}, False),
                ("random init", None, True)]
    results = run_distributed(_dp_run, 4, variants)
    for rank, got in enumerate(results):
        for name, _, _ in variants:
            _close(ref, got[name], f"dp=4 {name} rank {rank}")
    # --data-parallel-random-init: each replica drew its own weights; the first step
    # started from DP rank 0's (which are the single-process ones).
    firsts = [r["random init"]["first_param"] for r in results]
    assert not torch.equal(firsts[0], firsts[1])
    assert torch.equal(firsts[0], results[0]["plain"]["first_param"])


def test_fp16_cross_entropy_tensor_parallel():
    torch.manual_seed(0)
    logits = (torch.randn(4, 2, 64) * 4).half()
    labels = torch.randint(0, 64, (4, 2))
    ref = half_precision_cross_entropy(logits, labels)
    for got in run_distributed(_tp_half_ce, 2, logits, labels):
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-3)
        fp32 = vocab_parallel_cross_entropy(logits.float(), labels)
        torch.testing.assert_close(got.float(), fp32, rtol=0, atol=1e-2)


def _tp_half_ce(rank, world, logits, labels):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    shard = logits.chunk(world, dim=-1)[rank]
    return half_precision_cross_entropy(shard, labels, group)


@pytest.mark.parametrize("flag", ["--fp16-lm-cross-entropy", "--fp32-residual-connection"])
def test_precision_flags_need_half_precision(flag):
    from megatron.arguments import ArgumentsError, parse_and_validate

    with pytest.raises(ArgumentsError, match=flag):
        parse_and_validate(TINY + ["--train-iters", "1", flag])
