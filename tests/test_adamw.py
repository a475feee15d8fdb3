"""megatron/core/optimizer/adamw.py: torch's AdamW without importing torch._dynamo.

The arithmetic must equal torch's kernels bit for bit (single-tensor and foreach), the
state must be torch's (checkpoints load into either class), and a process that only steps
the optimizer must not import torch._dynamo."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.core.optimizer.adamw import AdamW

ROOT = Path(__file__).resolve().parents[1]


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    return [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]


def _groups(params):
    return [{"params": params[:2], "weight_decay": 0.1},
            {"params": params[2:], "weight_decay": 0.0}]


def _step_both(opts, params_sets, step, gen):
    """One step of each optimizer with the same gradients; the last parameter gets no
    gradient on odd steps, and the learning rate changes as a scheduler would change it."""
    grads = [torch.randn(p.shape, generator=gen) for p in params_sets[0]]
    for opt, params in zip(opts, params_sets):
        for i, (p, g) in enumerate(zip(params, grads)):
            p.grad = None if (step % 2 and i == len(params) - 1) else g.clone()
        for group in opt.param_groups:
            group["lr"] = 1e-2 / (1 + step)
        opt.step()


def _assert_same(opt_a, opt_b, params_a, params_b):
    for pa, pb in zip(params_a, params_b):
        assert torch.equal(pa, pb)
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype and sa[key].device == sb[key].device
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("foreach", [False, True])
def test_steps_equal_torch_adamw_bit_for_bit(foreach):
    ours_p, theirs_p = _params(), _params()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ours = AdamW(_groups(ours_p), **kw)
    theirs = torch.optim.AdamW(_groups(theirs_p), foreach=foreach, **kw)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        _step_both([ours, theirs], [ours_p, theirs_p], step, gen)
    _assert_same(ours, theirs, ours_p, theirs_p)
    assert ours.state[ours_p[-1]]["step"].item() == 3  # stepped on even steps only


def test_state_dict_is_torch_s_and_loads_both_ways():
    kw = dict(lr=1e-2, weight_decay=0.1)
    ours_p, theirs_p = _params(), _params()
    ours, theirs = AdamW(_groups(ours_p), **kw), torch.optim.AdamW(_groups(theirs_p), **kw)
    gen = torch.Generator().manual_seed(2)
    for step in range(3):
        _step_both([ours, theirs], [ours_p, theirs_p], step, gen)
    saved_ours, saved_theirs = ours.state_dict(), theirs.state_dict()
    assert saved_ours["param_groups"] == saved_theirs["param_groups"]
    assert saved_ours["state"].keys() == saved_theirs["state"].keys()
    # swap: each continues from the other's state; results stay equal
    ours_q, theirs_q = _params(5), _params(5)
    for q, p in zip(ours_q + theirs_q, ours_p + theirs_p):
        q.data.copy_(p.data)
    ours2 = AdamW(_groups(ours_q), **kw)
    theirs2 = torch.optim.AdamW(_groups(theirs_q), **kw)
    ours2.load_state_dict(saved_theirs)
    theirs2.load_state_dict(saved_ours)
    for step in range(3, 5):
        _step_both([ours2, theirs2], [ours_q, theirs_q], step, gen)
    _assert_same(ours2, theirs2, ours_q, theirs_q)


def test_zero_grad_closure_and_torch_only_options():
    p = _params()
    opt = AdamW(p, lr=0.1)
    for q in p:
        q.grad = torch.ones_like(q)
    opt.zero_grad()
    assert all(q.grad is None for q in p)
    calls = []

    def closure():
        calls.append(torch.is_grad_enabled())
        for q in p:
            q.grad = torch.ones_like(q)
        return torch.tensor(3.0)

    assert opt.step(closure).item() == 3.0 and calls == [True]
    # amsgrad is torch's step: the results equal torch's
    a, b = _params(), _params()
    ours, theirs = AdamW(a, lr=0.1, amsgrad=True), torch.optim.AdamW(b, lr=0.1, amsgrad=True)
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        _step_both([ours, theirs], [a, b], step, gen)
    _assert_same(ours, theirs, a, b)


def test_sparse_gradient_names_the_fix():
    p = torch.nn.Parameter(torch.zeros(4, 2))
    opt = AdamW([p], lr=0.1)
    p.grad = torch.zeros(4, 2).to_sparse()
    with pytest.raises(RuntimeError, match="SparseAdam"):
        opt.step()


def test_a_process_that_only_steps_never_imports_dynamo():
    """The point of the class: building, stepping, zeroing and saving/loading its state
    leaves torch._dynamo out of the process (1.5-2.5 s of CPU per rank process)."""
    code = (
        "import sys, torch\n"
        "from megatron.core.optimizer.adamw import AdamW\n"
        "p = [torch.nn.Parameter(torch.ones(3))]\n"
        "opt = AdamW([{'params': p, 'weight_decay': 0.1}], lr=0.1)\n"
        "p[0].grad = torch.ones(3)\n"
        "opt.step(); opt.zero_grad(); opt.load_state_dict(opt.state_dict())\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                      "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
