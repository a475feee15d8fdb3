"""Tensor-parallel library: mappings, layers, RNG tracker, recompute, utils.

Distributed checks run on N gloo processes (tests/dist_utils.run_distributed) and compare
against a single-process reference built in the same process from the same full weights
(use_cpu_initialization + the same seed). Tolerance for fp32: atol=rtol=1e-5 (only the
summation order differs). Several checks share one spawned run to keep start-up cheap.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core import tensor_parallel as tp
from tests.dist_utils import run_distributed

ATOL = RTOL = 1e-5


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _chunk(t, dim, rank, world):
    return t.chunk(world, dim=dim)[rank]


def _shard(t, dim, stride, rank, world):
    """Rank's slice when each of `stride` blocks of `dim` is split separately."""
    return torch.cat([b.chunk(world, dim=dim)[rank] for b in t.chunk(stride, dim=dim)], dim=dim)


# --------------------------------------------------------------------------------------
# mappings
# --------------------------------------------------------------------------------------
def _run_mapping(fn, x, grad, *args):
    x = x.clone().requires_grad_(True)
    y = fn(x, *args)
    y.backward(grad)
    return y.detach(), x.grad


def _mappings_worker(rank, world):
    group = dist.group.WORLD
    g = _gen(0)
    X = torch.randn(world, 2 * world, 3, 2 * world, generator=g)  # per-rank inputs
    G = torch.randn(world, 2 * world, 3, 2 * world, generator=g)  # per-rank upstream grads
    full_x, full_g = X[0], G[0]
    checks = {}

    y, gx = _run_mapping(tp.copy_to_tp, full_x, G[rank], group)
    checks["copy_to_tp"] = (y, full_x, gx, G.sum(0))

    y, gx = _run_mapping(tp.reduce_from_tp, X[rank], full_g, group)
    checks["reduce_from_tp"] = (y, X.sum(0), gx, full_g)

    y, gx = _run_mapping(tp.scatter_to_tp, full_x, _chunk(G[rank], -1, rank, world), group)
    expected_grad = torch.cat([_chunk(G[r], -1, r, world) for r in range(world)], dim=-1)
    checks["scatter_to_tp"] = (y, _chunk(full_x, -1, rank, world), gx, expected_grad)

    y, gx = _run_mapping(tp.gather_from_tp, _chunk(full_x, -1, rank, world), full_g, group)
    checks["gather_from_tp"] = (y, full_x, gx, _chunk(full_g, -1, rank, world))

    # Non-contiguous input (a transposed view) must gather the same values.
    x_t = _chunk(full_x, -1, rank, world).transpose(0, 1).contiguous().transpose(0, 1)
    y, _ = _run_mapping(tp.gather_from_tp, x_t, full_g, group)
    checks["gather_from_tp_noncontig"] = (y, full_x, None, None)

    y, gx = _run_mapping(tp.scatter_to_sp, full_x, _chunk(G[rank], 0, rank, world), group)
    expected_grad = torch.cat([_chunk(G[r], 0, r, world) for r in range(world)], dim=0)
    checks["scatter_to_sp"] = (y, _chunk(full_x, 0, rank, world), gx, expected_grad)

    y, gx = _run_mapping(tp.gather_from_sp, _chunk(full_x, 0, rank, world), G[rank], group)
    checks["gather_from_sp_reduce_scatter"] = (y, full_x, gx, _chunk(G.sum(0), 0, rank, world))

    y, gx = _run_mapping(tp.gather_from_sp, _chunk(full_x, 0, rank, world), full_g, group, False)
    checks["gather_from_sp_split"] = (y, full_x, gx, _chunk(full_g, 0, rank, world))

    y, gx = _run_mapping(tp.reduce_scatter_to_sp, X[rank], _chunk(G[rank], 0, rank, world), group)
    expected_grad = torch.cat([_chunk(G[r], 0, r, world) for r in range(world)], dim=0)
    checks["reduce_scatter_to_sp"] = (y, _chunk(X.sum(0), 0, rank, world), gx, expected_grad)

    for name, (y, y_exp, gx, gx_exp) in checks.items():
        _close(y, y_exp, f"{name} forward")
        if gx_exp is not None:
            _close(gx, gx_exp, f"{name} backward")

    # Inputs are never modified in place.
    x_in = X[rank].clone()
    tp.reduce_from_tp(x_in, group)
    _close(x_in, X[rank], "reduce_from_tp input untouched")
    return sorted(checks)


@pytest.mark.parametrize("world", [2, 4])
def test_mappings_match_collectives(world):
    names = run_distributed(_mappings_worker, world)
    assert all(n == names[0] for n in names) and len(names[0]) == 9


def test_mappings_are_identity_without_group():
    x = torch.randn(4, 2, 6, requires_grad=True)
    for fn in (tp.copy_to_tp, tp.reduce_from_tp, tp.scatter_to_tp, tp.gather_from_tp,
               tp.scatter_to_sp, tp.gather_from_sp, tp.reduce_scatter_to_sp):
        assert fn(x, None) is x


# --------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------
INIT = tp.init_method_normal(0.5)
SEED = 1234


def _full_weight(shape, seed=SEED):
    torch.manual_seed(seed)
    w = torch.empty(shape)
    INIT(w)
    return w


def _reference_linear(X, W, B, G):
    """Single-process y = X W^T + b and grads of sum(y * G)."""
    X, W, B = (t.clone().requires_grad_(True) for t in (X, W, B))
    y = F.linear(X, W, B)
    (y * G).sum().backward()
    return y.detach(), X.grad, W.grad, B.grad


def _check_column(rank, world, group, gather_output, sp, stride, async_ar):
    s, b, h_in, h_out = 2 * world, 3, 5, 4 * world
    g = _gen(10)
    X, G, B = torch.randn(s, b, h_in, generator=g), torch.randn(s, b, h_out, generator=g), \
        torch.randn(h_out, generator=g)
    W = _full_weight((h_out, h_in))
    torch.manual_seed(SEED)
    layer = tp.ColumnParallelLinear(
        h_in, h_out, tp_group=group, gather_output=gather_output, init_method=INIT,
        stride=stride, sequence_parallel=sp, async_tensor_model_parallel_allreduce=async_ar,
        use_cpu_initialization=True, device="cpu")
    what = f"column gather={gather_output} sp={sp} stride={stride} async={async_ar}"
    _close(layer.weight.detach(), _shard(W, 0, stride, rank, world), f"{what} weight init")
    with torch.no_grad():
        layer.bias.copy_(_shard(B, 0, stride, rank, world))
    y_ref, gx_ref, gw_ref, gb_ref = _reference_linear(X, W, B, G)

    x = (_chunk(X, 0, rank, world) if sp else X).clone().requires_grad_(True)
    y, y_bias = layer(x)
    assert y_bias is None
    g_local = G if gather_output else _shard(G, -1, stride, rank, world)
    (y * g_local).sum().backward()
    _close(y.detach(), y_ref if gather_output else _shard(y_ref, -1, stride, rank, world),
           f"{what} output")
    _close(x.grad, _chunk(gx_ref, 0, rank, world) if sp else gx_ref, f"{what} input grad")
    _close(layer.weight.grad, _shard(gw_ref, 0, stride, rank, world), f"{what} weight grad")
    _close(layer.bias.grad, _shard(gb_ref, 0, stride, rank, world), f"{what} bias grad")


def _check_row(rank, world, group, input_is_parallel, sp):
    s, b, h_in, h_out = 2 * world, 3, 4 * world, 5
    g = _gen(20)
    X, G, B = torch.randn(s, b, h_in, generator=g), torch.randn(s, b, h_out, generator=g), \
        torch.randn(h_out, generator=g)
    W = _full_weight((h_out, h_in))
    torch.manual_seed(SEED)
    layer = tp.RowParallelLinear(
        h_in, h_out, tp_group=group, input_is_parallel=input_is_parallel, init_method=INIT,
        sequence_parallel=sp, use_cpu_initialization=True, device="cpu")
    what = f"row input_is_parallel={input_is_parallel} sp={sp}"
    _close(layer.weight.detach(), _chunk(W, 1, rank, world), f"{what} weight init")
    assert layer.bias.tensor_model_parallel is False and layer.bias.sequence_parallel is sp
    with torch.no_grad():
        layer.bias.copy_(B)
    y_ref, gx_ref, gw_ref, gb_ref = _reference_linear(X, W, B, G)

    x = (_chunk(X, -1, rank, world) if input_is_parallel else X).clone().requires_grad_(True)
    y, _ = layer(x)
    (y * (_chunk(G, 0, rank, world) if sp else G)).sum().backward()
    _close(y.detach(), _chunk(y_ref, 0, rank, world) if sp else y_ref, f"{what} output")
    _close(x.grad, _chunk(gx_ref, -1, rank, world) if input_is_parallel else gx_ref,
           f"{what} input grad")
    _close(layer.weight.grad, _chunk(gw_ref, 1, rank, world), f"{what} weight grad")
    bias_grad = layer.bias.grad.clone()
    if sp:  # the trainer's job: sum the sequence-parallel bias grad over TP
        dist.all_reduce(bias_grad, group=group)
    _close(bias_grad, gb_ref, f"{what} bias grad")


def _check_embedding(rank, world, group, reduce_scatter):
    vocab, h, b, s = 4 * world, 6, 3, 2 * world
    ids = torch.randint(0, vocab, (b, s), generator=_gen(30))
    G = torch.randn(b, s, h, generator=_gen(31))
    W = _full_weight((vocab, h))
    torch.manual_seed(SEED)
    emb = tp.VocabParallelEmbedding(vocab, h, tp_group=group, init_method=INIT,
                                    use_cpu_initialization=True,
                                    reduce_scatter_embeddings=reduce_scatter, device="cpu")
    what = f"embedding reduce_scatter={reduce_scatter}"
    assert (emb.vocab_start_index, emb.vocab_end_index) == (rank * vocab // world,
                                                            (rank + 1) * vocab // world)
    w_ref = W.clone().requires_grad_(True)
    y_ref = F.embedding(ids, w_ref)
    (y_ref * G).sum().backward()
    y = emb(ids)
    if reduce_scatter:  # [s/tp, b, h]
        y_exp, g_local = (_chunk(t.transpose(0, 1), 0, rank, world) for t in (y_ref, G))
    else:
        y_exp, g_local = y_ref, G
    (y * g_local).sum().backward()
    _close(y.detach(), y_exp.detach(), f"{what} output")
    _close(emb.weight.grad, _chunk(w_ref.grad, 0, rank, world), f"{what} weight grad")


def _mlp(x, col, row, group, sp):
    """Column -> gelu -> row, as a transformer MLP uses them."""
    if sp:
        x = tp.scatter_to_sp(x, group)
    h, _ = col(x)
    y, _ = row(F.gelu(h))
    return tp.gather_from_sp(y, group, tensor_parallel_output_grad=False) if sp else y


def _check_sp_matches_no_sp(rank, world, group):
    s, b, h = 2 * world, 2, 4 * world
    X = torch.randn(s, b, h, generator=_gen(40))
    G = torch.randn(s, b, h, generator=_gen(41))
    results = []
    for sp in (False, True):
        torch.manual_seed(SEED)
        kw = dict(tp_group=group, init_method=INIT, sequence_parallel=sp,
                  use_cpu_initialization=True, device="cpu")
        col = tp.ColumnParallelLinear(h, 2 * h, gather_output=False, **kw)
        row = tp.RowParallelLinear(2 * h, h, input_is_parallel=True, **kw)
        with torch.no_grad():
            row.bias.fill_(0.25)
        x = X.clone().requires_grad_(True)
        y = _mlp(x, col, row, group, sp)
        (y * G).sum().backward()
        row_bias_grad = row.bias.grad.clone()
        if sp:
            dist.all_reduce(row_bias_grad, group=group)
        results.append((y.detach(), x.grad, col.weight.grad, row.weight.grad, row_bias_grad))
    for name, a, c in zip(("output", "input grad", "col w grad", "row w grad", "row b grad"),
                          *results):
        _close(c, a, f"sp vs no-sp {name}")


def _check_fusion_and_attributes(rank, world, group):
    h_in, h_out = 4, 2 * world
    X = torch.randn(3, 2, h_in, generator=_gen(50))
    for fusion in (True, False):
        torch.manual_seed(SEED)
        layer = tp.ColumnParallelLinear(h_in, h_out, gather_output=False,
                                        tp_group=group, init_method=INIT,
                                        gradient_accumulation_fusion=fusion,
                                        use_cpu_initialization=True, device="cpu")
        layer.weight.main_grad = torch.ones(layer.weight.shape, dtype=torch.float32)
        layer(X.clone().requires_grad_(True))[0].sum().backward()
        _, _, gw_ref, _ = _reference_linear(X, _full_weight((h_out, h_in)), torch.zeros(h_out),
                                            torch.ones(3, 2, h_out))
        expected = _chunk(gw_ref, 0, rank, world)
        if fusion:
            assert layer.weight.grad is None
            _close(layer.weight.main_grad, 1.0 + expected, "main_grad accumulation")
        else:
            _close(layer.weight.grad, expected, "weight grad without fusion")
            _close(layer.weight.main_grad, torch.ones_like(expected), "main_grad untouched")
    w = layer.weight
    assert (w.tensor_model_parallel, w.partition_dim, w.partition_stride) == (True, 0, 1)
    assert tp.param_is_not_tensor_parallel_duplicate(w, rank)
    plain = torch.nn.Parameter(torch.zeros(2))
    tp.set_defaults_if_not_set_tensor_model_parallel_attributes(plain)
    assert tp.param_is_not_tensor_parallel_duplicate(plain, rank) == (rank == 0)
    # skip_bias_add hands the bias back; a tied weight can be passed to forward.
    col = tp.ColumnParallelLinear(h_in, h_out, gather_output=False,
                                  tp_group=group, init_method=INIT, device="cpu",
                                  skip_bias_add=True, skip_weight_param_allocation=True,
                                  use_cpu_initialization=True)
    y, bias = col(X, weight=layer.weight)
    odd = 2 * world + 1  # each message names the layer, the argument, both sizes
    with pytest.raises(ValueError, match=f"^RowParallelLinear: input_size={odd} is not "
                       f"divisible by the tensor-parallel size {world}; choose"):
        tp.RowParallelLinear(odd, 4, tp_group=group, init_method=INIT, device="cpu")
    with pytest.raises(ValueError, match=f"^ColumnParallelLinear: output_size={odd} .* {world}"):
        tp.ColumnParallelLinear(4, odd, tp_group=group, init_method=INIT, device="cpu")
    with pytest.raises(ValueError, match=f"^VocabParallelEmbedding: num_embeddings={odd} "):
        tp.VocabParallelEmbedding(odd, 4, tp_group=group, init_method=INIT, device="cpu")
    assert bias is col.bias
    _close(y, F.linear(X, layer.weight), "column with passed weight")


def _check_tracker_init(rank, world, group):
    with pytest.raises(ValueError, match="model_parallel_seed"):
        tp.ColumnParallelLinear(4, 2 * world, gather_output=False,
                                tp_group=group, init_method=INIT, device="cpu",
                                rng_tracker=tp.RNGStatesTracker("cpu"))
    tracker = tp.model_parallel_seed(7, rank, tp.RNGStatesTracker("cpu"))
    layer = tp.ColumnParallelLinear(4, 2 * world, gather_output=False,
                                    tp_group=group, init_method=INIT,
                                    device="cpu", rng_tracker=tracker)
    return layer.weight.detach()


def _layers_worker(rank, world):
    group = dist.group.WORLD
    for case in [(False, False, 1, True), (True, False, 1, True), (False, True, 1, True),
                 (False, False, 2, True), (False, False, 1, False), (False, True, 2, True)]:
        _check_column(rank, world, group, *case)
    for case in [(True, False), (False, False), (True, True)]:
        _check_row(rank, world, group, *case)
    for reduce_scatter in (False, True):
        _check_embedding(rank, world, group, reduce_scatter)
    _check_sp_matches_no_sp(rank, world, group)
    _check_fusion_and_attributes(rank, world, group)
    return _check_tracker_init(rank, world, group)


@pytest.mark.parametrize("world", [2, 4])
def test_parallel_layers_match_single_process(world):
    shards = run_distributed(_layers_worker, world)
    # Without CPU init each rank draws its own shard from its model-parallel stream.
    for r in range(1, world):
        assert not torch.equal(shards[0], shards[r])


def test_layers_single_process_equal_plain_torch():
    X = torch.randn(3, 2, 4)
    torch.manual_seed(SEED)
    col = tp.ColumnParallelLinear(4, 6, init_method=INIT, gather_output=True, device="cpu")
    _close(col.weight.detach(), _full_weight((6, 4)), "TP=1 init uses the global generator")
    _close(col(X)[0], F.linear(X, col.weight, col.bias), "column TP=1")
    row = tp.RowParallelLinear(6, 4, init_method=INIT, device="cpu")
    _close(row(X.new_ones(3, 2, 6))[0], F.linear(X.new_ones(3, 2, 6), row.weight, row.bias),
           "row TP=1")
    emb = tp.VocabParallelEmbedding(10, 4, init_method=INIT, device="cpu")
    ids = torch.tensor([[0, 9, 3]])
    _close(emb(ids), emb.weight[ids], "embedding TP=1")
    with pytest.raises(ValueError, match=r"has shape \(5, 4\), expected \(6, 4\)"):
        tp.ColumnParallelLinear(4, 6, init_method=INIT, device="cpu").forward(X, torch.ones(5, 4))
    # at TP=1 sequence parallelism is off (Megatron-LM 23.05), so the output may be gathered
    sp = tp.ColumnParallelLinear(4, 6, init_method=INIT, gather_output=True,
                                 sequence_parallel=True, device="cpu")
    assert not sp.sequence_parallel
    _close(sp(X)[0], F.linear(X, sp.weight, sp.bias), "column TP=1, sequence_parallel asked")


def test_init_helpers():
    torch.manual_seed(0)
    w = torch.empty(2000, 10)
    tp.scaled_init_method_normal(0.02, 8)(w)
    assert abs(w.std().item() - 0.02 / 4) < 5e-4
    full = torch.arange(8.0).view(8, 1)  # [gate(4); up(4)]
    assert tp.shard_of_full_weight(full, 0, 2, 1, 2).flatten().tolist() == [2, 3, 6, 7]


# --------------------------------------------------------------------------------------
# RNG tracker and activation recompute
# --------------------------------------------------------------------------------------
def _tp_block(x, col, row, group, tracker):
    """Column -> dropout inside TP (forked stream) -> row -> dropout outside (default)."""
    h, _ = col(x)
    with tracker.fork():
        h = F.dropout(F.gelu(h), p=0.5, training=True)
    y, _ = row(h)
    return F.dropout(y, p=0.3, training=True)


def _run_block(x, col, row, group, tracker, recompute):
    for p in (*col.parameters(), *row.parameters()):
        p.grad = None
    x = x.clone().requires_grad_(True)
    if recompute:
        y = tp.checkpoint(_tp_block, x, col, row, group, tracker, tracker=tracker)
    else:
        y = _tp_block(x, col, row, group, tracker)
    y.sum().backward()
    after = (torch.rand(4), _draw_forked(tracker))  # streams must continue identically
    return [y.detach(), x.grad, col.weight.grad, row.weight.grad, *after]


def _draw_forked(tracker):
    with tracker.fork():
        return torch.rand(4)


def _rng_worker(rank, world):
    group = dist.group.WORLD
    tracker = tp.model_parallel_seed(1000, rank, tp.RNGStatesTracker("cpu"))
    ones = torch.ones(256)
    outside = F.dropout(ones, 0.5, training=True)
    with tracker.fork():
        inside = F.dropout(ones, 0.5, training=True)
    tp.assert_tensor_equal_across_parallel_ranks(outside, group)

    # The fork leaves the default stream where it was.
    state = torch.get_rng_state()
    with tracker.fork():
        torch.rand(10)
    after_fork = torch.rand(3)
    torch.set_rng_state(state)
    _close(after_fork, torch.rand(3), "default stream unaffected by fork")

    # state_dict round trip (through torch.save/load weights_only) replays the stream.
    saved = tracker.state_dict()
    first = _draw_forked(tracker)
    tracker.load_state_dict(saved)
    assert torch.equal(first, _draw_forked(tracker))
    with pytest.raises(ValueError, match="seed"):
        tracker.add("another", 1000 + 2718 + rank)
    with pytest.raises(ValueError, match="not set up"):
        with tracker.fork("missing"):
            pass

    torch.manual_seed(SEED)
    kw = dict(tp_group=group, init_method=INIT, use_cpu_initialization=True, device="cpu")
    col = tp.ColumnParallelLinear(6, 4 * world, gather_output=False, **kw)
    row = tp.RowParallelLinear(4 * world, 6, input_is_parallel=True, **kw)
    x = torch.randn(4, 2, 6, generator=_gen(60))
    start = (torch.get_rng_state(), tracker.get_states())
    plain = _run_block(x, col, row, group, tracker, recompute=False)
    torch.set_rng_state(start[0])
    tracker.set_states(start[1])
    recomputed = _run_block(x, col, row, group, tracker, recompute=True)
    for name, a, b in zip(("output", "x grad", "col grad", "row grad", "default next",
                           "tracker next"), plain, recomputed):
        assert torch.equal(a, b), f"checkpoint changed {name}"
    return outside, inside, saved


def test_rng_tracker_and_checkpoint():
    import io

    results = run_distributed(_rng_worker, 2)
    (out0, in0, saved), (out1, in1, _) = results
    assert torch.equal(out0, out1), "dropout outside the TP region must agree across ranks"
    assert not torch.equal(in0, in1), "dropout inside the TP region must differ across ranks"
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert set(loaded) == {tp.MODEL_PARALLEL_RNG}


def test_checkpoint_single_process_matches_plain():
    tracker = tp.model_parallel_seed(5, 0, tp.RNGStatesTracker("cpu"))
    torch.manual_seed(SEED)
    col = tp.ColumnParallelLinear(6, 8, gather_output=False, init_method=INIT, device="cpu")
    row = tp.RowParallelLinear(8, 6, init_method=INIT, input_is_parallel=True, device="cpu")
    x = torch.randn(4, 2, 6)
    start = (torch.get_rng_state(), tracker.get_states())
    plain = _run_block(x, col, row, None, tracker, recompute=False)
    torch.set_rng_state(start[0])
    tracker.set_states(start[1])
    recomputed = _run_block(x, col, row, None, tracker, recompute=True)
    for a, b in zip(plain, recomputed):
        assert torch.equal(a, b)


def test_checkpoint_accepts_megatron_distribute_saved_activations_form():
    # Megatron-LM 23.05: checkpoint(function, distribute_saved_activations, *args)
    torch.manual_seed(SEED)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])
    y = tp.checkpoint(lambda a, m: lin(a) * m, False, x, mask,
                      tracker=tp.RNGStatesTracker("cpu"))
    y.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    (lin(x) * mask).sum().backward()
    assert torch.equal(grad, x.grad)
    with pytest.raises(ValueError, match="distribute_saved_activations.*"
                       "checkpoint_distributed_input"):
        tp.checkpoint(lambda a: lin(a), True, x, tracker=tp.RNGStatesTracker("cpu"))


# --------------------------------------------------------------------------------------
# utils
# --------------------------------------------------------------------------------------
def _assert_equal_worker(rank, world):
    group = dist.group.WORLD
    tp.assert_tensor_equal_across_parallel_ranks(torch.arange(6.0), group)
    nan = torch.tensor([float("nan"), 1.0])
    tp.assert_tensor_equal_across_parallel_ranks(nan, group)  # NaN == NaN
    messages = []
    t = torch.arange(6.0) + (1.0 if rank == 2 else 0.0)
    with pytest.raises(AssertionError) as err:
        tp.assert_tensor_equal_across_parallel_ranks(t, group)
    messages.append(str(err.value))
    with pytest.raises(AssertionError) as err:
        tp.assert_tensor_equal_across_parallel_ranks(torch.zeros(2 + (rank == 3)), group)
    messages.append(str(err.value))
    return messages


def test_assert_tensor_equal_across_parallel_ranks_names_ranks():
    results = run_distributed(_assert_equal_worker, 4)
    for values_msg, shape_msg in results:
        assert "ranks [2] differ" in values_msg
        assert "ranks [3] differ" in shape_msg


def test_divide_and_split():
    assert tp.divide(12, 4) == 3
    with pytest.raises(ValueError, match="10 is not divisible by 4"):
        tp.divide(10, 4)
    t = torch.arange(12.0).view(2, 6)
    parts = tp.split_tensor_along_last_dim(t, 3)
    assert [p.tolist() for p in parts] == [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [10, 11]]]
    assert all(p.is_contiguous() for p in tp.split_tensor_along_last_dim(t, 3, True))
    assert tp.vocab_range_from_global_vocab_size(16, 2, 4) == (8, 12)
