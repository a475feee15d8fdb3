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
