"""--distribute-saved-activations: with full recompute and tp > 1, each tensor-parallel rank
keeps 1/tp of every recomputed layer's input until backward.

Correctness: with dropout on, a TP=2 training step with full recompute and distributed
inputs gives the same losses as full recompute alone and as no recompute (bit-identical:
the gathered input is the saved one, and dropout masks are replayed), and the same
gradients. Memory: what autograd saves per rank matches the estimate, which counts the
layer inputs divided by tp.
"""
from __future__ import annotations

import pytest
import torch

from megatron.core.parallel_state import ParallelState
from megatron.memory_estimate import activation_bytes
from tests.dist_utils import run_distributed
from tests.gpt_helpers import full_named_grads, gloo_trainer_losses, tiny_config
from tests.test_arguments import error_of, run
from tests.test_memory_estimate import _case_config, _expected_saved, _saved_bytes

RECOMPUTE = {
    "none": {},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform"},
    "distributed": {"recompute_granularity": "full", "recompute_method": "uniform",
                    "distribute_saved_activations": True},
    "distributed-block": {"recompute_granularity": "full", "recompute_method": "block",
                          "recompute_num_layers": 1, "distribute_saved_activations": True},
}


def _train_tp2(rank, world_size):
    out = {}
    for name, kw in RECOMPUTE.items():
        torch.manual_seed(0)
        cfg = tiny_config(world_size=2, tp=2, iters=2, hidden_dropout=0.2,
                          attention_dropout=0.2, seq_length=15, **kw)  # s*b*h odd: padding
        ps = ParallelState.build(2, rank, tp_size=2)
        tr, losses = gloo_trainer_losses(cfg, ps)
        out[name] = {"losses": losses, "grads": full_named_grads(tr.model.module, ps.tp_group)}
    return out


def test_tp2_distributed_inputs_give_the_same_losses_and_grads_as_no_recompute():
    for rank, got in enumerate(run_distributed(_train_tp2, 2)):
        ref = got["none"]
        for name in ("full", "distributed", "distributed-block"):
            assert got[name]["losses"] == ref["losses"], (rank, name)
            for param, g in ref["grads"].items():
                torch.testing.assert_close(got[name]["grads"][param], g, rtol=0, atol=1e-6,
                                           msg=f"rank {rank} {name}: grad of {param}")


def _saved_worker(rank, world_size, distribute):
    from megatron.core.models.gpt.gpt_model import GPTModel

    ps = ParallelState.build(world_size=2, rank=rank, tp_size=2)
    cfg = _case_config("gpt", recompute_granularity="full", recompute_method="uniform",
                       distribute_saved_activations=distribute)
    cfg.parallel.tp_size = 2
    torch.manual_seed(0)
    model = GPTModel(cfg.model, tp_group=ps.tp_group)
    tokens, labels = torch.randint(0, 256, (2, 128)), torch.randint(0, 256, (2, 128))
    no_recompute = _case_config("gpt")
    no_recompute.parallel.tp_size = 2
    rebuilt = activation_bytes(no_recompute, 1)  # the estimate's layer rebuilt in backward
    return _saved_bytes(model, tokens, labels), _expected_saved(cfg, 2) - rebuilt


@pytest.mark.parametrize("distribute", [False, True])
def test_saved_bytes_per_rank_match_the_estimate(distribute):
    results = run_distributed(_saved_worker, 2, distribute)
    for got, expected in results:
        assert got == pytest.approx(expected, rel=1e-9)
    if distribute:  # two layers' inputs of s*b*h fp32 each, halved
        plain = run_distributed(_saved_worker, 2, False)[0][0]
        assert plain - results[0][0] == 2 * 128 * 2 * 64 * 4 // 2


def test_cli_needs_tensor_parallel_and_full_recompute():
    msg = error_of("--distribute-saved-activations --recompute-granularity full "
                   "--recompute-method uniform")
    assert "--distribute-saved-activations needs --tensor-model-parallel-size > 1" in msg
    cfg = run("--distribute-saved-activations --recompute-granularity full "
              "--recompute-method block --recompute-num-layers 2 "
              "--tensor-model-parallel-size 2", world_size=2)
    assert cfg.model.distribute_saved_activations
    assert cfg.model.recompute_method == "block"


def test_cli_error_names_what_the_run_has_instead():
    msg = error_of("--distribute-saved-activations --recompute-activations "
                   "--tensor-model-parallel-size 2", world_size=2)
    assert ("this run has --recompute-granularity selective (from --recompute-activations)"
            in msg), msg
    assert "--tensor-model-parallel-size 1" not in msg
    msg = error_of("--distribute-saved-activations --recompute-granularity full "
                   "--recompute-method uniform")
    assert "this run has --tensor-model-parallel-size 1:" in msg, msg


def test_cli_warns_that_sequence_parallel_leaves_it_nothing_to_do(caplog):
    run("--distribute-saved-activations --recompute-granularity full --recompute-method "
        "uniform --tensor-model-parallel-size 2 --sequence-parallel", world_size=2)
    assert "--distribute-saved-activations has no effect with --sequence-parallel" in caplog.text


def _warnings_worker(rank, world_size):
    import warnings

    from megatron.core.tensor_parallel.random import checkpoint_distributed_input

    ps = ParallelState.build(2, rank, tp_size=2)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint_distributed_input(layer, x, group=ps.tp_group).sum().backward()
    return [str(w.message) for w in caught], x.grad


def test_backward_all_gather_raises_no_deprecation_warning():
    """torch 2.13 deprecates all_gather_into_tensor: every rank printed a FutureWarning
    into the training log at the first backward with --distribute-saved-activations."""
    for messages, grad in run_distributed(_warnings_worker, 2):
        assert not [m for m in messages if "deprecated" in m], messages
        assert grad is not None
