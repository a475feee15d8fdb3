"""Pipeline-parallel generation (tools/generate_tp.py, PipelineGPT) on gloo ranks against
the one-process path. Checkpoints saved at tp 1 (a GPT-2 shape: tied output, learned
positions, 2 layers; a Llama shape: rotary, SwiGLU, RMSNorm, untied, 4 layers) are loaded
through the training loader at pp 2 (world 2) and tp 2 x pp 2 (world 4). On every rank:
the cached decoding's logits equal the one-process full forward within 1e-5 of the
largest (fp32); greedy and seeded sampled tokens (one prompt, a batch of prompts of
different lengths, past --max-position-embeddings, --no-kv-cache) equal the one-process
tokens; log-probabilities within 1e-5; beam search gives the same hypotheses (scores
within 1e-5), with and without the cache. generate.py under torchrun-style ranks prints
the one-process answer; the server at pp 2 answers as one process and stops with rank 0;
the layouts generation does not run are refused by name."""
from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest
import torch

from megatron.core.models.gpt.kv_cache import KVCache, forward_incremental
from megatron.core.models.gpt.static_decode import graph_reason
from tests.dist_utils import run_distributed
from tests.test_generate import _train
from tests.test_generate_tp import _serve_worker as serve_worker
from tests.test_generate_tp import two_rank_server
from tools import generate
from tools import run_text_generation_server as server_mod
from tools.beam_search import beam_search
from tools.generate_tp import check_generation_layout, load_model_tp
from tools.text_generation_api import batch_token_logprobs

PROMPTS = ([4, 9, 1, 30], [7], [3, 3, 8, 2, 11, 5, 60])
VOCAB = 100  # the tokenizer's; padded to 128 (its ids span both halves at tp 2)
SHAPES = {
    "gpt2": "--make-vocab-size-divisible-by 32",
    "llama": ("--make-vocab-size-divisible-by 32 --num-layers 4 --position-embedding-type "
              "rope --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights "
              "--disable-bias-linear"),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{shape name: checkpoint directory}, each trained 2 steps in one process."""
    out = {}
    for name, flags in SHAPES.items():
        path = tmp_path_factory.mktemp(name)
        _train(path, flags, steps=2)
        out[name] = str(path)
    return out


def _decode(model) -> dict:
    """Everything compared between the layouts, computed on `model` (a whole model, or
    this rank's share called in lockstep with the other ranks)."""
    def gens(base):
        return [torch.Generator().manual_seed(base + i) for i in range(len(PROMPTS))]

    prompts = [list(p) for p in PROMPTS]
    ids = torch.tensor([[5, 9, 2, 77, 3, 1, 64, 12, 8, 99, 0, 41, 7, 7, 30, 6]])
    cache = KVCache(len(model.language_model.encoder.layers), 16)
    with torch.no_grad():
        parts = [forward_incremental(model, ids[:, :5], cache)[0]]
        parts += [forward_incremental(model, ids[:, i:i + 1], cache)[0] for i in range(5, 16)]
        full = generate.gather_vocab(model, model(ids))[0]
    # a stop token the beams meet: the second greedy token after the first prompt
    stop = generate.generate(model, prompts[0], 2, greedy=True, vocab_limit=VOCAB)[1]
    beam_kw = dict(stop_token=stop, vocab_limit=VOCAB, length_penalty=0.7)
    sample_kw = dict(temperature=1.5, top_p=0.95, vocab_limit=VOCAB)
    return {
        "cached": torch.cat(parts), "full": full,
        "greedy": generate.generate(model, prompts[0], 8, greedy=True, vocab_limit=VOCAB),
        "sampled": generate.generate(model, prompts[0], 8, generator=gens(3)[0], **sample_kw),
        "past_max": generate.generate(model, prompts[2], 12, greedy=True, vocab_limit=VOCAB),
        "no_cache": generate.generate(model, prompts[2], 12, use_cache=False,
                                      generator=gens(5)[0], **sample_kw),
        "batch": generate.generate_batch(model, prompts, 8, greedy=True, vocab_limit=VOCAB),
        "batch_sampled": generate.generate_batch(model, prompts, 8, generators=gens(7),
                                                 **sample_kw),
        "logprobs": batch_token_logprobs(model, [p + [1, 2] for p in prompts], VOCAB),
        "beam": beam_search(model, prompts[0], 3, 8, **beam_kw),
        "beam_no_cache": beam_search(model, prompts[0], 3, 8, use_cache=False, **beam_kw),
    }


def _cli(rank, world_size, ckpt, flags):
    buf = io.StringIO()
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
    with contextlib.redirect_stdout(buf):
        assert generate.main(["--load", ckpt, "--json", *flags], environ=env) == 0
    return buf.getvalue()


def _layout_worker(rank, world_size, ckpts, tp, cli_flags):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
    pp = world_size // tp
    out = {}
    for name, ckpt in ckpts.items():
        model, _, _, rt = load_model_tp(ckpt, tp, rank, rank, env, pp_size=pp)
        assert (rt.ps.tp_size, rt.ps.pp_size) == (tp, pp)
        out[name] = _decode(model)
        out[name]["layers_here"] = len(model.language_model.encoder.layers)
    flags = ("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
             str(pp))
    out["cli"] = [_cli(rank, world_size, ckpts["gpt2"], (*flags, *f)) for f in cli_flags]
    return out


GREEDY = ("--prompt", "5 6 7", "--max-new-tokens", "10", "--greedy", "--no-stop-at-eod")


def _cli_flags(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("5 6 7\n9\n1 2 3 4 5 6\n")
    return [GREEDY, ("--prompt-file", str(prompts), "--max-new-tokens", "6",
                     "--temperature", "1.5", "--seed", "3", "--no-stop-at-eod")]


def _check_layout(results, ckpts, cli_flags):
    world = len(results)
    for name, ckpt in ckpts.items():
        model, _, _ = generate.load_model(ckpt)
        want = _decode(model)
        layers = model.config.num_layers
        for rank, got in enumerate(results):
            got = got[name]
            assert got["layers_here"] == layers // 2, (name, rank)  # this stage's only
            scale = want["full"].abs().max()
            for key in ("cached", "full"):
                err = float((got[key] - want["full"]).abs().max() / scale)
                assert err < 1e-5, (name, rank, key, err)
            for key in ("greedy", "sampled", "past_max", "no_cache", "batch",
                        "batch_sampled"):
                assert got[key] == want[key], (name, rank, key)
            for g, w in zip(got["logprobs"], want["logprobs"]):
                assert g == pytest.approx(w, abs=1e-5), (name, rank)
            assert len(want["beam"]) == 3 and any(len(ids) < 8 for ids, _ in want["beam"])
            for key in ("beam", "beam_no_cache"):
                assert [i for i, _ in got[key]] == [i for i, _ in want["beam"]], (name, key)
                assert [s for _, s in got[key]] == pytest.approx(
                    [s for _, s in want["beam"]], abs=1e-5)
    assert len(want["past_max"]) == 12 and len(PROMPTS[2]) + 12 > 16  # the window path
    for flags, printed in zip(cli_flags, results[0]["cli"]):
        alone = [json.loads(line) for line in
                 _cli(0, 1, ckpts["gpt2"], flags).splitlines()]
        assert [json.loads(line) for line in printed.splitlines()] == alone, flags
    assert all(r["cli"] == [""] * len(cli_flags) for r in results[1:]), world  # rank 0 prints


def test_pp2_generates_as_one_process(ckpts, tmp_path):
    cli_flags = _cli_flags(tmp_path)
    results = run_distributed(_layout_worker, 2, ckpts, 1, cli_flags)
    _check_layout(results, ckpts, cli_flags)


@pytest.mark.slow
def test_tp2_pp2_generates_as_one_process(ckpts, tmp_path):
    cli_flags = _cli_flags(tmp_path)
    results = run_distributed(_layout_worker, 4, ckpts, 2, cli_flags)
    _check_layout(results, ckpts, cli_flags)


# -------------------------------------------------------------------------- server
def _serve_worker(rank, world_size, ckpt, port, pid_dir):
    return serve_worker(rank, world_size, ckpt, port, pid_dir,
                        layout=("--pipeline-model-parallel-size", "2"))


def test_server_at_pp2(ckpts, tmp_path):
    from tools.text_generation_api import parse_request, run_request
    from tools.text_generation_cli import put

    ckpt = ckpts["llama"]
    with two_rank_server(_serve_worker, ckpt, tmp_path) as url:
        a, ns, explicit = server_mod.parse_args(["--load", ckpt])
        engine, _ = server_mod.build_engine(a, ns, explicit, environ={})
        for body in ({"prompts": ["5 6 7", "9 8 7 6 5"], "tokens_to_generate": 8,
                      "temperature": 1.5, "random_seed": 3, "logprobs": True},
                     {"prompts": ["5 6 7"], "beam_width": 3, "tokens_to_generate": 6}):
            status, text = put(url, body, timeout=60)
            assert status == 200, text
            got, want = json.loads(text), run_request(engine, parse_request(body))
            assert set(got) == set(want) and got["text"] == want["text"], body
            for key in ("logprobs", "scores"):
                for g, w in zip(got.get(key, []), want.get(key, [])):
                    assert g == pytest.approx(w, abs=1e-5), key
        status, text = put(url, {"prompts": ["5 999"]}, timeout=60)  # 400, ranks in step
        assert status == 400 and "outside the vocabulary" in text


def test_one_stage_wrapper_is_the_model():
    """PipelineGPT over a one-stage pipeline (no process group) decodes as the model it
    wraps; a stage whose ends do not match its pipeline rank is refused."""
    from megatron.core.models.gpt.pipeline_decode import PipelineGPT
    from megatron.core.parallel_state import ParallelState
    from tests.test_kv_cache import _model, _tokens

    model = _model("llama")
    wrapped = PipelineGPT(model, ParallelState.build()).eval()
    ids = _tokens(12)
    with torch.no_grad():
        assert torch.equal(wrapped(ids), model(ids))
    assert generate.generate(wrapped, [4, 9, 1], 6, greedy=True) == \
        generate.generate(model, [4, 9, 1], 6, greedy=True)
    ps = ParallelState.build(world_size=2, rank=1, pp_size=2, create_groups=False)
    with pytest.raises(ValueError, match="pipeline rank 1 of 2 needs a stage"):
        PipelineGPT(model, ps)  # the whole model on the last stage


# ------------------------------------------------------------------------ refusals
def test_layouts_generation_does_not_run(ckpts, capsys):
    check_generation_layout("x", 2, 1, 2)
    check_generation_layout("x", 8, 2, 4)
    check_generation_layout("x", 1, 1, 1, vpp_layers=2)  # no effect at pp 1
    check_generation_layout("x", 4, 1, 2)  # 2 data-parallel replicas
    with pytest.raises(SystemExit, match="world size 3 with --tensor-model-parallel-size 1 x "
                                         "--pipeline-model-parallel-size 2 = 2: the world "
                                         "size must be a multiple of 2.*--nproc-per-node 2"):
        check_generation_layout("x", 3, 1, 2)
    with pytest.raises(SystemExit, match="--num-layers-per-virtual-pipeline-stage 1: "
                                         "generation runs one model chunk per pipeline stage"):
        check_generation_layout("x", 2, 1, 2, vpp_layers=1)
    env = {"RANK": "0", "WORLD_SIZE": "3"}  # under torchrun rank 0 prints the error
    with pytest.raises(SystemExit):
        generate.main(["--load", ckpts["gpt2"], "--prompt", "5",
                       "--pipeline-model-parallel-size", "2"], environ=env)
    assert ("world size 3 with --tensor-model-parallel-size 1 x --pipeline-model-parallel-size "
            "2 = 2") in capsys.readouterr().err
    with pytest.raises(SystemExit):
        server_mod.main(["--load", ckpts["gpt2"], "--pipeline-model-parallel-size", "2",
                         "--num-layers-per-virtual-pipeline-stage", "1"],
                        environ={"RANK": "0", "WORLD_SIZE": "2"})
    assert "--num-layers-per-virtual-pipeline-stage 1" in capsys.readouterr().err
    # 2 layers over 3 stages: refused before any process group, rank 0 prints why
    with pytest.raises(SystemExit):
        generate.main(["--load", ckpts["gpt2"], "--prompt", "5",
                       "--pipeline-model-parallel-size", "3"],
                      environ={"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0"})
    assert "2 layers do not split evenly over 3 stages" in capsys.readouterr().err
    assert "split over 2 pipeline stages" in graph_reason(SimpleNamespace(pp_size=2))
