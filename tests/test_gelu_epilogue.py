"""`--gelu-kernel epilogue`: the MLP's GeLU (tanh form) inside fc1's forward product and
fc2's input-grad product (gemm_algos.linear_gelu_forward / linear_dgrad_dgelu,
ColumnParallelLinear.forward_gelu, RowParallelLinear.forward_after_gelu).

- The pair equals a plain fp32 MLP with torch's tanh GeLU (output, input grad, both weight
  grads, fc1's bias grad, 1e-5), with and without fc1's bias, single process and on 2 gloo
  ranks with and without sequence parallelism, with gradient-accumulation fusion into
  main_grad.
- Training 4 steps with `--gelu-kernel epilogue` gives the losses of `--openai-gelu` (the
  tanh form through torch), eager and compiled, without and with biases (1e-5); with
  biases the default GeLU is the tanh form (Megatron-LM's fused bias-GeLU) unless
  --no-bias-gelu-fusion.
- The recorder sees the epilogue products with their own key; a table with epilogue
  entries round-trips; the flag is refused with another activation.
- CUDA: cuBLASLt's epilogues match the torch path within bf16 rounding.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.arguments import parse_and_validate
from megatron.arguments_validate import ArgumentsError
from megatron.core import tensor_parallel as tp
from megatron.core.tensor_parallel import gemm_algos
from megatron.core.tensor_parallel.gemm_algos import Shape
from tests.dist_utils import run_distributed
from tests.gpt_helpers import cli_trainer, train_steps

TOL = dict(atol=1e-5, rtol=1e-5)


def _reference(X, W1, W2, G, B1):
    X, W1, W2, B1 = (t.clone().requires_grad_(True) for t in (X, W1, W2, B1))
    y = F.linear(F.gelu(F.linear(X, W1, B1), approximate="tanh"), W2)
    (y * G).sum().backward()
    return y.detach(), X.grad, W1.grad, W2.grad, B1.grad


def _data():
    """Input [s=4, b=3, h=8], upstream grad, fc1 weight [16, 8], fc2 weight [8, 16], fc1
    bias [16]."""
    gen = torch.Generator().manual_seed(3)
    X, G = torch.randn(4, 3, 8, generator=gen), torch.randn(4, 3, 8, generator=gen)
    W1, W2 = torch.randn(16, 8, generator=gen) * 0.5, torch.randn(8, 16, generator=gen) * 0.5
    return X, G, W1, W2, torch.randn(16, generator=gen)


def _mlp_worker(rank, world, sp=False, fusion=False, bias=False):
    """(y, x grad, fc1 weight grad, fc2 weight grad, fc1 bias grad or None) of the pair."""
    group = dist.group.WORLD if world > 1 else None
    X, G, W1, W2, B1 = _data()
    h, f = W1.shape[1], W1.shape[0]
    kw = dict(tp_group=group, init_method=lambda w: None, device="cpu",
              use_cpu_initialization=True, sequence_parallel=sp,
              gradient_accumulation_fusion=fusion)
    col = tp.ColumnParallelLinear(h, f, gather_output=False, bias=bias, **kw)
    row = tp.RowParallelLinear(f, h, input_is_parallel=True, bias=False, **kw)
    with torch.no_grad():
        col.weight.copy_(W1.chunk(world, 0)[rank])
        row.weight.copy_(W2.chunk(world, 1)[rank])
        if bias:
            col.bias.copy_(B1.chunk(world, 0)[rank])
    params = [p for p in (col.weight, row.weight, col.bias) if p is not None]
    for p in params if fusion else ():
        p.main_grad = torch.zeros(p.shape)
    x = (X.chunk(world, 0)[rank] if sp else X).clone().requires_grad_(True)
    y, out_bias = row.forward_after_gelu(*col.forward_gelu(x))
    assert out_bias is None
    (y * (G.chunk(world, 0)[rank] if sp else G)).sum().backward()
    grads = [p.main_grad if fusion else p.grad for p in params]
    return y.detach(), x.grad, grads[0], grads[1], grads[2] if bias else None


@pytest.mark.parametrize("fusion", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_single_process_matches_torch(fusion, bias):
    got = _mlp_worker(0, 1, fusion=fusion, bias=bias)
    X, G, W1, W2, B1 = _data()
    want = _reference(X, W1, W2, G, B1 if bias else torch.zeros_like(B1))
    for g, w in zip(got, want if bias else want[:4]):
        torch.testing.assert_close(g, w, **TOL)
    assert bias or got[4] is None


def _tp_worker(rank, world):
    return [_mlp_worker(rank, world, sp, fusion=sp, bias=sp) for sp in (False, True)]


def test_tensor_parallel_matches_torch():
    world = 2
    results = run_distributed(_tp_worker, world)
    X, G, W1, W2, B1 = _data()
    for sp in (False, True):
        y, gx, g1, g2, gb = _reference(X, W1, W2, G, B1 if sp else torch.zeros_like(B1))
        for rank in range(world):
            ry, rgx, rg1, rg2, rgb = results[rank][sp]
            torch.testing.assert_close(ry, y.chunk(world, 0)[rank] if sp else y, **TOL)
            torch.testing.assert_close(rgx, gx.chunk(world, 0)[rank] if sp else gx, **TOL)
            torch.testing.assert_close(rg1, g1.chunk(world, 0)[rank], **TOL)
            torch.testing.assert_close(rg2, g2.chunk(world, 1)[rank], **TOL)
            if sp:  # fc1's input was gathered: its bias grad sums every token
                torch.testing.assert_close(rgb, gb.chunk(world, 0)[rank], **TOL)


ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "8", "--lr", "3e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--disable-bias-linear"]


@pytest.mark.parametrize("compiled", [False, True])
def test_training_matches_the_tanh_gelu(compiled):
    from megatron.training import data_iterator

    def losses(extra):
        flags = ARGV + extra + ([] if compiled else ["--no-compile"])
        cfg, rt, tr = cli_trainer(flags + (["--compile"] if compiled else []))
        return train_steps(tr, data_iterator(cfg, rt, "train", 0), 4)

    expected = losses(["--openai-gelu", "--gelu-kernel", "torch"])
    got = losses(["--gelu-kernel", "epilogue"])
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_biased_default_gelu_is_the_tanh_form_in_the_epilogue(compiled):
    """With biases the default GeLU is Megatron-LM's fused bias-GeLU (tanh form); auto runs
    it in the epilogues. It trains as torch's tanh GeLU does, and differs from the erf
    GeLU that --no-bias-gelu-fusion asks for."""
    from megatron.core.models.gpt.transformer import ParallelMLP
    from megatron.training import data_iterator

    argv = [a for a in ARGV if a != "--disable-bias-linear"]

    def losses(extra):
        flags = argv + extra + (["--compile"] if compiled else ["--no-compile"])
        cfg, rt, tr = cli_trainer(flags)
        mlps = [m for m in tr.model.modules() if isinstance(m, ParallelMLP)]
        assert mlps and all(m.gelu_epilogue == (cfg.model.activation == "openai_gelu" and
                                                cfg.model.gelu_kernel == "auto") for m in mlps)
        return torch.tensor(train_steps(tr, data_iterator(cfg, rt, "train", 0), 4)), mlps[0]

    default, _ = losses([])
    assert torch.allclose(default, losses(["--openai-gelu", "--gelu-kernel", "torch"])[0],
                          rtol=0, atol=1e-5)
    # --no-bias-gelu-fusion: the erf GeLU, outside the products. (The tiny model's losses
    # move by ~1e-6 between the two forms, too little to tell apart on every CPU, so the
    # activation itself is checked where the forms differ by up to 5e-4.)
    _, mlp = losses(["--no-bias-gelu-fusion"])
    x = torch.linspace(-4, 4, 801)
    assert not mlp.gelu_epilogue
    assert torch.allclose(mlp.act(x), torch.nn.functional.gelu(x), rtol=0, atol=1e-6)
    assert (mlp.act(x) - torch.nn.functional.gelu(x, approximate="tanh")).abs().max() > 1e-4


def test_recorded_with_their_own_key_and_table_round_trip(tmp_path):
    x, w1, w2 = torch.randn(6, 4), torch.randn(5, 4), torch.randn(3, 5)
    with gemm_algos.recording() as counts:
        act, pre = gemm_algos.linear_gelu_forward(x, w1)
        gemm_algos.linear_dgrad_dgelu(torch.randn(6, 3), w2, pre)
        gemm_algos.linear_gelu_forward(x, w1, torch.randn(5))
    assert counts == {Shape("forward", 6, 5, 4, "fp32", "gelu_aux"): 1,
                      Shape("dgrad", 6, 5, 3, "fp32", "dgelu"): 1,
                      Shape("forward", 6, 5, 4, "fp32", "gelu_aux_bias"): 1}
    a = Shape("forward", 64, 32, 16, "bf16", "gelu_aux")
    b = Shape("forward", 64, 32, 16, "bf16")
    algo = bytes(range(64))
    path = str(tmp_path / "t.json")
    gemm_algos.save_table(path, "GPU X", 1, [{"shape": a, "algo": algo},
                                             {"shape": b, "algo": algo[::-1]}])
    assert gemm_algos.load_table(path, "GPU X", 1) == {a: algo, b: algo[::-1]}
    text = open(path).read().replace('"gelu_aux"', '"dgelu"')
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(ValueError, match="bad entry"):
        gemm_algos.load_table(str(tmp_path / "bad.json"), "GPU X", 1)


def test_refused_with_another_activation():
    with pytest.raises(ArgumentsError, match="activation is swiglu; drop the flag"):
        parse_and_validate(ARGV + ["--swiglu", "--gelu-kernel", "epilogue"])
    # biases are fine: the epilogue adds fc1's
    assert parse_and_validate([a for a in ARGV if a != "--disable-bias-linear"]
                              + ["--gelu-kernel", "epilogue"]).model.add_bias_linear


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, f, h", [(4096, 8192, 2048), (1000, 3072, 768)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cublaslt_epilogues_match_torch(m, f, h, dtype, with_bias):
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=dtype)
    x, dy = torch.randn(m, h, generator=gen, **bf), torch.randn(m, h, generator=gen, **bf)
    w1 = torch.randn(f, h, generator=gen, **bf) * 0.02
    w2 = torch.randn(h, f, generator=gen, **bf) * 0.02
    b1 = torch.randn(f, generator=gen, **bf) * 0.5 if with_bias else None
    act, pre = gemm_algos.linear_gelu_forward(x, w1, b1)
    dh = gemm_algos.linear_dgrad_dgelu(dy, w2, pre)
    ref_pre = x.float() @ w1.float().t() + (b1.float() if with_bias else 0)
    step = 2.0 ** -7  # one bf16 rounding step, relative (fp16's is 8x finer)
    if with_bias:  # the bias is added to the fp32 accumulator: one rounding
        assert ((pre.float() - ref_pre).abs() <= step * ref_pre.abs() + 1e-3).all()
    else:
        assert torch.equal(pre, x @ w1.t())  # same accumulation order as torch's product
    ref_act = F.gelu(pre.float(), approximate="tanh")
    assert ((act.float() - ref_act).abs() <= step * ref_act.abs() + 1e-3).all()
    ref_dh = gemm_algos.gelu_tanh_grad((dy.float() @ w2.float()), pre.float())
    err = (dh.float() - ref_dh).norm() / ref_dh.norm()
    assert err < 4e-3, err
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    epilogue = "gelu_aux_bias" if with_bias else "gelu_aux"
    used = [v for key, v in gemm_algos._HEURISTIC.items()
            if key == ("forward", m, f, h, name, epilogue)]
    assert used and used[0] >= 0  # the cuBLASLt path ran, not the torch fallback


def _mlp(kernel: str, activation: str, bias: bool):
    from megatron.core.config import ModelConfig
    from megatron.core.models.gpt.transformer import ParallelMLP

    cfg = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, padded_vocab_size=16,
                      seq_length=4, max_position_embeddings=4, gelu_kernel=kernel,
                      activation=activation, add_bias_linear=bias)
    return ParallelMLP(cfg, device="cpu")


def test_auto_takes_the_epilogue_for_the_tanh_form_only():
    assert _mlp("auto", "openai_gelu", False).gelu_epilogue
    assert not _mlp("auto", "gelu", False).gelu_epilogue  # erf stays the polynomial's
    assert _mlp("auto", "openai_gelu", True).gelu_epilogue  # the epilogue adds the bias
    assert not _mlp("torch", "openai_gelu", False).gelu_epilogue
    assert _mlp("epilogue", "gelu", False).gelu_epilogue


def test_tuner_lists_the_epilogue_products(capsys, monkeypatch):
    from tools import tune_gemms

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    assert tune_gemms.main(["--record-only", "--device", "cpu", "--preset", "tiny", "--",
                            "--gelu-kernel", "epilogue", "--disable-bias-linear"]) == 0
    out = capsys.readouterr().out
    assert "| forward gelu_aux | 256 | 256 | 64 | fp32 | 2 |" in out  # fc1, 2 layers
    assert "| dgrad dgelu | 256 | 256 | 64 | fp32 | 2 |" in out  # fc2's input grad
    assert "| forward | 256 | 256 | 64 |" not in out


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt needs CUDA")
def test_tuned_epilogue_algorithms_are_used_and_match(tmp_path, monkeypatch):
    from tools import tune_gemms

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")
    out = str(tmp_path / "gemms.json")
    assert tune_gemms.main(["--out", out, "--preset", "tiny", "--seconds", "0.03",
                            "--min-gain", "-1", "--", "--bf16", "--gelu-kernel", "epilogue",
                            "--disable-bias-linear"]) == 0
    lt = gemm_algos.cublaslt()
    table = gemm_algos.load_table(out, torch.cuda.get_device_name(), lt.version)
    fwd = Shape("forward", 256, 256, 64, "bf16", "gelu_aux")
    assert fwd in table and Shape("dgrad", 256, 256, 64, "bf16", "dgelu") in table
    try:
        gemm_algos.activate(table, torch.device("cuda"))
        gen = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(256, 64, device="cuda", generator=gen).bfloat16()
        w = (torch.randn(256, 64, device="cuda", generator=gen) * 0.1).bfloat16()
        act, pre = gemm_algos.linear_gelu_forward(x, w)
        assert not gemm_algos._HEURISTIC  # the table's algorithm, not the heuristic's
        ref = F.gelu((x @ w.t()).float(), approximate="tanh")
        assert ((act.float() - ref).abs() <= 2.0 ** -7 * ref.abs() + 1e-3).all()
    finally:
        gemm_algos.activate({}, torch.device("cuda"))


def test_use_checkpoint_args_keeps_the_checkpoints_gelu(monkeypatch, tmp_path):
    """A checkpoint trained with --no-bias-gelu-fusion (erf GeLU) resumes with it."""
    from megatron import arguments_checkpoint

    monkeypatch.setattr(arguments_checkpoint, "read_checkpoint_args",
                        lambda load: {"add_bias_linear": True, "bias_gelu_fusion": False})
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")  # a checkpoint is there
    argv = [a for a in ARGV if a != "--disable-bias-linear"]
    resumed = parse_and_validate(argv + ["--load", str(tmp_path), "--use-checkpoint-args"])
    assert resumed.model.activation == "gelu"
    assert parse_and_validate(argv).model.activation == "openai_gelu"
