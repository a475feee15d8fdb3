"""The switch MLP's experts as two grouped GEMMs: a dispatch with no host sync.

Shape legend: t = tokens (s * b), sorted by expert where named `_sorted`; h = hidden;
f = fc1's output width on this rank (ffn / tp, twice that with SwiGLU); g = fc2's input
width on this rank (ffn / tp); E = experts; k, n = a GEMM's input and output widths.

Why. The loop dispatch (`SwitchMLP._experts_loop`) cuts the sorted tokens per expert with
counts read on the host (`bincount(...).tolist()`, a device-to-host copy that waits for
the GPU in every layer) and then runs E small MLPs from Python, each a dozen kernel
launches. Here the counts never leave the device: they become the int32 end offsets of
`torch._grouped_mm`, which runs every expert's fc1 (and then fc2) as one kernel, an empty
expert contributing nothing. Every shape is then fixed by (s, b, h, E), so the step can
be captured as one CUDA graph.

Parameters. Each expert keeps its own ParallelMLP and parameters: checkpoint names, TP
splits, initialisation and DDP buckets are those of the loop dispatch. `GroupedLinear`
takes the experts' local weight shards as they are and stacks them into [E, n, k] for its
products (in the forward, and again in the backward rather than keeping a second copy of
the weights alive in between); its weight-gradient product [E, n, k] is handed back as one
ordinary `.grad` per expert weight (zeros for an expert without tokens), and the biases'
gradients come back per expert the same way. The DDP grad hook moves them into
`main_grad` (a copy where the buffer was left stale, an add otherwise). So every expert's
parameters get a gradient in every step on every rank, as with the loop; with
gradient-accumulation fusion the expert weights' gradients take this route too (one
[E, n, k] product per GEMM instead of E products accumulated into main_grad; in bf16 each
micro-batch's weight gradient is thus rounded to bf16 before its fp32 add, as without
fusion, since the grouped GEMM writes only bf16).

Tensor parallelism, as in ParallelMLP: the input enters through `copy_to_tp` (forward
identity, backward all-reduce of its gradient over TP), fc2's partial products leave
through `reduce_from_tp` (forward all-reduce, backward identity); fc2's bias is returned
for the caller to add after the reduction. (Sequence parallelism is refused with experts.)

Availability. `grouped_mm_works` runs `GroupedLinear`'s three grouped products (forward,
input and weight grads) on small operands once per (device, dtype, k, n), with an empty
expert, and compares them with per-expert matmuls;
where the operator is missing or refuses the layout (torch builds without it, CUDA dtypes
or GPUs it does not support, a width that breaks its 16-byte stride rule) the switch MLP
keeps the loop dispatch. `sync_free` says where the grouped kernel is known to run
entirely on the device (the CPU, and bf16 on Hopper-class GPUs with torch's native
kernel): only there may the whole step be captured as a CUDA graph.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel.mappings import copy_to_tp, reduce_from_tp

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


class GroupedLinear(torch.autograd.Function):
    """y_sorted[t] = x_sorted[t] @ W_e(t)^T for tokens sorted by expert, expert e owning
    rows offs[e-1]:offs[e] (offs: int32 end offsets, offs[-1] = t), W_e = weights[e].

    The experts' weights are stacked into [E, n, k] for the product and again in the
    backward (not kept: a saved stack would hold a second copy of every expert's weights
    per layer until the backward). Backward: grad_x = grad_y grouped with the stack (same
    offsets); grad_W_e = grad_y[rows of e]^T x[rows of e], one grouped product over the
    token dimension (zeros for an expert without rows), handed to each weight as its own
    gradient. No communication. The incoming gradient is made dense first: the kernel
    refuses stride-0 (expanded) operands, e.g. the gradient of a `.sum()`."""

    @staticmethod
    def forward(ctx, x_tk: torch.Tensor, offs_e: torch.Tensor, *weights_nk: torch.Tensor):
        ctx.save_for_backward(x_tk, offs_e, *weights_nk)
        return _GROUPED_MM(x_tk, torch.stack(weights_nk).transpose(1, 2), offs_e)

    @staticmethod
    def backward(ctx, grad_tn: torch.Tensor):
        x_tk, offs_e, *weights_nk = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[2:])
        w_enk = torch.stack(weights_nk) if want_x else None
        grad_x, grad_w = _grouped_grads(grad_tn, x_tk, w_enk, offs_e, want_x, want_w)
        grad_ws = grad_w.unbind(0) if want_w else (None,) * len(weights_nk)
        return (grad_x, None, *grad_ws)


def _grouped_grads(grad_tn, x_tk, w_enk, offs_e, want_x: bool = True, want_w: bool = True):
    """(grad_x [t, k], grad_w [E, n, k]) of y = x grouped with w_enk^T."""
    grad_tn = grad_tn.contiguous()
    grad_x = _GROUPED_MM(grad_tn, w_enk, offs_e) if want_x else None
    grad_w = _GROUPED_MM(grad_tn.t(), x_tk, offs_e) if want_w else None
    return grad_x, grad_w


def grouped_linear(x_tk: torch.Tensor, offs_e: torch.Tensor, weights_nk: Sequence[torch.Tensor]):
    """Functional form of `GroupedLinear` (see there)."""
    return GroupedLinear.apply(x_tk, offs_e, *weights_nk)


class ExpertParams(nn.Module):
    """Identity on the parameters it is called with. The DDP wrapper's forward pre-hook
    (`--overlap-param-gather`) waits for the all-gather of the buckets of the parameters
    owned by or passed to the module called; the grouped dispatch calls none of the
    experts' own modules, so it passes their parameters through this one first."""

    def forward(self, *params: torch.Tensor):
        return params


def expert_offsets(expert_sorted_t: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 end offsets of each expert's rows in the sorted token order: the number of
    sorted ids <= e, for e = 0..E-1 (a binary search on the device, no host sync)."""
    ids = torch.arange(num_experts, device=expert_sorted_t.device, dtype=expert_sorted_t.dtype)
    return torch.searchsorted(expert_sorted_t, ids, right=True).to(torch.int32)


def expert_rows(expert_t: torch.Tensor, rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """[t, n]: row expert_t[i] of the stacked `rows` (E vectors [n], e.g. biases) for
    each token i. A gather; its backward sums the gradient per expert, on CUDA by
    embedding's sorted backward (no atomics: deterministic)."""
    return F.embedding(expert_t, torch.stack(rows))


def experts_forward(x_sorted_th: torch.Tensor, expert_sorted_t: torch.Tensor,
                    fc1_weights: Sequence[torch.Tensor],
                    fc1_biases: Optional[Sequence[torch.Tensor]],
                    fc2_weights: Sequence[torch.Tensor],
                    activation: Callable[[torch.Tensor], torch.Tensor], tp_group):
    """Every expert's MLP (without fc2's bias) on its tokens: [t, h] in the sorted order.

    The weights are this rank's shards, one per expert: fc1 [f, h], its bias [f] (or
    None for all), fc2 [h, g]. Collectives: backward all-reduce of the input grad over TP
    (copy_to_tp), forward all-reduce of fc2's partial products (reduce_from_tp)."""
    offs_e = expert_offsets(expert_sorted_t, len(fc1_weights))
    x_th = copy_to_tp(x_sorted_th, tp_group)
    h_tf = grouped_linear(x_th, offs_e, fc1_weights)
    if fc1_biases is not None:
        h_tf = h_tf + expert_rows(expert_sorted_t, fc1_biases)
    out_th = grouped_linear(activation(h_tf), offs_e, fc2_weights)
    return reduce_from_tp(out_th, tp_group)


def _probe_values(num_experts: int, n: int, k: int, device, dtype) -> torch.Tensor:
    # deterministic values (no random generator is drawn from: a probe must not shift
    # the run's random streams), distinct per expert and small enough to stay exact-ish
    # in bf16
    grid = torch.arange(num_experts * n * k, device=device, dtype=torch.float32)
    return (torch.sin(grid) / 4).to(dtype).view(num_experts, n, k)


@functools.lru_cache(maxsize=None)
def grouped_mm_works(device: torch.device, dtype: torch.dtype, k: int, n: int) -> bool:
    """Whether `GroupedLinear` runs here (forward, input and weight grads) for [t, k] x
    [E, n, k] operands and agrees with per-expert matmuls, an expert without tokens
    included. Decided once per (device, dtype, k, n); False on any error."""
    if _GROUPED_MM is None or device.type == "meta":
        return False
    offs = torch.tensor([3, 3, 16], dtype=torch.int32, device=device)  # expert 1 is empty
    x = _probe_values(1, 16, k, device, dtype)[0]
    w = _probe_values(3, n, k, device, dtype)
    grad = torch.ones((), device=device, dtype=dtype).expand(16, n)  # as from a .sum()
    # No autograd here: the first call may come inside an activation checkpoint, whose
    # recompute must save the same tensors as the original forward.
    try:
        with torch.no_grad():
            y = _GROUPED_MM(x, w.transpose(1, 2), offs)
            gx, gw = _grouped_grads(grad, x, w, offs)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    x, w, y, gx, gw = (t.float() for t in (x, w, y, gx, gw))
    rows = (slice(0, 3), slice(3, 3), slice(3, 16))
    ref = torch.cat([x[r] @ w[e].t() for e, r in enumerate(rows)])
    ref_gx = torch.cat([w[e].sum(0).expand(r.stop - r.start, k) for e, r in enumerate(rows)])
    ref_gw = torch.stack([x[r].sum(0).expand(n, k) for r in rows])  # expert 1: zeros
    low = dtype in (torch.bfloat16, torch.float16)
    tol = dict(rtol=2e-2, atol=2e-2) if low else dict(rtol=1e-4, atol=1e-5)
    return (torch.allclose(y, ref, **tol) and torch.allclose(gx, ref_gx, **tol)
            and torch.allclose(gw, ref_gw, **tol) and not gw[1].any())


def sync_free(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM is known to stay on the device here (no host-side
    loop over the offsets): the CPU, and bf16 on compute capability 9.0 / 10.0 GPUs
    (torch's CUTLASS kernel); elsewhere CUDA may fall back to a per-group loop that
    reads the offsets on the host."""
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def experts_sync_free(model: nn.Module) -> bool:
    """Whether every switch MLP of `model` takes the grouped dispatch with a device-only
    grouped GEMM (`SwitchMLP.sync_free`; True when there are none): what a CUDA graph of
    a step through the model needs."""
    from .transformer import SwitchMLP  # (transformer imports this module)

    return all(m.sync_free() for m in model.modules() if isinstance(m, SwitchMLP))

