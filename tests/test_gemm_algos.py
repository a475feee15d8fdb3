"""--gemm-algorithms: the products the layers route through gemm_algos, the table file,
the refusals; on CUDA, cuBLASLt with each heuristic candidate against torch's product."""
import ctypes
import json
import os
import sys

import pytest
import torch

from megatron.arguments import parse_and_validate
from megatron.arguments_common import ArgumentsError
from megatron.core.tensor_parallel import gemm_algos
from megatron.core.tensor_parallel.gemm_algos import Shape

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.dist_utils import run_distributed  # noqa: E402
from tools import tune_gemms  # noqa: E402
from tools.benchmark import PRESETS, build_argv  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLASLt needs CUDA")


@pytest.fixture
def entry_env(monkeypatch):
    """The entry point exports --cublas-workspace's choice into os.environ; undo it."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))


def _expected_shapes(tp: int) -> dict:
    """The tiny preset (2 layers, hidden 64, ffn 256, 4 x 64 tokens, vocabulary 512, tied
    output layer) on one of `tp` tensor-parallel ranks: forward, input grad and weight
    grad of the four linears per layer (qkv and fc1 split by output, proj and fc2 by
    input) and of the output layer (split by vocabulary). The preset has biases: qkv's
    forward adds its bias in the product (the row-parallel layers add theirs after the
    reduction), and the GeLU is the tanh form, inside fc1's forward (with the bias) and
    fc2's input grad."""
    layers, h, f, t, v = 2, 64, 256, 4 * 64, 512
    expected = {}
    for name, out_f, in_f, per_step in [
            ("qkv", 3 * h // tp, h, layers), ("proj", h, h // tp, layers),
            ("fc1", f // tp, h, layers), ("fc2", h, f // tp, layers), ("out", v // tp, h, 1)]:
        forward_ep, dgrad_ep = {"qkv": ("bias", ""), "fc1": ("gelu_aux_bias", ""),
                                "fc2": ("", "dgelu")}.get(name, ("", ""))
        expected[Shape("forward", t, out_f, in_f, "fp32", forward_ep)] = per_step
        expected[Shape("dgrad", t, in_f, out_f, "fp32", dgrad_ep)] = per_step
        expected[Shape("wgrad", out_f, in_f, t, "fp32")] = per_step
    return expected


def test_one_step_records_every_linear_product_with_its_count(entry_env):
    counts = tune_gemms.record_shapes(build_argv("tiny", 4, 0, PRESETS["tiny"][1], []), "cpu")
    assert dict(counts) == _expected_shapes(1)


def _tp_record_worker(rank, world, port, load):
    """record_shapes with --use-checkpoint-args as torchrun starts it (no process group
    yet, the launch's store at MASTER_PORT): (its counts, its file reads under `load`)."""
    import torch.distributed as dist

    from tests.test_startup_reads import _count_reads_under

    dist.destroy_process_group()  # run_distributed's: start as the tool does
    os.environ.update(MASTER_PORT=str(port), RANK=str(rank))  # as torchrun sets them
    reads: dict = {}
    _count_reads_under(load, reads)
    argv = build_argv("tiny", 4, 0, PRESETS["tiny"][1], ["--load", load, "--use-checkpoint-args"],
                      layout={"tp": world, "pp": 1, "dp": 1})
    return dict(tune_gemms.record_shapes(argv, "cpu", rank, world)), reads


def test_each_tensor_parallel_rank_records_its_slices(tmp_path):
    """Under TP 2 with sequence parallelism (inputs all-gathered before the products),
    each rank records the products of its slices. With --use-checkpoint-args rank 0
    alone reads the checkpoint's arguments (each rank read them), and the process group
    is made through the store that handed them over."""
    from tests.dist_utils import free_port
    from tests.test_startup_reads import _checkpoint

    saved = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64,
             "max_position_embeddings": 64, "tokenizer_type": "NullTokenizer",
             "vocab_size": 511, "tensor_model_parallel_size": 2,
             "pipeline_model_parallel_size": 1}
    load = _checkpoint(tmp_path / "ckpt", {"args": saved, "iteration": 10})
    results = run_distributed(_tp_record_worker, 2, free_port(), load)
    for counts, _ in results:
        assert counts == _expected_shapes(2)
    assert results[0][1].get("opens", 0) >= 2, results[0][1]  # tracker, model file
    assert results[1][1] == {}, results[1][1]


def test_record_only_prints_the_shapes(capsys, entry_env):
    assert tune_gemms.main(["--record-only", "--device", "cpu", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "| forward gelu_aux_bias | 256 | 256 | 64 | fp32 | 2 |" in out  # fc1, tanh GeLU
    with pytest.raises(SystemExit, match="needs --out FILE and CUDA"):
        tune_gemms.main(["--device", "cpu", "--preset", "tiny"])


def test_a_launcher_variable_that_is_no_number_is_one_line_naming_it(monkeypatch, entry_env):
    """WORLD_SIZE=x (a broken launch script) was a ValueError traceback from a bare int()."""
    monkeypatch.setenv("WORLD_SIZE", "x")
    with pytest.raises(SystemExit, match=r"WORLD_SIZE='x' is not a whole number >= 1"):
        tune_gemms.main(["--record-only", "--device", "cpu", "--preset", "tiny"])


@pytest.mark.parametrize("flags, message", [
    (["--rounds", "0"], "--rounds 0 must be >= 1"),
    (["--seconds", "0"], "--seconds 0.0 must be a number > 0"),
    (["--seconds", "nan"], "--seconds nan must be a number > 0"),
    (["--candidates", "-1"], "--candidates -1 must be >= 1"),
    (["--min-gain", "nan"], "--min-gain nan must be a finite number"),
])
def test_timing_settings_no_tuning_can_use_are_refused_first(flags, message, capsys,
                                                             entry_env):
    """--rounds 0 and --seconds 0 divided by zero on the GPU, after the step was recorded;
    --min-gain nan kept no candidate in silence. Refused before the recording (status 2)."""
    with pytest.raises(SystemExit) as exc:
        tune_gemms.main(["--record-only", "--device", "cpu", "--preset", "tiny", *flags])
    captured = capsys.readouterr()
    assert exc.value.code == 2 and message in captured.err and "| product |" not in captured.out


def test_help_describes_the_tool_in_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        tune_gemms.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("fastest at the GPU's power limit, and write the table that `--gemm-algorithms "
            "FILE` reads (CUDA).") in text


def _algo(seed: int) -> bytes:
    return bytes((seed + i) % 256 for i in range(64))


def test_table_round_trips_and_is_refused_elsewhere(tmp_path):
    path = str(tmp_path / "gemms.json")
    a = Shape("forward", 16384, 8192, 2048, "bf16")
    b = Shape("wgrad", 8192, 2048, 16384, "bf16")
    gemm_algos.save_table(path, "GPU X", 130400, [
        {"shape": a, "algo": _algo(1), "torch_ms": 0.85, "ms": 0.79},
        {"shape": b, "algo": _algo(2)}])
    assert gemm_algos.load_table(path, "GPU X", 130400) == {a: _algo(1), b: _algo(2)}
    with pytest.raises(ValueError, match="device 'GPU X', this process has 'GPU Y'; tune again"):
        gemm_algos.load_table(path, "GPU Y", 130400)
    with pytest.raises(ValueError, match="cublaslt_version 130400, this process has 130500"):
        gemm_algos.load_table(path, "GPU X", 130500)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read it"):
        gemm_algos.load_table(str(tmp_path / "bad.json"), "GPU X", 130400)
    text = open(path).read().replace(_algo(2).hex(), _algo(2).hex()[:-2])
    (tmp_path / "short.json").write_text(text)
    with pytest.raises(ValueError, match="algorithm of 63 bytes"):
        gemm_algos.load_table(str(tmp_path / "short.json"), "GPU X", 130400)


def test_a_failed_save_keeps_the_earlier_table_whole(tmp_path):
    """tune_gemms re-tuning into its own table: a write that fails part-way (here a value
    json cannot write, as a full disk or SIGTERM would stop it) leaves the earlier table
    readable and no temporary file beside it."""
    path = str(tmp_path / "gemms.json")
    a = Shape("forward", 16384, 8192, 2048, "bf16")
    gemm_algos.save_table(path, "GPU X", 130400, [{"shape": a, "algo": _algo(1)}])
    with pytest.raises(TypeError):
        gemm_algos.save_table(path, "GPU X", 130400,
                              [{"shape": a, "algo": _algo(2), "ms": object()}])
    assert gemm_algos.load_table(path, "GPU X", 130400) == {a: _algo(1)}
    assert os.listdir(tmp_path) == ["gemms.json"]


def test_shipped_tables_merge_the_matching_ones_and_pass_over_the_rest(tmp_path):
    """auto's tables: only those of this GPU model and cuBLASLt version count; a shape two
    of them list takes the faster measured algorithm; a broken file is named."""
    a = Shape("forward", 16384, 8192, 2048, "bf16")
    b = Shape("wgrad", 8192, 2048, 16384, "bf16")
    c = Shape("dgrad", 16384, 2048, 8192, "bf16", "dgelu")
    gemm_algos.save_table(str(tmp_path / "one.json"), "GPU X", 130400, [
        {"shape": a, "algo": _algo(1), "ms": 0.80}, {"shape": b, "algo": _algo(2), "ms": 0.7}])
    gemm_algos.save_table(str(tmp_path / "two.json"), "GPU X", 130400, [
        {"shape": a, "algo": _algo(3), "ms": 0.79}, {"shape": c, "algo": _algo(4)}])
    gemm_algos.save_table(str(tmp_path / "other.json"), "GPU Y", 130400, [
        {"shape": b, "algo": _algo(5), "ms": 0.1}])
    (tmp_path / "notes.txt").write_text("not a table")
    table, used = gemm_algos.shipped_tables(str(tmp_path), "GPU X", 130400)
    assert table == {a: _algo(3), b: _algo(2), c: _algo(4)}
    assert [os.path.basename(u) for u in used] == ["one.json", "two.json"]
    assert gemm_algos.shipped_tables(str(tmp_path), "GPU X", 130500) == ({}, [])
    assert gemm_algos.shipped_tables(str(tmp_path / "missing"), "GPU X", 130400) == ({}, [])
    (tmp_path / "three.json").write_text('{"format": 1, "device": "GPU X", '
                                         '"cublaslt_version": 130400, "entries": [{"m": 1}]}')
    with pytest.raises(ValueError, match="three.json: bad entry"):
        gemm_algos.shipped_tables(str(tmp_path), "GPU X", 130400)


def test_the_shipped_tables_load():
    """Every table in megatron/gemm_tables is readable and well formed, under the GPU
    model and cuBLASLt version it names."""
    from megatron.gemm_choice import GEMM_TABLES

    names = sorted(n for n in os.listdir(GEMM_TABLES) if n.endswith(".json"))
    assert names, GEMM_TABLES
    for name in names:
        path = os.path.join(GEMM_TABLES, name)
        with open(path) as f:
            head = json.load(f)
        table = gemm_algos.load_table(path, head["device"], head["cublaslt_version"])
        assert len(table) == len(head["entries"]) > 0, name
        merged, used = gemm_algos.shipped_tables(GEMM_TABLES, head["device"],
                                                 head["cublaslt_version"])
        assert path in used and set(table) <= set(merged)


def test_auto_on_the_cpu_and_none_leave_torch_products():
    """--gemm-algorithms auto on the CPU (and none anywhere) activates nothing and drops a
    table an earlier trainer of the process left active."""
    from types import SimpleNamespace

    from megatron.gemm_choice import activate_gemm_algorithms

    rt = SimpleNamespace(device=torch.device("cpu"))
    for choice in ("auto", "none", None):
        gemm_algos._ACTIVE[("forward", 6, 5, 4, "fp32")] = 0
        activate_gemm_algorithms(SimpleNamespace(args={"gemm_algorithms": choice}), rt)
        assert not gemm_algos._ACTIVE


@needs_cuda
@pytest.mark.cuda
def test_auto_on_cuda_activates_the_shipped_entries_of_this_gpu():
    from types import SimpleNamespace

    from megatron.gemm_choice import GEMM_TABLES, activate_gemm_algorithms

    device = torch.device("cuda", torch.cuda.current_device())
    want, _ = gemm_algos.shipped_tables(GEMM_TABLES, torch.cuda.get_device_name(device),
                                        gemm_algos.cublaslt().version)
    try:
        activate_gemm_algorithms(SimpleNamespace(args={"gemm_algorithms": "auto"}),
                                 SimpleNamespace(device=device))
        assert set(gemm_algos._ACTIVE) == {s.key for s in want}
    finally:
        gemm_algos.activate({}, device)


def test_flag_needs_cuda_and_an_existing_file(tmp_path):
    argv = build_argv("tiny", 4, 0, PRESETS["tiny"][1], [])
    with pytest.raises(ArgumentsError, match="need CUDA; run without it on the CPU"):
        parse_and_validate(argv + ["--gemm-algorithms", "t.json"], cuda_available=False)
    missing = str(tmp_path / "none.json")
    with pytest.raises(ArgumentsError, match="no such file; write one with python tools/tune"):
        parse_and_validate(argv + ["--gemm-algorithms", missing], cuda_available=True)
    assert parse_and_validate(argv, cuda_available=False).args["gemm_algorithms"] == "auto"
    for choice in ("auto", "none"):  # neither names a file; both are fine on the CPU
        ns = parse_and_validate(argv + ["--gemm-algorithms", choice], cuda_available=False)
        assert ns.args["gemm_algorithms"] == choice


def test_activate_refuses_the_cpu_and_an_empty_table_turns_it_off():
    with pytest.raises(ValueError, match="need CUDA; this run is on cpu"):
        gemm_algos.activate({Shape("forward", 4, 4, 4, "bf16"): _algo(0)}, torch.device("cpu"))
    gemm_algos.activate({}, torch.device("cpu"))
    assert not gemm_algos._ACTIVE


def test_a_listed_shape_on_cpu_tensors_stays_torch_product(monkeypatch):
    """The table is consulted only for CUDA tensors: a CPU product of a listed shape (and a
    non-contiguous one) is torch's, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 4, generator=gen), torch.randn(5, 4, generator=gen)
    monkeypatch.setitem(gemm_algos._ACTIVE, ("forward", 6, 5, 4, "fp32"), 0)
    monkeypatch.setitem(gemm_algos._ACTIVE, ("dgrad", 6, 4, 5, "fp32"), 0)
    assert torch.equal(gemm_algos.linear_forward(x, w), x @ w.t())
    dy = torch.randn(6, 5, generator=gen)
    assert torch.equal(gemm_algos.linear_dgrad(dy, w), dy @ w)
    main_grad = torch.zeros(5, 4)
    assert not gemm_algos.wgrad_into(main_grad, dy, x, accumulate=True)


class _EmulatedLt:
    """cuBLASLt's contract in torch ops: column-major matrices (rows, cols, leading
    dimension) over the operands' memory, D = op(A) op(B) + beta C (C not read when beta
    is 0, so it may hold anything, e.g. the NaNs of fresh memory)."""

    calls = 0

    def matmul(self, shape, algo, a, b, c, beta, epilogue="", aux=None, bias=None):
        transa, transb, la, lb, lc = shape.layouts()
        assert epilogue == shape.epilogue

        def view(t, layout):
            _, rows, cols, ld = layout
            return torch.as_strided(t, (rows, cols), (1, ld))

        op_a = view(a, la).t() if transa else view(a, la)
        op_b = view(b, lb).t() if transb else view(b, lb)
        out = view(c, lc)
        product = op_a.double() @ op_b.double()
        if epilogue in ("bias", "gelu_aux_bias"):  # a vector over D's rows (out's columns)
            product = product + bias.double()[:, None]
        if epilogue in ("gelu_aux", "gelu_aux_bias"):  # aux: D's layout
            view(aux, lc).copy_(product)
            product = torch.nn.functional.gelu(product, approximate="tanh")
        if epilogue == "dgelu":
            product = gemm_algos.gelu_tanh_grad(product, view(aux, lc).double())
        out.copy_(product + beta * out.double() if beta else product)  # beta 0: C unread
        _EmulatedLt.calls += 1


@pytest.mark.parametrize("kind", ["forward", "forward bias", "dgrad", "wgrad"])
def test_layouts_and_operand_order_give_the_row_major_product(kind, monkeypatch):
    """What the layers hand cuBLASLt (which tensor is A, which B, the transposes and
    leading dimensions of Shape.layouts, beta, the bias vector) makes the product torch
    computes, checked on the CPU against an emulation of cuBLASLt's column-major contract."""
    m, n, k = 6, 5, 3
    kind, _, epilogue = kind.partition(" ")
    shape = Shape(kind, m, n, k, "fp32", epilogue)
    monkeypatch.setattr(gemm_algos, "_fits", lambda *t: True)
    monkeypatch.setattr(gemm_algos, "_aligned", lambda *t: True)
    monkeypatch.setattr(gemm_algos, "cublaslt", lambda: _EmulatedLt())
    monkeypatch.setitem(gemm_algos._ACTIVE, shape.key, len(gemm_algos._ALGOS))
    monkeypatch.setattr(gemm_algos, "_ALGOS", gemm_algos._ALGOS + [(shape, None)])
    gen = torch.Generator().manual_seed(1)
    before = _EmulatedLt.calls
    if kind == "wgrad":
        dy, x = torch.randn(k, m, generator=gen), torch.randn(k, n, generator=gen)
        main_grad = torch.full((m, n), 0.5)
        assert gemm_algos.wgrad_into(main_grad, dy, x, accumulate=True)
        torch.testing.assert_close(main_grad, 0.5 + dy.t() @ x)
        assert gemm_algos.wgrad_into(main_grad, dy, x, accumulate=False)
        torch.testing.assert_close(main_grad, dy.t() @ x)
    elif kind == "forward":
        x, w = torch.randn(2, m // 2, k, generator=gen), torch.randn(n, k, generator=gen)
        bias = torch.randn(n, generator=gen) if epilogue else None
        torch.testing.assert_close(gemm_algos.linear_forward(x, w, bias),
                                   x @ w.t() + (bias if epilogue else 0))
    else:
        dy, w = torch.randn(2, m // 2, k, generator=gen), torch.randn(k, n, generator=gen)
        torch.testing.assert_close(gemm_algos.linear_dgrad(dy, w), dy @ w)
    assert _EmulatedLt.calls > before, "the product did not go through cuBLASLt's path"


def _route(monkeypatch, shapes):
    """Every shape in `shapes` through the operator and wgrad_into, onto _EmulatedLt."""
    monkeypatch.setattr(gemm_algos, "_fits", lambda *t: True)
    monkeypatch.setattr(gemm_algos, "_aligned", lambda *t: True)
    monkeypatch.setattr(gemm_algos, "cublaslt", lambda: _EmulatedLt())
    algos = []
    for s in shapes:
        monkeypatch.setitem(gemm_algos._ACTIVE, s.key, len(algos))
        algos.append((s, None))
    monkeypatch.setattr(gemm_algos, "_ALGOS", algos)


def test_training_through_the_routed_products_equals_torch_products(monkeypatch, entry_env):
    """Three steps of the tiny model with every linear product routed as a table routes
    it (onto the emulation), eager and with compiled layers, give torch's losses; the
    compiled layer stays one graph with the operator inside."""
    from torch._dynamo.utils import counters

    from megatron.training import data_iterator
    from tests.gpt_helpers import cli_trainer, train_steps

    argv = build_argv("tiny", 4, 0, PRESETS["tiny"][1], [])
    shapes = tune_gemms.record_shapes(argv, "cpu")
    losses = {}
    for name, flags in (("torch", ["--no-compile"]), ("routed", ["--no-compile"]),
                        ("routed, compiled", ["--compile", "--compile-scope", "layer"])):
        torch._dynamo.reset()
        counters.clear()
        cfg, rt, tr = cli_trainer(argv + flags)
        if name != "torch":
            _route(monkeypatch, shapes)  # after build_trainer, which drops any table
        before = _EmulatedLt.calls
        losses[name] = train_steps(tr, data_iterator(cfg, rt, "train", 0), 3)
        assert (_EmulatedLt.calls > before) == (name != "torch")
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] >= 1
    for name in ("routed", "routed, compiled"):
        torch.testing.assert_close(torch.tensor(losses[name]), torch.tensor(losses["torch"]),
                                   rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ CUDA
@pytest.fixture
def restore_table():
    yield
    gemm_algos.activate({}, torch.device("cpu"))


def _cuda_operands(kind, m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rand(*size):
        return torch.randn(*size, device="cuda", generator=gen).bfloat16()

    if kind == "forward":
        return rand(m, k), rand(n, k)
    if kind == "dgrad":
        return rand(m, k), rand(k, n)
    return rand(k, m), rand(k, n)  # wgrad: grad_output [tokens, m], x [tokens, n]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kind", ["forward", "forward bias", "dgrad", "wgrad"])
def test_every_candidate_matches_torch_product(kind, restore_table):
    """cuBLASLt with each of the heuristic's candidates, routed as the layers route it,
    against torch's product (bf16: within one bf16 step of the largest value; the fp32
    weight grad, overwriting and then accumulating, within 1e-4 of it; the forward with a
    bias against torch's addmm)."""
    m, n, k = 512, 384, 256
    kind, _, epilogue = kind.partition(" ")
    shape = Shape(kind, m, n, k, "bf16", epilogue)
    a, b = _cuda_operands(kind, m, n, k)
    bias = torch.randn(n, device="cuda").bfloat16() if epilogue else None
    algos = gemm_algos.cublaslt().candidates(shape, 4, epilogue)
    assert algos, "the heuristic offered no algorithm"
    for algo in algos:
        gemm_algos.activate({shape: algo}, torch.device("cuda"))
        if kind == "wgrad":
            want = torch.mm(a.t(), b, out_dtype=torch.float32)
            main_grad = torch.full((m, n), 7.0, device="cuda")
            assert gemm_algos.wgrad_into(main_grad, a, b, accumulate=False)
            torch.testing.assert_close(main_grad, want, rtol=0, atol=1e-4 * want.abs().max())
            assert gemm_algos.wgrad_into(main_grad, a, b, accumulate=True)
            torch.testing.assert_close(main_grad, 2 * want, rtol=0, atol=2e-4 * want.abs().max())
            continue
        want = (a @ b.t() if kind == "forward" else a @ b).float()
        if kind == "forward":
            got = gemm_algos.linear_forward(a.view(2, m // 2, k), b, bias)  # as the layers
            want = torch.addmm(bias, a, b.t()).float() if epilogue else want
        else:
            got = gemm_algos.linear_dgrad(a.view(2, m // 2, k), b)
        assert got.shape == (2, m // 2, n)
        torch.testing.assert_close(got.view(m, n).float(), want, rtol=0,
                                   atol=2 ** -8 * want.abs().max())


@pytest.mark.cuda
@needs_cuda
def test_operands_off_the_256_byte_alignment_take_torch_product(restore_table):
    m, n, k = 512, 384, 256
    fwd, wg = Shape("forward", m, n, k, "bf16"), Shape("wgrad", m, n, k, "bf16")
    lt = gemm_algos.cublaslt()
    gemm_algos.activate({fwd: lt.candidates(fwd, 1)[0], wg: lt.candidates(wg, 1)[0]},
                        torch.device("cuda"))
    x, w = _cuda_operands("forward", m, n, k)
    shifted = torch.empty(m * k + 8, device="cuda", dtype=torch.bfloat16)[8:].view(m, k)
    shifted.copy_(x)
    assert shifted.data_ptr() % gemm_algos.ALIGNMENT != 0
    want = torch.matmul(x, w.t()).float()  # cuBLAS may pick another kernel for the shift
    torch.testing.assert_close(gemm_algos.linear_forward(shifted, w).float(), want, rtol=0,
                               atol=2 ** -8 * want.abs().max())
    dy, xw = _cuda_operands("wgrad", m, n, k)
    buffer = torch.zeros(m * n + 4, device="cuda")
    assert not gemm_algos.wgrad_into(buffer[4:].view(m, n), dy, xw, accumulate=True)
    assert gemm_algos.wgrad_into(buffer[:m * n].view(m, n), dy, xw, accumulate=True)


@pytest.mark.cuda
@needs_cuda
def test_compiled_and_captured_products_use_the_table(restore_table):
    """Inside torch.compile the operator stays one opaque call; a CUDA graph captures the
    ctypes launch and its replay recomputes from new inputs."""
    m, n, k = 512, 384, 256
    shape = Shape("forward", m, n, k, "bf16")
    x, w = _cuda_operands("forward", m, n, k)
    gemm_algos.activate({shape: gemm_algos.cublaslt().candidates(shape, 1)[0]},
                        torch.device("cuda"))
    want = gemm_algos.linear_forward(x, w)
    compiled = torch.compile(lambda a, b: gemm_algos.linear_forward(a, b) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x, w), want * 2)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemm_algos.linear_forward(static_x, w)  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = gemm_algos.linear_forward(static_x, w)
    static_x.copy_(x * 3)
    graph.replay()
    torch.testing.assert_close(static_out.float(), (x * 3 @ w.t()).float(), rtol=0,
                               atol=2 ** -8 * 3 * want.float().abs().max())


@pytest.mark.cuda
@needs_cuda
def test_tuner_writes_a_table_training_accepts(tmp_path, restore_table, entry_env):
    """tools/tune_gemms.py on the tiny model in bf16 (short timings) writes a table that
    loads here; every entry's shape is one the step records."""
    out = str(tmp_path / "gemms.json")
    assert tune_gemms.main(["--out", out, "--preset", "tiny", "--seconds", "0.03",
                            "--min-gain", "-1", "--", "--bf16"]) == 0
    lt = gemm_algos.cublaslt()
    table = gemm_algos.load_table(out, torch.cuda.get_device_name(), lt.version)
    assert table, "with --min-gain -1 every tuned shape is kept"
    argv = build_argv("tiny", 4, 0, PRESETS["tiny"][1], ["--bf16"])
    recorded = tune_gemms.record_shapes(argv, "cuda")
    assert set(table) <= set(recorded)
    assert all(len(a) == ctypes.sizeof(ctypes.c_uint64 * 8) for a in table.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_tuning_without_cuda_is_refused_before_the_step(capsys):
    """On a machine without CUDA (a login node) the tuner stops at once with a message
    that names --device cpu, instead of building the model, running a step and failing
    with torch's 'not compiled with CUDA' traceback."""
    for argv in (["--out", "gemms.json", "--preset", "tiny"],
                 ["--record-only", "--preset", "tiny"]):
        with pytest.raises(SystemExit, match="CUDA is not available here.*--device cpu"):
            tune_gemms.main(argv)
    assert "| product |" not in capsys.readouterr().out  # no step ran
