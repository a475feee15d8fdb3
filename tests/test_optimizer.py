"""Optimizer stack: grad scaler trace, clip_grads over gloo groups, param groups, FP32 and
mixed-precision wrappers against plain torch AdamW, checkpoint round trips."""
import copy
import math
import warnings

import pytest
import torch

from megatron.core.config import OptimizerConfig
from megatron.core.optimizer import (
    ConstantGradScaler,
    DynamicGradScaler,
    FP32Optimizer,
    MixedPrecisionOptimizer,
    build_optimizer,
    clip_grad_norm,
    count_zeros,
    get_grad_norm,
    get_param_groups,
)
from megatron.core.parallel_state import ParallelState
from tests.dist_utils import run_distributed

SINGLE = ParallelState.build()  # world of one: every group is None


# --- grad scaler -------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["bool", "tensor"])
def test_dynamic_scaler_exact_hysteresis_trace(flag):
    """The same rule whether the step's overflow is known on the host (a bool) or only on
    the device (a 0-dim tensor, as inside a captured step)."""
    s = DynamicGradScaler(16.0, min_scale=1.0, growth_interval=3, hysteresis=2)
    scale = s.scale
    trace = []
    for found_inf in [1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1]:
        s.update(bool(found_inf) if flag == "bool" else torch.tensor(float(found_inf)))
        trace.append((float(s.scale), s.growth_tracker, s.hysteresis_tracker))
    assert s.scale is scale  # updated in place: a captured step reads this tensor
    assert trace == [
        (16.0, 0, 1), (16.0, 1, 1), (16.0, 2, 1),
        (8.0, 0, 0),     # clean steps did not restore hysteresis: this overflow halves
        (4.0, 0, -1),
        (4.0, 1, -1), (4.0, 2, -1),
        (8.0, 0, 2),     # growth event restores hysteresis
        (8.0, 0, 1),     # tolerated overflow
        (4.0, 0, 0), (2.0, 0, -1), (1.0, 0, -2),
        (1.0, 0, -3),    # clamped at min_scale
    ]
    assert float(s.inv_scale) == 1.0


def test_scaler_state_dict_round_trip(tmp_path):
    s = DynamicGradScaler(2.0**10, min_scale=1.0, growth_interval=5, hysteresis=3)
    for f in [True, False, False]:
        s.update(f)
    torch.save(s.state_dict(), tmp_path / "g.pt")
    sd = torch.load(tmp_path / "g.pt", weights_only=True)
    assert set(sd) == {"scale", "growth_tracker", "hysteresis_tracker"}
    t = DynamicGradScaler(1.0, min_scale=1.0)
    t.load_state_dict(sd)
    assert (float(t.scale), t.growth_tracker, t.hysteresis_tracker) == (1024.0, 2, 2)
    assert isinstance(sd["growth_tracker"], int) and isinstance(sd["hysteresis_tracker"], int)
    t.load_state_dict({"scale": torch.tensor([64.0]), "growth_tracker": 0,
                       "hysteresis_tracker": 1})  # Megatron's shape-[1] scale
    assert t.scale.shape == () and float(t.scale) == 64.0
    c = ConstantGradScaler(8.0)
    c.update(True)
    assert float(c.scale) == 8.0 and c.state_dict() == {}


def test_scaler_resumed_at_smaller_window_and_hysteresis_uses_them():
    """A checkpoint of 4 clean steps under --loss-scale-window 1000 --hysteresis 3, resumed
    with --loss-scale-window 2 --hysteresis 1: the scale grows at the next clean step and
    every 2 after (not never: the saved count is already past the new window), and after
    that the first overflow backs off."""
    s = DynamicGradScaler(1024.0, min_scale=1.0, growth_interval=1000, hysteresis=3)
    for _ in range(4):
        s.update(False)
    t = DynamicGradScaler(1024.0, min_scale=1.0, growth_interval=2, hysteresis=1)
    t.load_state_dict(s.state_dict())
    assert (t.growth_tracker, t.hysteresis_tracker) == (1, 1)
    trace = []
    for found_inf in [False, False, False, True]:
        t.update(found_inf)
        trace.append(float(t.scale))
    assert trace == [2048.0, 2048.0, 4096.0, 2048.0]


@pytest.mark.parametrize("kw", [
    dict(initial_scale=0.0, min_scale=1.0), dict(initial_scale=4.0, min_scale=8.0),
    dict(initial_scale=4.0, min_scale=1.0, growth_factor=1.0),
    dict(initial_scale=4.0, min_scale=1.0, backoff_factor=1.0),
    dict(initial_scale=4.0, min_scale=1.0, growth_interval=0),
    dict(initial_scale=4.0, min_scale=1.0, hysteresis=0),
])
def test_scaler_validation(kw):
    with pytest.raises(ValueError):
        DynamicGradScaler(**kw)


@pytest.mark.parametrize("make", [
    lambda: ConstantGradScaler(1e-50),  # float32: 0
    lambda: ConstantGradScaler(1e-39),  # a subnormal float32: 1 / scale is inf
    lambda: DynamicGradScaler(1e-50, min_scale=1e-60),
    lambda: DynamicGradScaler(1.0, min_scale=1e-50),  # backing off would reach 0
])
def test_scaler_refuses_a_scale_without_a_finite_float32_reciprocal(make):
    """Gradients of a loss scaled by such a scale unscale (times 1/scale) to NaN after the
    overflow check has found them finite: the step wrote NaN weights."""
    with pytest.raises(ValueError, match="smallest normal float32"):
        make()


# --- clip_grads on gloo groups -----------------------------------------------------------
def _full_grads():
    g = torch.Generator().manual_seed(7)
    grads = {name: torch.randn(shape, generator=g) for name, shape in
             [("w0", (8, 6)), ("b0", (6,)), ("w1", (8, 6)), ("b1", (6,)), ("emb", (4, 6))]}
    grads["w0"][0, :3] = 0.0  # some exact zeros for count_zeros
    grads["b1"][2] = 0.0
    return grads


def _stage_params(grads, stage, pp, tp_rank, tp):
    """Params of one pipeline stage's TP shard; grads set (partly through main_grad)."""
    names = ["w0", "b0", "w1", "b1"] if pp == 1 else (["w0", "b0"] if stage == 0 else
                                                      ["w1", "b1", "emb"])
    params = []
    for name in names:
        full = grads[name]
        if name.startswith("w"):
            rows = full.shape[0] // tp
            value = full[tp_rank * rows:(tp_rank + 1) * rows].clone()
        else:
            value = full.clone()
        p = torch.nn.Parameter(torch.zeros_like(value))
        p.tensor_model_parallel = name.startswith("w")
        if name == "emb":
            p.shared = True  # tied copy on the last stage: not counted
        if name.startswith("b"):
            p.main_grad = value  # grad buffer wins over .grad
            p.grad = torch.full_like(value, 1e6)
        else:
            p.grad = value
        params.append(p)
    return names, params


def _clip_worker(rank, world_size, tp, pp):
    ps = ParallelState.build(world_size, rank, tp_size=tp, pp_size=pp)
    grads = _full_grads()
    names, params = _stage_params(grads, ps.pp_rank, pp, ps.tp_rank, tp)
    norm = get_grad_norm(params, ps.mp_group, ps.tp_rank)
    inf_norm = get_grad_norm(params, ps.mp_group, ps.tp_rank, norm_type=math.inf)
    zeros = count_zeros(params, ps.mp_group, ps.tp_rank)
    returned = clip_grad_norm(params, 2.0, ps.mp_group, ps.tp_rank)
    clipped = {n: (p.main_grad if n.startswith("b") else p.grad).clone()
               for n, p in zip(names, params)}
    return dict(norm=norm, inf=inf_norm, zeros=zeros, returned=returned, clipped=clipped,
                tp_rank=ps.tp_rank, pp_rank=ps.pp_rank)


def _reference():
    grads = _full_grads()
    counted = [grads[n] for n in ("w0", "b0", "w1", "b1")]
    flat = torch.cat([g.flatten() for g in counted]).double()
    return grads, flat.norm().item(), flat.abs().max().item(), int((flat == 0).sum())


@pytest.mark.parametrize("world, tp, pp", [(2, 2, 1), (4, 2, 2), (4, 2, 1)])
def test_clip_grad_norm_matches_single_process(world, tp, pp):
    results = run_distributed(_clip_worker, world, tp, pp)
    grads, ref_norm, ref_inf, ref_zeros = _reference()
    coeff = 2.0 / (ref_norm + 1e-6)
    assert coeff < 1.0
    for r in results:
        assert r["norm"].shape == () and r["norm"].dtype == torch.float32
        assert float(r["norm"]) == pytest.approx(ref_norm, rel=1e-5)
        assert float(r["returned"]) == pytest.approx(ref_norm, rel=1e-5)
        assert float(r["inf"]) == pytest.approx(ref_inf, rel=1e-6)
        assert int(r["zeros"]) == ref_zeros
        for name, g in r["clipped"].items():
            full = grads[name]
            if name.startswith("w"):
                rows = full.shape[0] // tp
                full = full[r["tp_rank"] * rows:(r["tp_rank"] + 1) * rows]
            torch.testing.assert_close(g, full * coeff, rtol=1e-5, atol=1e-7)


def test_clip_single_process_no_clip_and_nan():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([0.3, 0.0, 0.4])
    norm = clip_grad_norm([p], 1.0, None, 0)
    assert float(norm) == pytest.approx(0.5)
    torch.testing.assert_close(p.grad, torch.tensor([0.3, 0.0, 0.4]))  # below max: untouched
    p.grad = torch.tensor([float("nan"), 1.0, 2.0])
    norm = clip_grad_norm([p], 1.0, None, 0)
    assert math.isnan(float(norm)) and float(p.grad[1]) == 1.0  # reported, not applied
    p.grad = torch.tensor([3e38, 3e38, 1.0])  # finite, but the sum of squares overflows
    norm = clip_grad_norm([p], 1.0, None, 0)
    # Megatron-LM's coefficient max_norm / (inf + 1e-6) = 0 is < 1: the grads are zeroed
    assert math.isinf(float(norm)) and torch.equal(p.grad, torch.zeros(3))
    dup = torch.nn.Parameter(torch.zeros(2))
    dup.grad = torch.ones(2)
    assert float(get_grad_norm([dup], None, tp_rank=1)) == 0.0  # replicated, not tp rank 0


@pytest.mark.parametrize("norm_type", [2.0, 3.0, math.inf])
def test_grad_norm_over_buffer_views_merges_runs_and_skips_gaps(norm_type, monkeypatch):
    """Gradients that are views of one flat buffer (a grad buffer) are reduced as merged runs
    -- only where they sit end to end, never across an excluded parameter's gap -- and the
    norm equals the per-tensor reference (fp64) whatever the order they come in."""
    from megatron.core.optimizer import clip_grads

    monkeypatch.setattr(clip_grads, "_LONG", 40)  # the merged runs take the one-kernel path
    monkeypatch.setattr(clip_grads, "MERGE_ON_CPU", True)  # as on CUDA
    gen = torch.Generator().manual_seed(0)
    buffer = torch.randn(100, generator=gen)
    sizes = [(3, 4), (10,), (5, 5), (8,), (2, 3), (30,)]  # 12+10+25+8+6+30 = 91 (9 spare)
    params, start = [], 0
    for size in sizes:
        p = torch.nn.Parameter(torch.zeros(size))
        p.main_grad = buffer[start:start + p.numel()].view(size)
        p.tensor_model_parallel = len(params) != 3  # the 4th: a replicated duplicate on tp 1
        params.append(p)
        start += p.numel()
    loose = torch.nn.Parameter(torch.zeros(4, 6))
    loose.grad = torch.randn(6, 4, generator=gen).t()  # not contiguous: kept on its own
    loose.tensor_model_parallel = True
    ordered = params[::-1] + [loose]
    counted = [p.main_grad for i, p in enumerate(params) if i != 3] + [loose.grad]
    want = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in counted]).double(),
                                    norm_type)
    merged = clip_grads._coalesced(counted[::-1])
    assert sorted(t.numel() for t in merged) == [24, 36, 47]  # the gap at the 4th splits
    got = get_grad_norm(ordered, None, tp_rank=1, norm_type=norm_type)
    assert float(got) == pytest.approx(float(want), rel=1e-6)


# --- param groups ------------------------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8, dtype=dtype)
        self.fc = torch.nn.Linear(8, 8, dtype=dtype)
        self.norm = torch.nn.LayerNorm(8, dtype=dtype)
        self.head = torch.nn.Linear(8, 4, bias=False, dtype=dtype)
        self.frozen = torch.nn.Parameter(torch.zeros(3, 3, dtype=dtype), requires_grad=False)


def test_param_groups_exclude_biases_and_norms():
    net = _Net()
    groups = get_param_groups([net])
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]
    ids = lambda ps: {id(p) for p in ps}
    assert ids(groups[0]["params"]) == ids([net.emb.weight, net.fc.weight, net.head.weight])
    assert ids(groups[1]["params"]) == ids([net.fc.bias, net.norm.weight, net.norm.bias])
    custom = get_param_groups(net, no_weight_decay_cond=lambda n, p: n.startswith("emb"))
    assert ids(custom[1]["params"]) == ids([net.emb.weight])


# --- FP32 optimizer ----------------------------------------------------------------------
def _grads_for(model, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * 0.1 for p in model.parameters()
            if p.requires_grad]


def _reference_adamw(model, config, wd=0.1):
    groups = get_param_groups(model)
    for g in groups:
        g["weight_decay"] = wd * g["wd_mult"]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                             eps=config.adam_eps)


@pytest.mark.parametrize("clip", [0.0, 0.5])
def test_fp32_optimizer_equals_adamw(clip):
    torch.manual_seed(0)
    model = _Net()
    ref_model = copy.deepcopy(model)
    config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=clip)
    opt = build_optimizer(config, [model], SINGLE)
    assert isinstance(opt, FP32Optimizer) and float(opt.get_loss_scale()) == 1.0
    ref = _reference_adamw(ref_model, config)
    for step in range(3):
        for m in (model, ref_model):
            for p, g in zip([p for p in m.parameters() if p.requires_grad], _grads_for(m, step)):
                p.grad = g.clone()
        ok, norm, zeros = opt.step()
        ref_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in ref_model.parameters() if p.requires_grad], clip) if clip else None
        ref.step()
        assert ok and zeros is None
        if clip:
            assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
        else:
            assert norm is None
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


# --- mixed precision ---------------------------------------------------------------------
def _mixed_config(dtype, **kw):
    base = dict(lr=1e-2, weight_decay=0.1, clip_grad=1.0, fp16=dtype == torch.float16,
                bf16=dtype == torch.bfloat16, initial_loss_scale=2.0**8, hysteresis=2)
    base.update(kw)
    return OptimizerConfig(**base)


def _set_model_grads(model, step, dtype, scale):
    """fp16/bf16 grads (times the loss scale); returns their exact unscaled fp32 values."""
    exact = []
    for p, g in zip([p for p in model.parameters() if p.requires_grad],
                    _grads_for(model, step)):
        g = g.to(dtype).float()
        exact.append(g)
        p.grad = (g * scale).to(dtype)
    return exact


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_precision_matches_fp32_adamw(dtype):
    torch.manual_seed(0)
    model = _Net(dtype)
    ref_model = _Net().requires_grad_(True)
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref_model.frozen.requires_grad_(False)
    config = _mixed_config(dtype)
    opt = build_optimizer(config, [model], SINGLE)
    assert isinstance(opt, MixedPrecisionOptimizer)
    assert (opt.grad_scaler is None) == (dtype == torch.bfloat16)
    ref = _reference_adamw(ref_model, config)
    for step in range(3):
        scale = float(opt.get_loss_scale())
        exact = _set_model_grads(model, step, dtype, scale)
        ok, norm, _ = opt.step()
        ref_params = [p for p in ref_model.parameters() if p.requires_grad]
        for p, g in zip(ref_params, exact):
            p.grad = g
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
        ref.step()
        assert ok and float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
        opt.zero_grad()
    main = [p for g in opt.fp32_from_float16_groups for p in g]
    by_id = {id(p): q for p, q in zip(model.parameters(), ref_model.parameters())}
    model_params = [p for g in opt.float16_groups for p in g]
    for model_p, main_p in zip(model_params, main):
        torch.testing.assert_close(main_p, by_id[id(model_p)], rtol=1e-6, atol=1e-7)
        assert torch.equal(model_p, main_p.to(dtype))


def test_fp16_overflow_skips_and_backs_off_after_hysteresis():
    torch.manual_seed(0)
    model = _Net(torch.float16)
    opt = build_optimizer(_mixed_config(torch.float16), [model], SINGLE)
    before = [p.detach().clone() for p in model.parameters()]
    main_before = [p.detach().clone() for p in opt.get_parameters()]
    scales = []
    for _ in range(2):
        _set_model_grads(model, 0, torch.float16, float(opt.get_loss_scale()))
        model.fc.weight.grad[0, 0] = float("inf")
        assert opt.step() == (False, None, None)
        opt.zero_grad()
        scales.append(float(opt.get_loss_scale()))
    assert scales == [256.0, 128.0]  # hysteresis 2: the second overflow halves
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    for p, q in zip(opt.get_parameters(), main_before):
        assert torch.equal(p, q)
    _set_model_grads(model, 0, torch.float16, float(opt.get_loss_scale()))
    ok, norm, _ = opt.step()
    assert ok and math.isfinite(float(norm))
    assert not torch.equal(model.fc.weight, before[1])
    loss = torch.tensor(2.0, dtype=torch.float16)
    assert float(opt.scale_loss(loss)) == 256.0


def test_bf16_nonfinite_grad_reported_in_norm():
    model = _Net(torch.bfloat16)
    opt = build_optimizer(_mixed_config(torch.bfloat16), [model], SINGLE)
    _set_model_grads(model, 0, torch.bfloat16, 1.0)
    model.fc.weight.grad[0, 0] = float("nan")
    ok, norm, _ = opt.step()
    assert ok and math.isnan(float(norm))
    assert float(opt.get_loss_scale()) == 1.0


def _skip_worker(rank, world_size, sizes):
    ps = ParallelState.build(world_size, rank, **sizes)
    model = _Net(torch.float16)
    opt = build_optimizer(_mixed_config(torch.float16), [model], ps)
    _set_model_grads(model, 0, torch.float16, float(opt.get_loss_scale()))
    if rank == 1:
        model.head.weight.grad[0, 0] = float("inf")
    ok, _, _ = opt.step()
    return ok


@pytest.mark.parametrize("sizes", [dict(tp_size=2), dict(pp_size=2)], ids=["tp2", "pp2"])
def test_overflow_on_one_rank_skips_everywhere(sizes):
    """An overflow in one tensor-parallel shard or one pipeline stage skips the step on
    every rank of the model (Megatron's MAX over the model-parallel group)."""
    assert run_distributed(_skip_worker, 2, sizes) == [False, False]


def _train(model, opt, dtype, steps, start):
    for step in range(start, start + steps):
        if dtype == torch.float32:
            for p, g in zip([p for p in model.parameters() if p.requires_grad],
                            _grads_for(model, step)):
                p.grad = g
        else:
            _set_model_grads(model, step, dtype, float(opt.get_loss_scale()))
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_dict_round_trip_gives_identical_steps(dtype, tmp_path):
    torch.manual_seed(0)
    config = _mixed_config(dtype) if dtype != torch.float32 else OptimizerConfig(lr=1e-2)
    model = _Net(dtype)
    opt = build_optimizer(config, [model], SINGLE)
    _train(model, opt, dtype, 2, 0)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    _train(model, opt, dtype, 2, 2)
    ckpt = torch.load(tmp_path / "c.pt", weights_only=True)
    if dtype != torch.float32:
        assert set(ckpt["optimizer"]) >= {"optimizer", "fp32_from_fp16_params"}
        assert ("grad_scaler" in ckpt["optimizer"]) == (dtype == torch.float16)
    torch.manual_seed(1)
    model2 = _Net(dtype)
    opt2 = build_optimizer(config, [model2], SINGLE)
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    _train(model2, opt2, dtype, 2, 2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    for p, q in zip(opt.get_parameters(), opt2.get_parameters()):
        assert torch.equal(p, q)
    assert float(opt.get_loss_scale()) == float(opt2.get_loss_scale())


@pytest.mark.parametrize("saved, loaded, scale, warning", [
    # a constant --loss-scale saves {}: Megatron-LM's dynamic scaler met a KeyError there
    (dict(loss_scale=128.0), dict(), 256.0, "constant --loss-scale; the dynamic loss scale "
                                            "starts at --initial-loss-scale 256"),
    (dict(dtype=torch.bfloat16), dict(), 256.0, "no loss scaler"),
    (dict(), dict(dtype=torch.bfloat16), 1.0, "uses none"),
    (dict(), dict(loss_scale=32.0), 32.0, None),  # the constant --loss-scale asked for
    (dict(), dict(), 128.0, None),  # the saved dynamic scale: 256 halved by the overflow
])
def test_loss_scaler_kind_changed_on_resume(saved, loaded, scale, warning):
    def build(kw):
        kw = dict(kw)
        dtype = kw.pop("dtype", torch.float16)
        model = _Net(dtype)
        return model, build_optimizer(_mixed_config(dtype, hysteresis=1, **kw), [model], SINGLE)

    model, opt = build(saved)
    _set_model_grads(model, 0, model.fc.weight.dtype, float(opt.get_loss_scale()))
    model.fc.weight.grad[0, 0] = float("inf")
    opt.step()
    _, opt2 = build(loaded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    messages = [str(w.message) for w in caught]
    assert float(opt2.get_loss_scale()) == scale
    if warning is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warning in messages[0], messages


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_resume_keeps_the_command_lines_adam_hyperparameters(dtype):
    """torch's load_state_dict (apex's under Megatron-LM) restores the saved betas and eps:
    a changed --adam-beta2 / --adam-eps was silently dropped on resume."""
    def build(**kw):
        model = _Net(dtype)
        config = (_mixed_config(dtype, **kw) if dtype != torch.float32
                  else OptimizerConfig(lr=1e-2, **kw))
        return model, build_optimizer(config, [model], SINGLE)

    model, opt = build()
    _train(model, opt, dtype, 1, 0)
    _, opt2 = build(adam_beta2=0.95, adam_eps=1e-6)
    notes = opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert notes == ["--adam-beta1/--adam-beta2: using the command line's 0.9 0.95, not the "
                     "checkpoint's 0.9 0.999",
                     "--adam-eps: using the command line's 1e-06, not the checkpoint's 1e-08"]
    for group in opt2.optimizer.param_groups:
        assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-6
    assert all("exp_avg" in s for s in opt2.optimizer.state.values())  # the state loaded
    _, same = build()
    assert same.load_state_dict(copy.deepcopy(opt.state_dict())) == []


def test_resume_with_another_optimizer_kind_is_refused():
    """An Adam checkpoint in an SGD run stopped in the first step with KeyError 'momentum'."""
    model = _Net()
    adam = build_optimizer(OptimizerConfig(lr=1e-2), [model], SINGLE)
    _train(model, adam, torch.float32, 1, 0)
    sgd = build_optimizer(OptimizerConfig(lr=1e-2, optimizer="sgd"), [model], SINGLE)
    with pytest.raises(ValueError, match="optimizer state is --optimizer adam's but this run "
                                         "uses --optimizer sgd: resume with --optimizer adam, "
                                         "or pass --no-load-optim"):
        sgd.load_state_dict(adam.state_dict())
    with pytest.raises(ValueError, match="is --optimizer sgd's but this run uses --optimizer adam"):
        adam.load_state_dict(sgd.state_dict())


def test_reload_model_params_and_apex_style_state():
    model = _Net(torch.bfloat16)
    opt = build_optimizer(_mixed_config(torch.bfloat16), [model], SINGLE)
    with torch.no_grad():
        model.fc.weight.fill_(0.5)
    opt.reload_model_params()
    main_fc = opt.fp32_from_float16_groups[0][1]
    assert torch.equal(main_fc, torch.full_like(main_fc, 0.5))
    fp32_model = _Net()
    fp32_opt = build_optimizer(OptimizerConfig(lr=1e-2), [fp32_model], SINGLE)
    _train(fp32_model, fp32_opt, torch.float32, 2, 0)
    sd = fp32_opt.state_dict()
    for state in sd["state"].values():
        del state["step"]  # apex FusedAdam keeps the step count in the group
    for group in sd["param_groups"]:
        group["step"] = 2
    fresh = build_optimizer(OptimizerConfig(lr=1e-2), [fp32_model], SINGLE)
    fresh.load_state_dict(sd)
    _train(fp32_model, fresh, torch.float32, 1, 2)
    assert float(next(iter(fresh.state.values()))["step"]) == 3.0


def test_sgd_and_unknown_optimizer():
    model = _Net()
    opt = build_optimizer(OptimizerConfig(optimizer="sgd", lr=0.1, weight_decay=0.0,
                                          clip_grad=0.0), [model], SINGLE)
    w = model.fc.weight.detach().clone()
    model.fc.weight.grad = torch.ones_like(w)
    opt.step()
    torch.testing.assert_close(model.fc.weight, w - 0.1)
    with pytest.raises(ValueError, match="lamb"):
        build_optimizer(OptimizerConfig(optimizer="lamb"), [model], SINGLE)


def _hand_step(kind, w, g, st, cfg, no_wd, coeff):
    """Megatron-LM 23.05's update of one fp32 tensor, written from apex's documented
    semantics: FusedAdam in AdamW mode (decoupled decay, bias-corrected moments) or FusedSGD
    (L2 decay added to the gradient, momentum buffer = gradient at the first step)."""
    g, wd = g * coeff, 0.0 if no_wd else cfg.weight_decay
    if kind == "sgd":
        d = g + wd * w
        st["buf"] = d if "buf" not in st else cfg.sgd_momentum * st["buf"] + d
        return w - cfg.lr * st["buf"]
    k = st["k"] = st.get("k", 0) + 1
    b1, b2 = cfg.adam_beta1, cfg.adam_beta2
    st["m"] = b1 * st.get("m", 0.0) + (1 - b1) * g
    st["v"] = b2 * st.get("v", 0.0) + (1 - b2) * g * g
    m_hat, v_hat = st["m"] / (1 - b1 ** k), st["v"] / (1 - b2 ** k)
    return w - cfg.lr * (m_hat / (v_hat.sqrt() + cfg.adam_eps) + wd * w)


@pytest.mark.parametrize("kind, clip", [("adam", 0.0), ("adam", 0.3), ("sgd", 0.0),
                                        ("sgd", 0.3)])
def test_steps_equal_megatrons_update_written_by_hand(kind, clip):
    """Two steps of --optimizer adam|sgd with weight decay (not on biases and norms) and
    --clip-grad (global L2 norm; 0: off) against the formulas, in float64; the reported grad
    norm and zero count against hand counts."""
    torch.manual_seed(0)
    model = _Net()
    cfg = OptimizerConfig(optimizer=kind, lr=0.05, weight_decay=0.2, clip_grad=clip,
                          adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-3, sgd_momentum=0.7,
                          log_num_zeros_in_grad=True)
    opt = build_optimizer(cfg, [model], SINGLE)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    states = {n: {} for n, _ in named}
    for step in range(2):
        grads = _grads_for(model, step)
        grads[0][3] = 0.0  # an embedding row no token used: 8 zero elements
        before = {n: p.detach().double().clone() for n, p in named}
        for (_, p), g in zip(named, grads):
            p.grad = g.clone()
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
        coeff = min(1.0, clip / (norm + 1e-6)) if clip else 1.0
        ok, grad_norm, zeros = opt.step()
        assert ok and float(zeros) == sum(int((g == 0).sum()) for g in grads) >= 8
        assert (grad_norm is None) if not clip else float(grad_norm) == pytest.approx(norm)
        for (n, p), g in zip(named, grads):
            no_wd = n.endswith(".bias") or p.dim() == 1
            want = _hand_step(kind, before[n], g.double(), states[n], cfg, no_wd, coeff)
            torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6,
                                       msg=f"{kind} step {step + 1}: {n}")
        opt.zero_grad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clip_folded_into_fused_adam_equals_unfused(dtype):
    """The fused path divides grads by 1/clip-coefficient inside the Adam kernel instead of
    scaling them first: parameters after 3 clipped steps equal the unfused path."""
    torch.manual_seed(0)
    base = _Net().to(dtype)
    results = []
    for fused in (False, True):
        model = copy.deepcopy(base)
        config = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.05, use_fused=fused,
                                 bf16=dtype == torch.bfloat16)
        opt = build_optimizer(config, [model], SINGLE)
        assert opt._inner_is_fused() == fused
        norms = []
        for step in range(3):
            for p, g in zip([p for p in model.parameters() if p.requires_grad],
                            _grads_for(model, step)):
                p.grad = g.to(dtype)
            ok, norm, _ = opt.step()
            assert ok
            norms.append(float(norm))
            opt.zero_grad()
        results.append((norms, [p.detach().float().clone() for p in model.parameters()]))
    (n0, p0), (n1, p1) = results
    assert n0 == pytest.approx(n1, rel=1e-6)
    for a, b in zip(p0, p1):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
