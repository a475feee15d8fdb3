"""--num-experts against the independent fp64 reference of Megatron-LM 23.05's GPT
(tests/gpt_reference.py: its SwitchMLP is every expert on every token, then the softmax
argmax expert's output, fc2 bias included, times its probability).

1. Numerics: per-token losses and the gradient of every parameter (router and experts
   included) of one step equal the reference's, at tensor-parallel size 1 and 2, in
   training and in evaluation mode (Megatron-LM 23.05 routes alike in both), with the
   grouped-GEMM and the loop dispatch. Tolerance: fp32 against fp64, atol 2e-5 on losses,
   max abs diff <= 1e-5 * (1 + max|g|) on gradients. The core refuses sequence
   parallelism with experts (the grouped dispatch gave wrong losses, the loop a crash).
"""
from __future__ import annotations

import pytest
import torch

from megatron.core.config import ModelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.transformer import SwitchMLP
from megatron.core.tensor_parallel.layers import shard_of_full_weight
from tests.dist_utils import run_distributed
from tests.gpt_helpers import full_named_grads
from tests.gpt_reference import case_batch, case_config, perturb_, reference_forward

CASES = ("experts", "experts_swiglu")
MODES = [(mode, dispatch) for mode in ("train", "eval") for dispatch in ("grouped", "loop")]


def _full_model(case: str, **extra) -> GPTModel:
    fields, _ = case_config(case, **extra)
    torch.manual_seed(0)
    model = GPTModel(ModelConfig(**fields))
    perturb_(model)  # the router too: the tokens spread over the experts
    return model


def _reference(sd: dict, cfg, tokens, labels):
    """(per-token losses [b, s], {name: grad of their mean}) of the fp64 reference."""
    leaves = {k: v.detach().double().requires_grad_() for k, v in sd.items()}
    losses = reference_forward(leaves, cfg, tokens, labels)
    losses.mean().backward()
    return losses.detach(), {k: v.grad for k, v in leaves.items()}


def _ours(model: GPTModel, mode: str, dispatch: str, tokens, labels, tp_group=None):
    switches = [m for m in model.modules() if isinstance(m, SwitchMLP)]
    assert len(switches) == model.config.num_layers
    for m in switches:
        m.dispatch = dispatch
    model.train(mode == "train")
    model.zero_grad(set_to_none=True)
    losses = model(tokens, labels=labels)
    losses.mean().backward()
    return losses.detach().double(), full_named_grads(model, tp_group)


def _check(got, want, what: str) -> None:
    (losses, grads), (ref_losses, ref_grads) = got, want
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=2e-5, msg=what)
    assert grads.keys() == ref_grads.keys(), what
    for name, g in grads.items():
        r = ref_grads[name]
        diff = (g.double() - r).abs().max().item()
        assert diff <= 1e-5 * (1 + r.abs().max().item()), f"{what}: {name} off by {diff}"
    routers = [n for n in grads if n.endswith("mlp.router.weight")]
    assert routers and all(grads[n].abs().sum() > 0 for n in routers), what


@pytest.mark.parametrize("case", CASES)
def test_losses_and_grads_equal_the_reference(case):
    full = _full_model(case)
    tokens, labels, _, _ = case_batch(False)
    want = _reference(full.state_dict(), full.config, tokens, labels)
    for mode, dispatch in MODES:
        _check(_ours(full, mode, dispatch, tokens, labels), want, f"{case} {mode} {dispatch}")


def _tp2_worker(rank, world):
    tp = torch.distributed.new_group(list(range(world)))
    out = {}
    for case in CASES:
        full = _full_model(case)
        sd = full.state_dict()
        model = GPTModel(full.config, tp_group=tp)
        with torch.no_grad():
            for name, p in model.named_parameters():
                w = sd[name]
                if getattr(p, "tensor_model_parallel", False):
                    w = shard_of_full_weight(w, p.partition_dim, p.partition_stride, rank, world)
                p.copy_(w)
        tokens, labels, _, _ = case_batch(False)
        for mode, dispatch in MODES:
            out[case, mode, dispatch] = _ours(model, mode, dispatch, tokens, labels, tp)
    return out


def test_losses_and_grads_equal_the_reference_at_tp2():
    tokens, labels, _, _ = case_batch(False)
    want = {}
    for case in CASES:
        full = _full_model(case)
        want[case] = _reference(full.state_dict(), full.config, tokens, labels)
    for rank, results in enumerate(run_distributed(_tp2_worker, 2)):
        for (case, mode, dispatch), got in results.items():
            _check(got, want[case], f"tp2 rank {rank} {case} {mode} {dispatch}")



def test_the_core_refuses_sequence_parallelism_with_experts():
    """The grouped dispatch summed partial products of different tokens across ranks
    (wrong losses), the loop's all-gather of unequal token counts crashed gloo: the switch
    MLP is refused outright, as the command line refuses the flags together."""
    fields, _ = case_config("experts", sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel=True cannot be used with "
                                         r"num_experts=4: .*set sequence_parallel=False"):
        GPTModel(ModelConfig(**fields))
