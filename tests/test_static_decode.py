"""The static one-token decode step (megatron/core/models/gpt/static_decode.py) against the
dynamic cached path (kv_cache.forward_incremental): for tiny random models of each variant
(learned positions, rotary, GQA / MQA, post-LN) and a batch of 3 rows, a prefill plus
static steps give forward_incremental's logits (fp32: within 2e-6 of the largest logit)
and keep the device position equal to the host length; greedy and seeded tokens of
`generate` / `generate_batch` through a StaticDecoder equal those without one over 20 and
more steps; the decoder reuses its cache for the same batch size and allocates a new one
otherwise; --decode-cuda-graph in generate.py and the server (`on` refused by name on the
CPU); on tp = 2 gloo ranks the static step equals the one-process logits. On CUDA
(marked `cuda`) the captured graph's replays equal the eager static step, and a new
request of the same shape reuses the graph."""
from __future__ import annotations

import pytest
import torch

from megatron.core.models.gpt.kv_cache import KVCache, forward_incremental
from megatron.core.models.gpt.static_decode import (
    StaticDecoder,
    capacity_for,
    experts_reason,
    forward_static,
)
from tests.test_kv_cache import MAX_POS, VARIANTS, _model
from tools import generate

PROMPTS = ([4, 9, 1, 30], [7, 2], [3, 3, 8, 2, 11, 5])
TOL = 2e-6  # of the largest logit: masked attention over every slot vs over the filled ones


def _batch_ids(b: int = 3, n: int = MAX_POS, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (b, n), generator=torch.Generator().manual_seed(seed))


def _static_vs_dynamic(model, ids: torch.Tensor, prefill: int, decoder: StaticDecoder):
    """(static logits, dynamic logits) [b, steps, V] of a prefill then one-token steps."""
    b, n = ids.shape
    ref = KVCache(model.config.num_layers, n)
    cache = decoder.new_cache(b, n)
    forward_incremental(model, ids[:, :prefill], ref)
    forward_incremental(model, ids[:, :prefill], cache)
    assert int(cache.position) == cache.length == prefill
    dyn, sta = [], []
    for i in range(prefill, n):
        dyn.append(forward_incremental(model, ids[:, i:i + 1], ref))
        sta.append(decoder.step(ids[:, i:i + 1]))
    assert int(cache.position) == cache.length == n
    return torch.cat(sta, 1), torch.cat(dyn, 1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_static_step_equals_the_dynamic_path(variant):
    model = _model(variant)
    decoder = StaticDecoder(model, graphed=False)
    for prefill in (1, 5):
        static, dynamic = _static_vs_dynamic(model, _batch_ids(), prefill, decoder)
        assert static.shape == dynamic.shape == (3, MAX_POS - prefill, 128)
        err = float((static - dynamic).abs().max() / dynamic.abs().max())
        assert err < TOL, (variant, prefill, err)


def _switch_mlps(model):
    from megatron.core.models.gpt.transformer import SwitchMLP

    return [m for m in model.modules() if isinstance(m, SwitchMLP)]


@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_static_step_with_experts_equals_the_dynamic_path(variant, dispatch):
    """Mixture-of-experts layers (4 experts, top-1) in the static step: the same logits
    and greedy tokens as the dynamic path, through either dispatch."""
    model = _model(variant, num_experts=4)
    mlps = _switch_mlps(model)
    assert len(mlps) == model.config.num_layers
    for m in mlps:
        m.dispatch = dispatch
    decoder = StaticDecoder(model, graphed=False)
    static, dynamic = _static_vs_dynamic(model, _batch_ids(), 5, decoder)
    err = float((static - dynamic).abs().max() / dynamic.abs().max())
    assert err < TOL, (variant, dispatch, err)
    prompts = [list(p) for p in PROMPTS]
    assert generate.generate_batch(model, prompts, 12, greedy=True, decoder=decoder) == \
        generate.generate_batch(model, prompts, 12, greedy=True)


def test_experts_keep_the_step_out_of_a_graph_only_with_the_loop_dispatch():
    """The grouped dispatch (host-free here, on the CPU) leaves the step capturable; the
    loop dispatch counts tokens on the host, and the reason says so."""
    model = _model("llama", num_experts=4)
    assert experts_reason(_model("llama")) is None
    assert experts_reason(model) is None
    _switch_mlps(model)[1].dispatch = "loop"
    assert experts_reason(model).startswith(
        "the model's 4 experts per layer dispatch tokens through a loop that counts them "
        "on the host")


def test_static_step_from_position_zero():
    """Without a prefill: the first token alone attends only to itself."""
    model = _model("llama")
    ids = _batch_ids(n=3)
    cache = StaticDecoder(model, graphed=False).new_cache(3, 8)
    ref = KVCache(model.config.num_layers, 8)
    for i in range(3):
        got = forward_static(model, ids[:, i:i + 1], cache)
        want = forward_incremental(model, ids[:, i:i + 1], ref)
        torch.testing.assert_close(got, want, rtol=0, atol=TOL * want.abs().max())


@pytest.mark.parametrize("variant", ["gpt2", "llama", "tied-postln"])
def test_generation_through_the_decoder_gives_the_same_tokens(variant):
    model = _model(variant)
    decoder = StaticDecoder(model, graphed=False)
    prompts = [list(p) for p in PROMPTS]
    for new in (3, 17):  # 17: the longest prompt's 6 + 17 - 1 = 22 of 24 positions
        want = generate.generate_batch(model, prompts, new, greedy=True, vocab_limit=100)
        got = generate.generate_batch(model, prompts, new, greedy=True, vocab_limit=100,
                                      decoder=decoder)
        assert got == want and len(got[0]) == new, (variant, new)
    for new in (20, 30):  # 30: past the 24 positions, where the window is recomputed
        want = generate.generate(model, PROMPTS[0], new, greedy=True)
        assert generate.generate(model, PROMPTS[0], new, greedy=True, decoder=decoder) == want
    gens = lambda: [torch.Generator().manual_seed(7 + i) for i in range(3)]  # noqa: E731
    sampled = {d is None: generate.generate_batch(model, prompts, 12, temperature=1.0, top_k=20,
                                                  generators=gens(), decoder=d)
               for d in (None, decoder)}
    assert sampled[True] == sampled[False]


def test_generation_runs_the_static_step(monkeypatch):
    """After the prefill every token is one static step of all rows (the dynamic path
    runs the prefill only)."""
    model = _model("llama")
    decoder = StaticDecoder(model, graphed=False)
    steps, dynamic = [], []
    real_step, real_dyn = decoder.step, generate.forward_incremental
    monkeypatch.setattr(decoder, "step", lambda t: steps.append(tuple(t.shape)) or real_step(t))
    monkeypatch.setattr(generate, "forward_incremental", lambda m, ids, c, **kw:
                        dynamic.append(ids.shape[1]) or real_dyn(m, ids, c, **kw))
    generate.generate_batch(model, [list(p) for p in PROMPTS], 5, greedy=True, decoder=decoder)
    assert dynamic == [2] and steps == [(3, 1)] * (6 + 5 - 1 - 2)


def test_decoder_reuses_its_cache():
    model = _model("gpt2")
    decoder = StaticDecoder(model, graphed=False)
    cache = decoder.new_cache(3, 10)
    assert cache.max_len == 24  # capacity_for(10, 24): 64 capped at the model's 24
    forward_incremental(model, _batch_ids(n=4), cache)
    keys = cache.keys[0]
    assert decoder.new_cache(3, 20) is cache  # same batch size, fits: reset, reused
    assert cache.length == 0 and int(cache.position) == 0 and cache.keys[0] is keys
    assert not keys.any()  # nothing of the last batch is left
    assert decoder.new_cache(2, 10) is not cache  # another batch size: a new cache
    assert capacity_for(10, 2048) == 64 and capacity_for(65, 2048) == 128
    assert capacity_for(128, 2048) == 128 and capacity_for(1500, 2048) == 2048
    assert capacity_for(3000, 100000) == 4096


def test_modes_and_refusals():
    model = _model("gpt2")
    assert StaticDecoder.for_mode(model, "off") is None
    assert StaticDecoder.for_mode(model, "auto") is None  # the CPU: no graph
    with pytest.raises(ValueError, match="--decode-cuda-graph on: .*it needs CUDA"):
        StaticDecoder.for_mode(model, "on")
    with pytest.raises(ValueError, match="use one of auto, on, off"):
        StaticDecoder.for_mode(model, "yes")
    with pytest.raises(SystemExit, match="needs the key/value cache"):
        generate.build_decoder(model, "on", use_cache=False)
    with pytest.raises(SystemExit, match="generate.py: error: --decode-cuda-graph on"):
        generate.build_decoder(model, "on")
    decoder = StaticDecoder(model, graphed=False)
    cache = decoder.new_cache(1, 24)
    with pytest.raises(ValueError, match="one token per row"):
        decoder.step(_batch_ids(1, 2))
    with pytest.raises(ValueError, match="a position tensor"):
        forward_static(model, _batch_ids(1, 1), KVCache(2, 4))
    forward_incremental(model, _batch_ids(1, 24), cache)
    with pytest.raises(ValueError, match="1 new token after 24 cached positions makes 25"):
        decoder.step(_batch_ids(1, 1))
    with pytest.raises(ValueError, match="a cache of 25 positions: the model has 24"):
        decoder.new_cache(1, 25)


# ------------------------------------------------------------------------ command lines
def test_the_flag_in_generate_py_and_the_server(tmp_path):
    """--decode-cuda-graph: `on` without CUDA (or with --no-kv-cache) is an error naming
    why; auto on the CPU and off give the eager path's text; the server's engine keeps
    the decoder (none here)."""
    from tests.test_generate import _run_cli, _train
    from tools import run_text_generation_server as server_mod

    _train(tmp_path)
    flags = ("--load", str(tmp_path), "--prompt-ids", "5,6,7", "--max-new-tokens", "8",
             "--greedy", "--device", "cpu")
    auto = _run_cli(*flags)
    assert _run_cli(*flags, "--decode-cuda-graph", "off") == auto
    with pytest.raises(SystemExit, match="generate.py: error: --decode-cuda-graph on: the "
                                         "decode step cannot be captured: it needs CUDA"):
        _run_cli(*flags, "--decode-cuda-graph", "on")
    with pytest.raises(SystemExit):  # argparse: needs the key/value cache
        generate.parse_args([*flags, "--no-kv-cache", "--decode-cuda-graph", "on"])
    for mode in ("auto", "off"):
        a, ns, explicit = server_mod.parse_args(["--load", str(tmp_path), "--device", "cpu",
                                                 "--decode-cuda-graph", mode])
        assert server_mod.build_engine(a, ns, explicit, environ={})[0].decoder is None
    a, ns, explicit = server_mod.parse_args(["--load", str(tmp_path), "--device", "cpu",
                                             "--decode-cuda-graph", "on"])
    with pytest.raises(SystemExit, match="run_text_generation_server.py: error: "
                                         "--decode-cuda-graph on: .*needs CUDA"):
        server_mod.build_engine(a, ns, explicit, environ={})


# ------------------------------------------------------------------ tensor parallelism
def _tp_worker(rank, world_size, variants):
    from tests.test_generate_tp import _tp_shard

    out = {}
    for variant in variants:
        full = _model(variant)
        model = _tp_shard(full, world_size)
        ids = _batch_ids()
        ref = KVCache(full.config.num_layers, MAX_POS)
        forward_incremental(full, ids[:, :5], ref)
        want = torch.cat([forward_incremental(full, ids[:, i:i + 1], ref)
                          for i in range(5, MAX_POS)], 1)
        decoder = StaticDecoder(model, graphed=False)
        cache = decoder.new_cache(3, MAX_POS)
        forward_incremental(model, ids[:, :5], cache)
        got = torch.cat([decoder.step(ids[:, i:i + 1]) for i in range(5, MAX_POS)], 1)
        out[variant] = {"got": got, "want": want,
                        "auto": StaticDecoder.for_mode(model, "auto")}
    return out


def test_tp2_static_step_equals_tp1():
    """gpt2 (learned positions) and llama (rotary, one query group per rank) on 2 gloo
    ranks: the static step's logits equal the one-process dynamic path's within 1e-5 of
    the largest (fp32; the row-parallel all-reduce sums in another order) and are the same
    tensor on both ranks; gloo gets no graph."""
    from tests.dist_utils import run_distributed

    variants = ("gpt2", "llama")
    results = run_distributed(_tp_worker, 2, variants)
    for variant in variants:
        r0, r1 = results[0][variant], results[1][variant]
        err = float((r0["got"] - r0["want"]).abs().max() / r0["want"].abs().max())
        assert err < 1e-5, (variant, err)
        assert torch.equal(r0["got"], r1["got"]), variant
        assert r0["auto"] is None


# ------------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant,dtype,experts", [
    ("gpt2", torch.float32, None), ("llama", torch.float32, None),
    ("llama", torch.bfloat16, None), ("llama", torch.bfloat16, 4)])
def test_cuda_graph_replays_equal_the_eager_step(variant, dtype, experts):
    """Graph replays equal the eager static step; with experts (bf16, the grouped GEMM
    on sm90/sm100; other GPUs keep the loop dispatch and are skipped)."""
    model = _model(variant, dtype, num_experts=experts).cuda()
    if experts and experts_reason(model) is not None:
        pytest.skip(experts_reason(model))
    ids = _batch_ids().cuda()
    graphed = StaticDecoder.for_mode(model, "on")
    eager = StaticDecoder(model, graphed=False)
    for run in range(2):  # the second request of the same shape reuses the graph
        caches = [graphed.new_cache(3, MAX_POS), eager.new_cache(3, MAX_POS)]
        for cache in caches:
            forward_incremental(model, ids[:, :5], cache)
        got = torch.cat([graphed.step(ids[:, i:i + 1]) for i in range(5, MAX_POS)], 1)
        want = torch.cat([eager.step(ids[:, i:i + 1]) for i in range(5, MAX_POS)], 1)
        assert graphed.graph is not None and graphed.num_captures == 1, run
        assert caches[0].length == int(caches[0].position) == MAX_POS
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=0,
                                   atol=tol * want.float().abs().max())
    prompts = [list(p) for p in PROMPTS]
    assert generate.generate_batch(model, prompts, 10, greedy=True, decoder=graphed) == \
        generate.generate_batch(model, prompts, 10, greedy=True)
    assert graphed.num_captures == 1  # 3 rows, 15 positions: fits the captured cache
    generate.generate(model, PROMPTS[0], 10, greedy=True, decoder=graphed)
    assert graphed.num_captures == 2  # one row: captured again
