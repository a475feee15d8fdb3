"""The whole GPT training step under TP, SP and DP equals the single-process run; the
model-shaping settings and the initial weights at tp=2 follow Megatron-LM 23.05.

Each layout trains the same tiny model (built with --use-cpu-initialization, so every TP
size starts from the TP=1 weights) for a few iterations on the same mock samples. Losses of
every iteration and the full gradients of the last one must match the single-process
reference. Tolerance: fp32 with a different reduction order -> rtol 1e-5 on losses,
max abs diff <= 1e-5 * (1 + max|g|) on gradients.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.core.config import ModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.layers import shard_of_full_weight
from megatron.core.tensor_parallel.random import (
    RNGStatesTracker,
    get_rng_tracker,
    model_parallel_seed,
    set_rng_tracker,
)
from megatron.initialize import Runtime, set_random_seed
from megatron.train_step import forward_backward
from megatron.training import build_trainer, data_iterator, train_step
from tests.dist_utils import run_distributed
from tests.gpt_helpers import full_named_grads, full_tensor, gloo_trainer_losses, tiny_config
from tests.gpt_reference import case_batch, case_config, perturb_, reference_forward
from tests.test_gpt_model import INIT_CASES, INIT_SHAPE, check_init

LLAMA = dict(normalization="RMSNorm", activation="swiglu", ffn_hidden_size=48,
             position_embedding_type="rope", num_query_groups=2, add_bias_linear=False,
             untie_embeddings_and_output_weights=True)


def _train(rank, world_size, tp, sp, model_kw, iters=3, lr=1e-3):
    torch.manual_seed(0)
    cfg = tiny_config(world_size=world_size, tp=tp, sp=sp, iters=iters, lr=lr, **model_kw)
    ps = ParallelState.build(world_size, rank, tp_size=tp, sequence_parallel=sp)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    data = data_iterator(cfg, rt, "train", 0)
    losses = []
    for _ in range(iters):
        loss, ok, norm, _ = train_step(tr, data)
        assert ok
        losses.append(float(loss))
    return {"losses": losses, "grads": full_named_grads(tr.model.module, ps.tp_group)}


REFERENCE = {}


def _reference(model_kw):
    """The single-process run of `model_kw`, once per module (the tests only read it)."""
    key = repr(model_kw)
    if key not in REFERENCE:
        REFERENCE[key] = _train(0, 1, 1, False, model_kw)
    return REFERENCE[key]


def _compare(ref, got, what):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0, msg=f"{what}: losses differ")
    assert set(got["grads"]) == set(ref["grads"]), f"{what}: parameter names differ"
    for name, g in ref["grads"].items():
        diff = (got["grads"][name] - g).abs().max().item()
        assert diff <= 1e-5 * (1 + g.abs().max().item()), f"{what}: grad of {name} off by {diff}"


@pytest.mark.parametrize("world,tp,sp", [(2, 2, False), (2, 1, False), (4, 4, True), (4, 2, True)])
def test_gpt_matches_single_process(world, tp, sp):
    ref = _reference({})
    results = run_distributed(_train, world, tp, sp, {})
    for rank, got in enumerate(results):
        _compare(ref, got, f"world={world} tp={tp} sp={sp} rank={rank}")


def test_llama_style_gpt_tp2_sp_matches_single_process():
    ref = _reference(LLAMA)
    for rank, got in enumerate(run_distributed(_train, 2, 2, True, LLAMA)):
        _compare(ref, got, f"llama-style tp=2 sp rank={rank}")


def _dropout_draws(rank, world_size, sp):
    """One training forward/backward at tp 2 with dropout on: each hidden dropout's mask
    (F.dropout: embeddings, then attention and MLP outputs of each layer) and the generator
    state each attention dropout (inside scaled_dot_product_attention) draws from."""
    cfg = tiny_config(world_size=2, tp=2, sp=sp, hidden_dropout=0.5, attention_dropout=0.5)
    ps = ParallelState.build(2, rank, tp_size=2, sequence_parallel=sp)
    rt = Runtime(ps=ps, device=torch.device("cpu"), rng_tracker=RNGStatesTracker(), backend="gloo")
    set_random_seed(cfg.training.seed, rt)
    tr = build_trainer(cfg, rt)
    hidden, attention = [], []
    dropout, sdpa = F.dropout, F.scaled_dot_product_attention

    def recording_dropout(x, p=0.5, training=True, inplace=False):
        out = dropout(x, p, training, inplace)
        hidden.append(out == 0)
        return out

    def recording_sdpa(*args, dropout_p=0.0, **kw):
        if dropout_p > 0:
            attention.append(torch.get_rng_state())
        return sdpa(*args, dropout_p=dropout_p, **kw)

    F.dropout, F.scaled_dot_product_attention = recording_dropout, recording_sdpa
    try:
        forward_backward(tr, data_iterator(cfg, rt, "train", 0), 1)
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout, sdpa
    return hidden, attention


@pytest.mark.parametrize("sp", [False, True])
def test_dropout_streams_across_tp_ranks_follow_megatron(sp):
    """Megatron's seeding: the default generator gets --seed on every TP rank, the
    tensor-parallel tracker seed + 2718 + tp_rank. Attention dropout (each rank holds other
    heads) draws from the tracker: other masks per rank; its first draw is from the
    freshly seeded stream (the weights are built with --use-cpu-initialization).
    Hidden dropout on the replicated [s, b, h] stream draws from the default generator:
    the same masks on both ranks -- unless sequence parallelism splits the stream over
    the ranks, when it draws from the tracker too (Megatron forks around the layers and
    the embedding dropout): other masks per rank."""
    (hidden0, attn0), (hidden1, attn1) = run_distributed(_dropout_draws, 2, sp)
    assert len(hidden0) == len(hidden1) == 5 and len(attn0) == len(attn1) == 2
    for i, (a, b) in enumerate(zip(hidden0, hidden1)):
        assert torch.equal(a, b) != sp, f"hidden dropout {i} (sequence parallel: {sp})"
        assert 0.3 < a.float().mean() < 0.7
    for i, (a, b) in enumerate(zip(attn0, attn1)):
        assert not torch.equal(a, b), f"attention dropout {i} drew the same stream on both ranks"
    if not sp:  # the embedding dropout used the default generator: attention drew first
        for rank, states in enumerate((attn0, attn1)):
            fresh = torch.Generator().manual_seed(1234 + 2718 + rank).get_state()
            assert torch.equal(states[0], fresh), f"rank {rank}: not seed + 2718 + tp_rank"


RECOMPUTE = {
    "full-uniform": {"recompute_granularity": "full", "recompute_method": "uniform"},
    "full-block": {"recompute_granularity": "full", "recompute_method": "block",
                   "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective"},
}


def _recompute_runs(rank, world_size, tp, pp, sp, vpp):
    """Two training steps with dropout on, without recompute and with each kind: this
    rank's losses and full gradients (a virtual-pipeline chunk's names prefixed by it)."""
    out = {}
    for name, kw in {"none": {}, **RECOMPUTE}.items():
        cfg = tiny_config(world_size=world_size, tp=tp, pp=pp, sp=sp, iters=2, num_layers=4,
                          hidden_dropout=0.2, attention_dropout=0.2, **kw)
        cfg.parallel.virtual_pp_size = vpp
        ps = ParallelState.build(world_size, rank, tp_size=tp, pp_size=pp,
                                 virtual_pp_size=vpp, sequence_parallel=sp)
        tr, losses = gloo_trainer_losses(cfg, ps)
        grads = {f"{c}.{n}": g for c, m in enumerate(tr.model.unwrapped())
                 for n, g in full_named_grads(m, ps.tp_group).items()}
        out[name] = {"losses": losses, "grads": grads}
    return out


@pytest.mark.parametrize("tp,pp,sp,vpp", [(2, 1, False, None), (2, 1, True, None),
                                          (1, 2, False, 2)], ids=["tp2", "tp2-sp", "pp2-vpp2"])
def test_recompute_with_dropout_is_bit_identical_in_parallel_layouts(tp, pp, sp, vpp):
    """Full (uniform, block) and selective recompute replay every dropout mask -- the
    default generator's and the tensor-parallel tracker's, also when the pipeline
    schedule runs other micro-batches' forwards between a forward and its backward:
    losses and gradients on every rank equal the run without recompute, bit for bit."""
    for rank, got in enumerate(run_distributed(_recompute_runs, 2, tp, pp, sp, vpp)):
        ref = got["none"]
        for name in RECOMPUTE:
            assert got[name]["losses"] == ref["losses"], (rank, name)
            assert set(got[name]["grads"]) == set(ref["grads"])
            for param, g in ref["grads"].items():
                assert torch.equal(got[name]["grads"][param], g), (rank, name, param)


def test_loss_decreases_single_process():
    out = _train(0, 1, 1, False, {}, iters=30, lr=1e-2)
    assert out["losses"][-1] < out["losses"][0] - 0.3, out["losses"]


def test_rope_plus_learned_matches_single_process():
    """Megatron-LM 23.05's rotary + learned positions: the replicated position table and
    the rotated q, k under tp=2 with sequence parallelism equal the single process."""
    kw = dict(position_embedding_type="rope+learned", rotary_percent=0.5)
    ref = _reference(kw)
    assert "language_model.embedding.position_embeddings.weight" in ref["grads"]
    for rank, got in enumerate(run_distributed(_train, 2, 2, True, kw)):
        _compare(ref, got, f"rope+learned tp=2 sp rank={rank}")


# ------------------------------------------ model-shaping settings under tensor parallelism
TP2_CASES = ["tanh_gelu", "swiglu", "post_layernorm_residual", "layernorm_1p_eps", "untied",
             "rope_odd_dim", "kv_channels", "query_groups", "documents", "documents_rope"]


def _forward_cases(rank, world_size, sp):
    """Each case's per-token losses at tp=2 (sequence parallel or not), the weights the
    TP=1 model's, perturbed, then sharded; with the reference's for the same weights."""
    tp = torch.distributed.new_group(list(range(world_size)))
    out = {}
    for case in TP2_CASES:
        fields, reset = case_config(case)
        torch.manual_seed(0)
        full = GPTModel(ModelConfig(**fields))
        perturb_(full)
        model = GPTModel(ModelConfig(**fields, sequence_parallel=sp), tp_group=tp)
        sd = full.state_dict()
        with torch.no_grad():
            for name, p in model.named_parameters():
                w = sd[name]
                if getattr(p, "tensor_model_parallel", False):
                    w = shard_of_full_weight(w, p.partition_dim, p.partition_stride, rank,
                                             world_size)
                p.copy_(w)
        tokens, labels, pos, mask = case_batch(reset)
        got = model(tokens, position_ids=pos, labels=labels, attention_mask=mask)
        out[case] = (got.detach().double(),
                     reference_forward(sd, full.config, tokens, labels, pos, mask))
    return out


@pytest.mark.parametrize("sp", [False, True])
def test_settings_match_megatron_reference_at_tp2(sp):
    """tp=2, with and without sequence parallelism: the per-token losses of each setting
    equal the reference's (atol 2e-5), on both ranks."""
    for rank, results in enumerate(run_distributed(_forward_cases, 2, sp)):
        for case, (got, ref) in results.items():
            torch.testing.assert_close(got, ref, rtol=0, atol=2e-5,
                                       msg=f"{case} sp={sp} rank={rank}")


def _initial_weights(rank, world_size, kw, cpu_init):
    tp = torch.distributed.new_group(list(range(world_size)))
    cfg = ModelConfig(**INIT_SHAPE, **kw, use_cpu_initialization=cpu_init)
    tracker = RNGStatesTracker()
    model_parallel_seed(1234, rank, tracker)
    torch.manual_seed(1234)
    model = GPTModel(cfg, tp_group=tp, rng_tracker=tracker)
    return {name: full_tensor(p, p, tp) for name, p in model.named_parameters()}


@pytest.mark.parametrize("cpu_init", [True, False])
@pytest.mark.parametrize("kw", INIT_CASES)
def test_initial_weights_at_tp2(kw, cpu_init):
    """At tp=2 the assembled weights follow the TP=1 distributions of every group
    (test_gpt_model.expected_init: the same std, and Xavier's bound from the full weight's
    fans, not the shard's), whether each shard is drawn in place (then the shards differ,
    as Megatron's per-rank model-parallel seeds draw them) or cut from the full CPU draw.
    Both ranks assemble the same weights (replicated ones drawn alike)."""
    cfg = ModelConfig(**INIT_SHAPE, **kw)
    ranks = run_distributed(_initial_weights, 2, kw, cpu_init)
    for name, w in ranks[0].items():
        assert torch.equal(w, ranks[1][name]), name
        check_init(name, w, cfg)


def _default_tracker_draws(rank, world_size):
    """Losses of one training-mode forward at tp 2 (attention dropout, and hidden dropout
    under sequence parallelism) of a model built without `rng_tracker`, and of the same
    model built with the process-wide default tracker passed explicitly; and the generator
    state the first attention dropout drew from in the first."""
    ps = ParallelState.build(2, rank, tp_size=2, sequence_parallel=True)
    set_rng_tracker(RNGStatesTracker("cpu"))
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                      padded_vocab_size=64, seq_length=8, max_position_embeddings=8,
                      attention_dropout=0.5, hidden_dropout=0.5, sequence_parallel=True)
    tokens, labels = (torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(s))
                      for s in (1, 2))
    draws, sdpa = [], F.scaled_dot_product_attention

    def recording_sdpa(*args, dropout_p=0.0, **kw):
        draws.append(torch.get_rng_state())
        return sdpa(*args, dropout_p=dropout_p, **kw)

    losses = []
    for tracker in (None, get_rng_tracker()):
        model_parallel_seed(1234, rank)  # Megatron's way: the default tracker
        model = GPTModel(cfg, tp_group=ps.tp_group, rng_tracker=tracker, device="cpu")
        F.scaled_dot_product_attention = recording_sdpa
        try:
            losses.append(model(tokens, labels=labels))
        finally:
            F.scaled_dot_product_attention = sdpa
    return losses, draws[0]


def test_model_without_a_tracker_draws_tp_dropout_from_the_default_tracker():
    """rng_tracker=None means the process-wide tracker (random.get_rng_tracker), for the
    dropout as for the weights: each TP rank draws its own attention (and sequence-parallel
    hidden) dropout masks, as with the tracker passed; not the default generator's, the
    same on both ranks (heads of one rank dropped like those of the other)."""
    (losses0, draw0), (losses1, draw1) = run_distributed(_default_tracker_draws, 2)
    for rank, (implicit, explicit) in enumerate((losses0, losses1)):
        assert torch.equal(implicit, explicit), f"rank {rank}: None is not the default tracker"
    assert not torch.equal(draw0, draw1), "attention dropout drew the same stream on both ranks"
