"""Global gradient norm, clipping and zero counting over the model-parallel group; the
global parameter norm (`--log-params-norm`) by the same counting rule.

A gradient counts toward the norm once per model replica: a parameter is included when
it is tensor-parallel sharded (`param.tensor_model_parallel`) or this rank is tensor-
parallel rank 0 (replicated parameters are identical on every TP rank), and it is not a
second copy of another parameter (`param.shared`, e.g. the tied output embedding on the
last pipeline stage). The gradient is `param.main_grad` when present, else `param.grad`.

Collectives: one all-reduce of a single scalar over `mp_group` (SUM for p-norms, MAX for
the inf-norm); `mp_group=None` means a group of one (no communication). No function here
synchronises with the host: results are 0-dim float32 tensors.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist


def _grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def param_is_not_shared(param: torch.Tensor) -> bool:
    return not getattr(param, "shared", False)


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def _as_list(params) -> List[torch.Tensor]:
    if isinstance(params, torch.Tensor):
        return [params]
    return list(params)


def _default_device(params: List[torch.Tensor]) -> torch.device:
    if params:
        return params[0].device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def grads_for_norm(params: Iterable[torch.Tensor], tp_rank: int) -> List[torch.Tensor]:
    """The gradients that count toward the global norm on this rank (see module doc)."""
    out = []
    for p in params:
        g = _grad(p)
        if g is None or not param_is_not_shared(p):
            continue
        if param_is_not_tensor_parallel_duplicate(p, tp_rank):
            out.append(g.detach())
    return out


# CPU reductions sum in an order that depends on where the data starts in memory, which
# varies from process to process: merged views there would make a resumed run's grad norm
# differ in the last bit from the uninterrupted run's. CUDA buffers start 512-byte aligned.
MERGE_ON_CPU = False  # tests


def _coalesced(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The same elements as `tensors`, with contiguous CUDA tensors that sit end to end in
    one storage (gradients in a grad buffer) merged into single flat views: one long
    reduction reads the buffer faster than hundreds of short ones."""
    keyed = sorted(((t.untyped_storage().data_ptr(), t.dtype, t.device, t.data_ptr(), i)
                    for i, t in enumerate(tensors)
                    if t.is_contiguous() and (t.is_cuda or MERGE_ON_CPU)), key=lambda k: k[:4])
    runs, merged = [], set()
    for storage, dtype, device, ptr, i in keyed:
        t = tensors[i]
        if runs and runs[-1][0] == (storage, dtype, device) and runs[-1][2] == ptr:
            runs[-1][3].append(i)
            runs[-1][1] += t.numel()
        else:
            runs.append([(storage, dtype, device), t.numel(), None, [i]])
        runs[-1][2] = ptr + t.numel() * t.element_size()
    out = list(tensors)
    for _, numel, _, members in runs:
        if len(members) > 1:
            out[min(members)] = tensors[members[0]].as_strided((numel,), (1,))
            merged.update(m for m in members if m != min(members))
    # In the caller's order, not the addresses' (which differ from run to run): the norms
    # are summed in this order, and a resumed run must sum them as the first run did.
    return [t for i, t in enumerate(out) if i not in merged]


def _norms(tensors: List[torch.Tensor], norm_type: float, device) -> torch.Tensor:
    """Each tensor's p-norm (fp32), stacked on `device`."""
    tensors = _coalesced(tensors)
    big = [t for t in tensors if t.numel() >= _LONG]
    small = [t for t in tensors if t.numel() < _LONG]
    norms = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in big]
    if small:
        norms += list(torch._foreach_norm(small, norm_type, dtype=torch.float32))
    return torch.stack([n.to(device) for n in norms])


_LONG = 1 << 22  # elements from which one reduction kernel beats the multi-tensor one


def _global_norm(tensors: List[torch.Tensor], params: List[torch.Tensor], mp_group,
                 norm_type: float) -> torch.Tensor:
    """p-norm of `tensors` over this rank and `mp_group` (see get_grad_norm)."""
    norm_type = float(norm_type)
    device = tensors[0].device if tensors else _default_device(params)
    if tensors:
        norms = _norms(tensors, norm_type, device)
    else:
        norms = torch.zeros(1, dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        total = norms.max()
        if mp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=mp_group)
        return total
    total = norms.pow(norm_type).sum()
    if mp_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mp_group)
    return total.pow(1.0 / norm_type)


def get_grad_norm(params, mp_group, tp_rank: int, norm_type: float = 2) -> torch.Tensor:
    """Norm of all gradients of one model replica (all TP and PP ranks together).

    Collective: all-reduce of one scalar over `mp_group` (SUM of |g|^p, or MAX for inf).
    Returns a 0-dim float32 tensor on the gradients' device.
    """
    params = _as_list(params)
    return _global_norm(grads_for_norm(params, tp_rank), params, mp_group, norm_type)


def get_params_norm(params, mp_group, tp_rank: int, norm_type: float = 2) -> torch.Tensor:
    """Norm of the parameters of one model replica (`--log-params-norm`), counted like the
    grad norm: TP-replicated parameters once (TP rank 0), `shared` copies (the tied output
    embedding of the last pipeline stage) not at all. Given the distributed optimizer's
    DP shards and the world as `mp_group`, every element still counts once.

    Collective: all-reduce SUM of one scalar over `mp_group`. 0-dim float32 tensor.
    """
    params = _as_list(params)
    data = [p.detach() for p in params
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p, tp_rank)]
    return _global_norm(data, params, mp_group, norm_type)


def clip_grad_norm(
    params, max_norm: float, mp_group, tp_rank: int, norm_type: float = 2
) -> torch.Tensor:
    """Scale every gradient in `params` so that the global norm is at most `max_norm`.

    The norm is `get_grad_norm` (same collective); every gradient (duplicates and shared
    copies included) is multiplied by `max_norm / (norm + 1e-6)` when that is below 1.
    A NaN norm leaves the gradients unscaled and an infinite one (an inf gradient, or
    finite ones whose squares overflow fp32) multiplies them by 0, as Megatron-LM's
    `clip_coeff < 1.0` test does; either norm is returned as is, so the caller can report
    it. Returns the norm before clipping (0-dim float32 tensor).
    """
    params = _as_list(params)
    total_norm = get_grad_norm(params, mp_group, tp_rank, norm_type)
    grads = [g.detach() for g in (_grad(p) for p in params) if g is not None]
    if grads:
        clip_coeff = float(max_norm) / (total_norm + 1.0e-6)
        # NaN < 1 is False, so a NaN norm leaves the grads alone (an inf norm gives 0 < 1);
        # no host sync either way.
        clip_coeff = torch.where(clip_coeff < 1.0, clip_coeff, torch.ones_like(clip_coeff))
        for device_grads in _split_by_device(grads).values():
            torch._foreach_mul_(device_grads, clip_coeff.to(device_grads[0].device))
    return total_norm


def _split_by_device(tensors: List[torch.Tensor]):
    out = {}
    for t in tensors:
        out.setdefault(t.device, []).append(t)
    return out


def count_zeros(params, mp_group, tp_rank: int) -> torch.Tensor:
    """Number of zero gradient entries in one model replica (same counting rule as the norm).

    Collective: all-reduce SUM of one scalar over `mp_group`. Returns a 0-dim float32
    tensor.
    """
    params = _as_list(params)
    grads = grads_for_norm(params, tp_rank)
    device = grads[0].device if grads else _default_device(params)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        total += g.numel() - torch.count_nonzero(g).to(device)
    if mp_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=mp_group)
    return total
