"""`--gelu-kernel epilogue`: the MLP's GeLU (tanh form) inside fc1's forward product and
fc2's input-grad product (gemm_algos.linear_gelu_forward / linear_dgrad_dgelu,
ColumnParallelLinear.forward_gelu, RowParallelLinear.forward_after_gelu).

- The pair equals a plain fp32 MLP with torch's tanh GeLU (output, input grad, both weight
  grads, 1e-5), single process and on 2 gloo ranks with and without sequence parallelism,
  with gradient-accumulation fusion into main_grad.
- Training 4 steps with `--gelu-kernel epilogue` gives the losses of `--openai-gelu` (the
  tanh form through torch), eager and compiled (1e-5).
- The recorder sees the epilogue products with their own key; a table with epilogue
  entries round-trips; the flag is refused with a bias or another activation.
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


def _reference(X, W1, W2, G):
    X, W1, W2 = (t.clone().requires_grad_(True) for t in (X, W1, W2))
    y = F.linear(F.gelu(F.linear(X, W1), approximate="tanh"), W2)
    (y * G).sum().backward()
    return y.detach(), X.grad, W1.grad, W2.grad


def _data():
    """Input [s=4, b=3, h=8], upstream grad, fc1 weight [16, 8], fc2 weight [8, 16]."""
    gen = torch.Generator().manual_seed(3)
    X, G = torch.randn(4, 3, 8, generator=gen), torch.randn(4, 3, 8, generator=gen)
    W1, W2 = torch.randn(16, 8, generator=gen) * 0.5, torch.randn(8, 16, generator=gen) * 0.5
    return X, G, W1, W2


def _mlp_worker(rank, world, sp=False, fusion=False):
    group = dist.group.WORLD if world > 1 else None
    X, G, W1, W2 = _data()
    h, f = W1.shape[1], W1.shape[0]
    kw = dict(tp_group=group, init_method=lambda w: None, bias=False, device="cpu",
              use_cpu_initialization=True, sequence_parallel=sp,
              gradient_accumulation_fusion=fusion)
    col = tp.ColumnParallelLinear(h, f, **kw)
    row = tp.RowParallelLinear(f, h, input_is_parallel=True, **kw)
    with torch.no_grad():
        col.weight.copy_(W1.chunk(world, 0)[rank])
        row.weight.copy_(W2.chunk(world, 1)[rank])
    for layer in (col, row) if fusion else ():
        layer.weight.main_grad = torch.zeros(layer.weight.shape)
    x = (X.chunk(world, 0)[rank] if sp else X).clone().requires_grad_(True)
    y, bias = row.forward_after_gelu(*col.forward_gelu(x))
    assert bias is None
    (y * (G.chunk(world, 0)[rank] if sp else G)).sum().backward()
    grads = [lay.weight.main_grad if fusion else lay.weight.grad for lay in (col, row)]
    return y.detach(), x.grad, grads[0], grads[1]


@pytest.mark.parametrize("fusion", [False, True])
def test_single_process_matches_torch(fusion):
    y, gx, g1, g2 = _mlp_worker(0, 1, fusion=fusion)
    X, G, W1, W2 = _data()
    for got, want in zip((y, gx, g1, g2), _reference(X, W1, W2, G)):
        torch.testing.assert_close(got, want, **TOL)


def _tp_worker(rank, world):
    return [_mlp_worker(rank, world, sp, fusion=sp) for sp in (False, True)]


def test_tensor_parallel_matches_torch():
    world = 2
    results = run_distributed(_tp_worker, world)
    X, G, W1, W2 = _data()
    y, gx, g1, g2 = _reference(X, W1, W2, G)
    for rank in range(world):
        for sp, (ry, rgx, rg1, rg2) in zip((False, True), results[rank]):
            torch.testing.assert_close(ry, y.chunk(world, 0)[rank] if sp else y, **TOL)
            torch.testing.assert_close(rgx, gx.chunk(world, 0)[rank] if sp else gx, **TOL)
            torch.testing.assert_close(rg1, g1.chunk(world, 0)[rank], **TOL)
            torch.testing.assert_close(rg2, g2.chunk(world, 1)[rank], **TOL)


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


def test_recorded_with_their_own_key_and_table_round_trip(tmp_path):
    x, w1, w2 = torch.randn(6, 4), torch.randn(5, 4), torch.randn(3, 5)
    with gemm_algos.recording() as counts:
        act, pre = gemm_algos.linear_gelu_forward(x, w1)
        gemm_algos.linear_dgrad_dgelu(torch.randn(6, 3), w2, pre)
    assert counts == {Shape("forward", 6, 5, 4, "fp32", "gelu_aux"): 1,
                      Shape("dgrad", 6, 5, 3, "fp32", "dgelu"): 1}
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


@pytest.mark.parametrize("extra, what", [
    ([], "activation gelu and bias on"),
    (["--disable-bias-linear", "--swiglu"], "activation swiglu and bias off")])
def test_refused_with_a_bias_or_another_activation(extra, what):
    argv = [a for a in ARGV if a != "--disable-bias-linear"] + extra
    with pytest.raises(ArgumentsError, match=f"{what}; use --disable-bias-linear"):
        parse_and_validate(argv + ["--gelu-kernel", "epilogue"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, f, h", [(4096, 8192, 2048), (1000, 3072, 768)])
def test_cublaslt_epilogues_match_torch(m, f, h, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=dtype)
    x, dy = torch.randn(m, h, generator=gen, **bf), torch.randn(m, h, generator=gen, **bf)
    w1 = torch.randn(f, h, generator=gen, **bf) * 0.02
    w2 = torch.randn(h, f, generator=gen, **bf) * 0.02
    act, pre = gemm_algos.linear_gelu_forward(x, w1)
    dh = gemm_algos.linear_dgrad_dgelu(dy, w2, pre)
    ref_pre = x @ w1.t()
    assert torch.equal(pre, ref_pre)  # same accumulation order as torch's product
    ref_act = F.gelu(ref_pre.float(), approximate="tanh")
    step = 2.0 ** -7  # one bf16 rounding step, relative (fp16's is 8x finer)
    assert ((act.float() - ref_act).abs() <= step * ref_act.abs() + 1e-3).all()
    ref_dh = gemm_algos.gelu_tanh_grad((dy.float() @ w2.float()), pre.float())
    err = (dh.float() - ref_dh).norm() / ref_dh.norm()
    assert err < 4e-3, err
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    used = [v for key, v in gemm_algos._HEURISTIC.items() if key[0] == "forward"
            and key[1:5] == (m, f, h, name)]
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
    assert not _mlp("auto", "openai_gelu", True).gelu_epilogue  # a bias: torch's tanh GeLU
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
