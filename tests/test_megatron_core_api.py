"""Megatron-LM 23.05 `megatron.core` names that ported code imports: the package's
submodule attributes, `enums.ModelType`, `utils` (`divide`, `ensure_divisibility`, the
viewless-tensor helpers, `get_attr_wrapped_model`, `get_model_type`)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron.core import utils as core_utils
from megatron.core.enums import ModelType


def test_submodules_are_attributes_of_a_plain_import():
    # Megatron-LM 23.05's `import megatron.core` makes these reachable as attributes
    code = ("import megatron.core as mc; "
            "print(mc.parallel_state.__name__, mc.tensor_parallel.__name__, "
            "mc.utils.__name__, mc.enums.ModelType.encoder_or_decoder.value, "
            "mc.mpu is mc.parallel_state)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["megatron.core.parallel_state", "megatron.core.tensor_parallel",
                   "megatron.core.utils", "1", "True"]
    import megatron.core as mc
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mc.nope


def test_model_type_is_23_05s_and_the_checkpoint_reader_uses_it():
    from megatron.checkpoint_files import ModelType as read_as
    assert read_as is ModelType
    assert [(m.name, m.value) for m in ModelType] == [
        ("encoder_or_decoder", 1), ("encoder_and_decoder", 2),
        ("retro_encoder", 3), ("retro_decoder", 4)]


def test_divide_and_ensure_divisibility():
    from megatron.core import tensor_parallel
    assert tensor_parallel.divide is core_utils.divide
    assert core_utils.divide(12, 4) == 3
    core_utils.ensure_divisibility(12, 4)
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        core_utils.ensure_divisibility(10, 4)
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        core_utils.divide(10, 4)


def test_make_viewless_tensor():
    base = torch.arange(12.0).requires_grad_()
    view = base.view(3, 4)
    assert view._base is not None
    for keep_graph in (True, False):
        out = core_utils.make_viewless_tensor(view, requires_grad=True, keep_graph=keep_graph)
        assert out._base is None and out.data_ptr() == view.data_ptr()
        assert torch.equal(out.detach(), view.detach()) and out.shape == view.shape
        assert (out.grad_fn is not None) == keep_graph
    out = core_utils.make_viewless_tensor(view, requires_grad=True, keep_graph=True)
    (out * torch.arange(12.0).view(3, 4)).sum().backward()
    assert torch.equal(base.grad, torch.arange(12.0))  # backward is the identity
    plain = torch.ones(2)
    assert core_utils.make_viewless_tensor(plain, False, False) is plain


def test_assert_viewless_tensor():
    plain, view = torch.ones(4), torch.ones(4).view(2, 2)
    assert core_utils.assert_viewless_tensor(plain) is plain
    assert core_utils.assert_viewless_tensor([plain, "x"]) == [plain, "x"]
    with pytest.raises(AssertionError, match=r"view of shape \(2, 2\).*make_viewless_tensor"):
        core_utils.assert_viewless_tensor([plain, view])
    target = torch.zeros(2)
    core_utils.safely_set_viewless_tensor_data(target, torch.ones(3))
    assert torch.equal(target, torch.ones(3))
    with pytest.raises(AssertionError, match="new data shape"):
        core_utils.safely_set_viewless_tensor_data(view, torch.ones(3))


class _Wrapper(torch.nn.Module):
    def __init__(self, module, **attrs):
        super().__init__()
        self.module = module
        for k, v in attrs.items():
            setattr(self, k, v)


def test_get_attr_wrapped_model_and_get_model_type():
    inner = torch.nn.Linear(2, 2)
    inner.model_type = ModelType.encoder_or_decoder
    wrapped = _Wrapper(_Wrapper(inner), model_type=None)
    assert core_utils.get_model_type(_Wrapper(_Wrapper(inner))) is ModelType.encoder_or_decoder
    assert core_utils.get_attr_wrapped_model(wrapped, "model_type") is None
    assert core_utils.get_attr_wrapped_model(wrapped, "model_type", allow_none=False) \
        is ModelType.encoder_or_decoder
    assert core_utils.get_attr_wrapped_model(wrapped, "weight") is inner.weight
    with pytest.raises(ValueError, match="attribute 'nope'"):
        core_utils.get_attr_wrapped_model(wrapped, "nope")
    with pytest.raises(ValueError, match=r"list of model chunks.*model\[0\]"):
        core_utils.get_attr_wrapped_model([wrapped], "model_type")


# ------------------------------------------- the layers under 23.05's keyword names
# On 2 gloo ranks (tensor-parallel 2, `initialize_model_parallel(2)`), layers built with
# Megatron-LM 23.05's keywords are compared with the one-process computation, fp32,
# within atol=rtol=1e-5.
TP, S, B, H, FFN, SEED = 2, 4, 2, 6, 8, 7
TOL = dict(atol=1e-5, rtol=1e-5)


def _init(w):
    return torch.nn.init.normal_(w, std=0.5)


def _x():
    return torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))


def _reference():
    """Full weights drawn in construction order (fc1, fc2) and the MLP's result and
    input grad, on one process."""
    torch.manual_seed(SEED)
    w1, w2 = _init(torch.empty(FFN, H)), _init(torch.empty(H, FFN))
    x = _x().requires_grad_()
    y = torch.nn.functional.linear(torch.nn.functional.linear(x, w1), w2)
    y.sum().backward()
    return w1, w2, y.detach(), x.grad


def _ported_mlp(sp: bool, rank: int):
    from megatron.core import tensor_parallel as tp
    torch.manual_seed(SEED)
    common = dict(init_method=_init, use_cpu_initialization=True, params_dtype=torch.float32,
                  perform_initialization=True, keep_master_weight_for_test=True,
                  gradient_accumulation_fusion=False, sequence_parallel_enabled=sp)
    fc1 = tp.ColumnParallelLinear(H, FFN, gather_output=False, skip_bias_add=False,
                                  async_tensor_model_parallel_allreduce=not sp, **common)
    fc2 = tp.RowParallelLinear(FFN, H, input_is_parallel=True, skip_bias_add=True, **common)
    x = _x()
    x = (x.chunk(TP, 0)[rank] if sp else x).clone().requires_grad_()
    y, bias = fc2(fc1(x)[0])
    (y + bias).sum().backward()
    return dict(y=y.detach(), grad=x.grad, masters=(fc1.master_weight, fc2.master_weight),
                shards=(fc1.weight.detach(), fc2.weight.detach()),
                sp=(fc1.sequence_parallel, fc2.sequence_parallel, fc2.bias.sequence_parallel))


def _layers_worker(rank, world_size):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as tp
    ps.initialize_model_parallel(TP)
    try:
        out = {"plain": _ported_mlp(False, rank), "sp": _ported_mlp(True, rank)}
        torch.manual_seed(SEED)  # gather_output left out: 23.05's default gathers
        fc1 = tp.ColumnParallelLinear(H, FFN, init_method=_init, use_cpu_initialization=True)
        out["gathered"] = fc1(_x())[0].detach()
        try:  # at TP size 2 sequence parallelism is on, and a gathered output refused
            tp.ColumnParallelLinear(H, FFN, init_method=_init, sequence_parallel_enabled=True)
        except ValueError as e:
            out["sp_gather"] = str(e)
        state = torch.get_rng_state()  # perform_initialization=False draws nothing
        tp.RowParallelLinear(FFN, H, init_method=_init, use_cpu_initialization=True,
                             perform_initialization=False)
        out["rng_untouched"] = torch.equal(state, torch.get_rng_state())
        x = _x().requires_grad_()
        w = torch.eye(FFN, H).chunk(TP, 0)[rank]
        y = tp.linear_with_grad_accumulation_and_async_allreduce(
            input=x, weight=w, bias=None, gradient_accumulation_fusion=False,
            async_grad_allreduce=True, sequence_parallel_enabled=False)
        y.sum().backward()
        out["functional"] = (y.detach(), x.grad)
    finally:
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def layer_results():
    from tests.dist_utils import run_distributed
    return run_distributed(_layers_worker, TP)


@pytest.mark.parametrize("variant", ["plain", "sp"])
def test_23_05_keywords_match_one_process(layer_results, variant):
    w1, w2, want_y, want_grad = _reference()
    for r, res in enumerate(layer_results):
        got = res[variant]
        assert got["sp"] == ((True, True, True) if variant == "sp" else (False,) * 3)
        # keep_master_weight_for_test: the full weight drawn, this rank's shard sliced off it
        assert torch.equal(got["masters"][0], w1) and torch.equal(got["masters"][1], w2)
        assert torch.equal(got["shards"][0], w1.chunk(TP, 0)[r])
        assert torch.equal(got["shards"][1], w2.chunk(TP, 1)[r])
        y, grad = want_y, want_grad
        if variant == "sp":
            y, grad = y.chunk(TP, 0)[r], grad.chunk(TP, 0)[r]
        torch.testing.assert_close(got["y"], y, **TOL, msg=f"{variant} output, rank {r}")
        torch.testing.assert_close(got["grad"], grad, **TOL, msg=f"{variant} grad, rank {r}")


def test_column_gathers_by_default_and_perform_initialization(layer_results):
    w1 = _reference()[0]
    for r, res in enumerate(layer_results):
        torch.testing.assert_close(res["gathered"], torch.nn.functional.linear(_x(), w1),
                                   **TOL, msg=f"rank {r}")
        assert res["rng_untouched"]
        assert "gather_output=True (the default, as in Megatron-LM) cannot be used with " \
            "sequence_parallel=True at tensor-parallel size 2; pass gather_output=False" \
            in res.get("sp_gather", "")


def test_functional_linear_takes_23_05_keywords(layer_results):
    x = _x().requires_grad_()
    torch.nn.functional.linear(x, torch.eye(FFN, H)).sum().backward()
    for r, res in enumerate(layer_results):
        y, grad = res["functional"]
        torch.testing.assert_close(y, _x() @ torch.eye(FFN, H).chunk(TP, 0)[r].t())
        torch.testing.assert_close(grad, x.grad, **TOL, msg=f"input grad, rank {r}")


def test_23_05_keywords_refused_with_the_fix():
    from megatron.core import tensor_parallel as tp
    with pytest.raises(ValueError, match=r"sequence_parallel=True and "
                       r"sequence_parallel_enabled=False disagree"):
        tp.RowParallelLinear(4, 4, init_method=_init, input_is_parallel=True,
                             sequence_parallel=True, sequence_parallel_enabled=False)
    with pytest.raises(ValueError, match="keep_master_weight_for_test=True .* "
                       "use_cpu_initialization=True"):
        tp.ColumnParallelLinear(4, 4, init_method=_init, keep_master_weight_for_test=True)
    # Megatron-LM 23.05 takes every argument after the two sizes by keyword
    with pytest.raises(TypeError, match="positional"):
        tp.ColumnParallelLinear(4, 4, True)
