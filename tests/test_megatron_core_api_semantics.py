"""Megatron-LM 23.05 semantics of `megatron.core` that ported code relies on, one process:
sequence parallelism requested at tensor-parallel size 1 is off (so `gather_output=True`
is accepted), the tensor-parallel marks are set once, `initialize_model_parallel` takes
23.05's five positional parameters. Sequence parallelism at size 2 is checked on two
ranks in test_megatron_core_api.py."""
from __future__ import annotations

import inspect

import pytest
import torch

from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel as tp

S, B, H, FFN, SEED = 4, 2, 6, 8, 3


@pytest.fixture
def fresh_state():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


def _init(w):
    return torch.nn.init.normal_(w, std=0.5)


def _column(**kw):
    torch.manual_seed(SEED)
    return tp.ColumnParallelLinear(H, FFN, init_method=_init, use_cpu_initialization=True,
                                   keep_master_weight_for_test=True, **kw)


@pytest.mark.parametrize("initialized", [False, True])
def test_sequence_parallel_with_gather_output_at_tp1_is_the_one_process_layer(
        fresh_state, initialized):
    if initialized:
        ps.initialize_model_parallel(1)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    layer = _column(sequence_parallel_enabled=True)  # gather_output=True: 23.05's default
    assert layer.gather_output and not layer.sequence_parallel
    plain = _column()
    assert torch.equal(layer.master_weight, plain.master_weight)
    xs = x.clone().requires_grad_()
    y, _ = layer(xs)
    y.sum().backward()
    ref_x = x.clone().requires_grad_()
    ref = torch.nn.functional.linear(ref_x, layer.master_weight, torch.zeros(FFN))
    ref.sum().backward()
    torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(xs.grad, ref_x.grad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y, plain(x)[0], atol=0, rtol=0)


def test_tensor_parallel_marks_are_set_once():
    w = torch.nn.Parameter(torch.zeros(4, 2))
    tp.set_tensor_model_parallel_attributes(w, True, 0, 2)
    assert (w.tensor_model_parallel, w.partition_dim, w.partition_stride) == (True, 0, 2)
    with pytest.raises(ValueError, match=r"already has \{'tensor_model_parallel': True, "
                       r"'partition_dim': 0, 'partition_stride': 2\}.*"
                       r"copy_tensor_model_parallel_attributes"):
        tp.set_tensor_model_parallel_attributes(w, False, -1, 1)
    assert (w.tensor_model_parallel, w.partition_dim) == (True, 0)  # left as it was
    half = torch.nn.Parameter(torch.zeros(2))
    half.partition_dim = 1  # any one of the three counts
    with pytest.raises(ValueError, match=r"already has \{'partition_dim': 1\}"):
        tp.set_tensor_model_parallel_attributes(half, True, 0, 1)


def test_layers_mark_their_weights_even_without_initialization():
    # Megatron-LM 23.05 leaves the weight unmarked with perform_initialization=False; this
    # project marks it, so that grad clipping and checkpoint resharding still see a shard
    col = tp.ColumnParallelLinear(H, FFN, init_method=_init, perform_initialization=False)
    row = tp.RowParallelLinear(FFN, H, init_method=_init, perform_initialization=False)
    emb = tp.VocabParallelEmbedding(16, H, init_method=_init, perform_initialization=False)
    marks = [(p.tensor_model_parallel, p.partition_dim, p.partition_stride)
             for p in (col.weight, col.bias, row.weight, row.bias, emb.weight)]
    assert marks == [(True, 0, 1), (True, 0, 1), (True, 1, 1), (False, -1, 1), (True, 0, 1)]


def test_initialize_model_parallel_has_23_05s_positional_parameters(fresh_state):
    params = inspect.signature(ps.initialize_model_parallel).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == ["tensor_model_parallel_size", "pipeline_model_parallel_size",
                          "virtual_pipeline_model_parallel_size",
                          "pipeline_model_parallel_split_rank", "use_fp8"]
    # a ported call giving all five positionally (the fifth 23.05's use_fp8)
    state = ps.initialize_model_parallel(1, 1, None, None, False)
    assert (state.tp_size, state.pp_size, state.ep_size) == (1, 1, 1)
    ps.destroy_model_parallel()
    with pytest.raises(ValueError, match=r"use_fp8=True.*not supported.*pass use_fp8=False"):
        ps.initialize_model_parallel(1, 1, None, None, True)
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(TypeError, match="positional"):
        ps.initialize_model_parallel(1, 1, None, None, False, 1)
    state = ps.initialize_model_parallel(1, expert_model_parallel_size=1)
    assert state.ep_size == 1
