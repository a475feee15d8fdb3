"""The whole GPT training step under TP, SP and DP equals the single-process run.

Each layout trains the same tiny model (built with --use-cpu-initialization, so every TP
size starts from the TP=1 weights) for a few iterations on the same mock samples. Losses of
every iteration and the full gradients of the last one must match the single-process
reference. Tolerance: fp32 with a different reduction order -> rtol 1e-5 on losses,
max abs diff <= 1e-5 * (1 + max|g|) on gradients.
"""
from __future__ import annotations

import pytest
import torch

from megatron.core.parallel_state import ParallelState
from megatron.core.tensor_parallel.random import RNGStatesTracker
from megatron.initialize import Runtime, set_random_seed
from megatron.training import build_trainer, data_iterator, train_step
from tests.dist_utils import run_distributed
from tests.gpt_helpers import full_named_grads, tiny_config

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


def _reference(model_kw):
    return _train(0, 1, 1, False, model_kw)


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
