"""The Triton AdamW kernel (`--adam-kernel`), run on the CPU through Triton's interpreter
(TRITON_INTERPRET=1; skipped where Triton is not installed).

- Kernel against torch's AdamW: parameters of odd sizes (block tails), two groups with
  different weight decay, gradients as views of one flat buffer, clipping as a divisor:
  after 3 steps main params and both moments within 1e-6 * (1 + max|value|) of torch's
  (fp32 rounding of a different operation order), the bf16
  model copies equal to the main params rounded to bf16, `step` counted in the state.
- Training through the optimizer wrappers (fp32, and bf16 with an fp32 grad buffer): 4
  iterations with --adam-kernel triton give the losses of --adam-kernel torch (fp32:
  within 1e-5; bf16: within 1e-3, an ulp of an fp32 weight can flip a bf16 one); the state
  saved after them loads into a fresh run whose next 2 losses match the torch run's.
- The choices it cannot honour are refused with the fix named.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed")

from megatron.core.optimizer.multi_tensor_adam import BLOCK, MultiTensorAdamW  # noqa: E402
from megatron.step_graph import settle  # noqa: E402
from megatron.training import train_step  # noqa: E402
from tests.gpt_helpers import cli_trainer, train_steps  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(request, monkeypatch):
    """Tests on CPU tensors run the kernel in Triton's interpreter; the CUDA test compiles
    it, and so do the training tests where CUDA is visible (the model is built there)."""
    from megatron.core.optimizer import multi_tensor_adam

    on_gpu = "any_device" in request.keywords and torch.cuda.is_available()
    if "cuda" in request.keywords or on_gpu:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        monkeypatch.setattr(multi_tensor_adam, "INTERPRET_ON_CPU", False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(multi_tensor_adam, "INTERPRET_ON_CPU", True)


SIZES = [(5,), (BLOCK + 3,), (2 * BLOCK,), (37, 61)]


def _problem(seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    flat = torch.zeros(sum(torch.Size(s).numel() for s in SIZES), device=device)
    params, grads, offset = [], [], 0
    for shape in SIZES:
        n = torch.Size(shape).numel()
        params.append(torch.nn.Parameter(torch.randn(shape, generator=gen).to(device)))
        grads.append(flat[offset:offset + n].view(shape))
        offset += n
    return params, grads, flat, gen


def _optimizer(params):
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


@pytest.mark.parametrize("clip", [False, True])
def test_kernel_matches_torch_adamw(clip, device="cpu"):
    params, grads, flat, gen = _problem(0, device)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = _optimizer(params), _optimizer(ref)
    models = [[p.detach().to(torch.bfloat16) for p in g["params"]] for g in ours.param_groups]
    stepper = MultiTensorAdamW(ours, models)
    for _ in range(3):
        flat.copy_(torch.randn(flat.shape, generator=gen))
        scale = torch.tensor(2.5, device=device) if clip else None
        for p, g in zip(params, grads):
            p.grad = g
        for r, g in zip(ref, grads):
            r.grad = g.clone() / (scale if clip else 1.0)
        assert stepper.step(scale)
        theirs.step()
    for p, r in zip(params, ref):
        for a, b in ((p, r), (ours.state[p]["exp_avg"], theirs.state[r]["exp_avg"]),
                     (ours.state[p]["exp_avg_sq"], theirs.state[r]["exp_avg_sq"])):
            diff = (a - b).abs().max().item()
            assert diff <= 1e-6 * (1 + b.abs().max().item()), diff  # fp32 rounding only
        assert float(ours.state[p]["step"]) == 3.0
    flat_models = [m for g in models for m in g]
    for p, m in zip(params, flat_models):
        assert torch.equal(m, p.detach().to(torch.bfloat16))


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_kernel_reads_16_bit_grads_and_a_skip_flag(grad_dtype, device="cpu"):
    """Gradients given as 16-bit tensors (a `grads()` function, as the fp16 grad buffer)
    are widened exactly: the same update as torch's AdamW on their fp32 values (within
    fp32 rounding). A launched step with the skip flag set changes nothing: parameters,
    moments, model copies and step counts stay bitwise as they were."""
    params, _, _, gen = _problem(1, device)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = _optimizer(params), _optimizer(ref)
    models = [[p.detach().to(grad_dtype) for p in g["params"]] for g in ours.param_groups]
    grads16 = [torch.zeros_like(p, dtype=grad_dtype) for p in params]
    by_group = [grads16[:2], grads16[2:]]
    stepper = MultiTensorAdamW(ours, models, lambda: by_group)
    scale = torch.tensor(1024.0, device=device)  # a loss scale: grads arrive scaled
    for _ in range(2):
        for g in grads16:
            g.copy_(torch.randn(g.shape, generator=gen) * 1024)
        for r, g in zip(ref, grads16):
            r.grad = g.float() / 1024.0
        assert stepper.step(scale)
        theirs.step()
    for p, r in zip(params, ref):
        diff = (p - r).abs().max().item()
        assert diff <= 1e-6 * (1 + r.abs().max().item()), diff
    before = ([p.detach().clone() for p in params],
              [ours.state[p]["exp_avg"].clone() for p in params],
              [m.clone() for g in models for m in g],
              [float(ours.state[p]["step"]) for p in params])
    assert stepper.step(scale, skip=torch.tensor(1.0, device=device))
    after = ([p.detach() for p in params], [ours.state[p]["exp_avg"] for p in params],
             [m for g in models for m in g], [float(ours.state[p]["step"]) for p in params])
    for was, now in zip(before[:3], after[:3]):
        assert all(torch.equal(a, b) for a, b in zip(was, now))
    assert before[3] == after[3] == [2.0] * len(params)
    assert stepper.step(scale, skip=torch.tensor(0.0, device=device))  # a kept step counts
    assert {float(ours.state[p]["step"]) for p in params} == {3.0}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("clip", [False, True])
def test_kernel_matches_torch_adamw_on_cuda(clip):
    """The compiled kernel on the GPU: same checks (bf16 copies exactly rounded)."""
    test_kernel_matches_torch_adamw(clip, device="cuda")


def test_stale_tables_are_rebuilt_after_the_state_is_replaced():
    params, grads, flat, gen = _problem(1)
    opt = _optimizer(params)
    stepper = MultiTensorAdamW(opt, [[None] * len(g["params"]) for g in opt.param_groups])
    for p, g in zip(params, grads):
        p.grad = g
    flat.copy_(torch.randn(flat.shape, generator=gen))
    assert stepper.step()
    saved = {k: v for k, v in opt.state_dict().items()}
    before = [p.detach().clone() for p in params]
    opt.load_state_dict(saved)  # replaces every state tensor
    assert stepper.step()
    assert all(float(opt.state[p]["step"]) == 2.0 for p in params)
    assert not any(torch.equal(a, p) for a, p in zip(before, params))


ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "8", "--lr", "3e-3", "--mock-data",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "127", "--bf16",
        "--clip-grad", "0.05", "--weight-decay", "0.1", "--lr-warmup-iters", "1", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0"]


def _trainer(kernel: str, extra=(), argv=ARGV):
    from megatron.training import data_iterator

    # on a GPU machine the trainer runs on CUDA: --adam-kernel triton is validated for it
    # (validated for the CPU, the kernel was refused there)
    cfg, rt, tr = cli_trainer(list(argv) + ["--adam-kernel", kernel, "--no-compile", *extra],
                              cuda_available=torch.cuda.is_available())
    return tr, data_iterator(cfg, rt, "train", 0)


@pytest.mark.any_device
@pytest.mark.parametrize("precision,atol", [("--fp32", 1e-5), ("--bf16", 1e-3)])
def test_training_with_the_kernel_matches_torch_and_resumes(precision, atol):
    """fp32: the kernel's rounding differs from torch's by ulps (atol 1e-5 on the loss);
    bf16: such differences can flip the last bit of a bf16 weight (atol 1e-3), and the
    bf16 model weights are exactly the fp32 main weights rounded to nearest even."""
    argv = [a for a in ARGV if a != "--bf16"] + ([precision] if precision == "--bf16" else [])
    torch_tr, torch_data = _trainer("torch", argv=argv)
    expected = train_steps(torch_tr, torch_data, 6)
    tri_tr, tri_data = _trainer("triton", argv=argv)
    got = train_steps(tri_tr, tri_data, 4)
    assert tri_tr.optimizer._multi, "the Triton kernel did not step"
    assert torch.allclose(torch.tensor(got), torch.tensor(expected[:4]), rtol=0, atol=atol)
    if precision == "--bf16":
        for model, main in tri_tr.optimizer._model_main_pairs():
            assert torch.equal(model, main.to(model.dtype))
    # Save the Triton run's state, load it into a fresh Triton run, continue two steps.
    resumed, resumed_data = _trainer("triton", argv=argv)
    resumed.model.unwrapped()[0].load_state_dict(tri_tr.model.unwrapped()[0].state_dict())
    resumed.optimizer.load_state_dict(tri_tr.optimizer.state_dict())
    resumed.scheduler.load_state_dict(tri_tr.scheduler.state_dict())
    resumed.state.iteration = tri_tr.state.iteration
    for _ in range(4 * 2):  # 4 iterations of 2 micro-batches
        next(resumed_data)
    assert torch.allclose(torch.tensor(train_steps(resumed, resumed_data, 2)),
                          torch.tensor(expected[4:]), rtol=0, atol=atol)


@pytest.mark.any_device
def test_fp16_training_reads_the_16_bit_grad_buffer_and_matches_torch():
    """fp16 (grad buffer in fp16, dynamic loss scale starting where it overflows now and
    then): the kernel reads the scaled fp16 gradients as they are, with the unscaling and
    the clip folded into its divisor and the overflow check taken from the norm; the
    torch path copies them to fp32, unscales, checks and clips in separate passes. Same
    skipped steps, losses within 1e-3 (an ulp of an fp32 weight can flip an fp16 one),
    grad norms within 1e-4 relative, same loss scale; the fp16 weights are the fp32 main
    weights rounded, and Adam's step count is the number of kept steps."""
    argv = [a for a in ARGV if a != "--bf16"] + ["--fp16", "--initial-loss-scale", "1048576"]
    runs = {}
    for kernel in ("torch", "triton"):
        tr, data = _trainer(kernel, argv=argv)
        rows = []
        for _ in range(8):
            loss, ok, norm, _ = train_step(tr, data)
            tr.state.iteration += 1
            # a replayed fp16 step (CUDA: the whole-step graph) returns its flag as a device
            # tensor and the norm even when it skipped; the training loop resolves both
            ok = bool(ok)
            rows.append((float(loss), ok, None if norm is None or not ok else float(norm)))
        settle(tr)  # the last replay's flag read: step counts exact
        runs[kernel] = (tr, rows)
    (torch_tr, expected), (tri_tr, got) = runs["torch"], runs["triton"]
    assert tri_tr.optimizer._multi and not torch_tr.optimizer._multi
    assert {t.grad_dtype for t in tri_tr.optimizer._multi.tables} == {torch.float16}
    assert [r[1] for r in got] == [r[1] for r in expected]
    assert not all(r[1] for r in got) and any(r[1] for r in got)
    for (loss, ok, norm), (ref_loss, _, ref_norm) in zip(got, expected):
        assert abs(loss - ref_loss) <= 1e-3
        assert (norm is None) == (ref_norm is None) == (not ok)
        assert norm is None or abs(norm - ref_norm) <= 1e-4 * ref_norm
    assert float(tri_tr.optimizer.get_loss_scale()) == float(torch_tr.optimizer.get_loss_scale())
    for model, main in tri_tr.optimizer._model_main_pairs():
        assert model.dtype == torch.float16 and torch.equal(model, main.to(model.dtype))
    kept = sum(r[1] for r in got)
    assert {float(s["step"]) for s in tri_tr.optimizer.optimizer.state.values()} == {float(kept)}


@pytest.mark.any_device
def test_insisting_on_triton_where_it_cannot_run_is_refused():
    """Refused by the flag validation, before anything is built (it was a ValueError at
    the first optimizer step); the optimizer's own check stays for library callers."""
    from megatron.arguments import ArgumentsError

    with pytest.raises(ArgumentsError, match="--adam-kernel triton cannot be used: it steps "
                                             "AdamW, not --optimizer sgd"):
        _trainer("triton", ["--optimizer", "sgd"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_kernel_reads_16_bit_grads_and_a_skip_flag_on_cuda(grad_dtype):
    """The compiled kernel on the GPU: same checks."""
    test_kernel_reads_16_bit_grads_and_a_skip_flag(grad_dtype, device="cuda")
