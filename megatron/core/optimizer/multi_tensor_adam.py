"""AdamW over all parameters of a param group in one Triton launch, writing the fp16/bf16
model copy of each parameter in the same pass (`--adam-kernel triton`, the default on CUDA
when Triton is importable).

torch's fused AdamW reads and writes the fp32 main parameter and both moments, then a
separate `_foreach_copy_` reads every main parameter again to refresh the 16-bit model
parameters. Here one kernel reads p, g, m, v and writes p, m, v and the model parameter:
30 bytes per parameter instead of 34, in `num_groups` launches. The arithmetic is torch's
AdamW (decoupled weight decay) in fp32, in the same order, so results agree with
`torch.optim.AdamW(fused=True)` to fp32 rounding; gradient clipping is folded in as a
divisor (`grad_scale`), as torch's fused kernel does. The values that change every step
(lr, weight decay, bias corrections) are read from a small device tensor written from
pinned memory before the launch (`advance()`), so a CUDA graph of the whole step
(megatron/step_graph.py) replays with each step's values. Gradients are read where they
live: an fp32 grad buffer, or, in fp16 runs, the 16-bit buffer itself (widened in
registers; the loss scale folded into the divisor with the clip), and a device flag can
mask a launched step off entirely (a captured fp16 step that overflowed).

The kernel walks address tables: for each parameter the addresses of p, grad, exp_avg,
exp_avg_sq and the model parameter (0: none), its size and its group. The tables are
built on the first step and rebuilt whenever the optimizer state or a gradient's storage
changes (e.g. after a checkpoint load); the optimizer state keeps torch's layout
(`step`, `exp_avg`, `exp_avg_sq` per parameter), so checkpoints are unchanged. Where
Triton is missing the caller keeps torch's kernels. The tests run the kernel on the CPU
through Triton's interpreter: TRITON_INTERPRET=1 in the environment (read by Triton) and
`INTERPRET_ON_CPU = True` here.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from megatron.core.graph_capture import capturing
from megatron.core.triton_jit import import_triton, jitted

triton, tl = import_triton()  # (None, None) without a working Triton: torch's ops

BLOCK = 1024  # elements per Triton program (benchmarks/adam_probe.py: best on the H200)
# Allow CPU tensors, for Triton's interpreter (tests); the kernel is built per setting.
INTERPRET_ON_CPU = False
_NUM_WARPS = 8


def _adamw_kernel_source(block_tensor, block_chunk, addrs, numels, ntensors, scale_ptr, skip_ptr,
                         hyper, beta1, beta2, eps, OUT_DTYPE: tl.constexpr,
                         GRAD_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr,
                         HAS_SKIP: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """One program: BLOCK elements of one parameter (AdamW, decoupled weight decay). The
    values that change from step to step come from device memory (`hyper`: lr, weight
    decay, 1 - beta1^t, sqrt(1 - beta2^t)), so a captured step replays with new ones.
    Gradients are read in their own dtype (fp32, or the 16-bit grad buffer of an fp16
    run) and widened to fp32; with HAS_SKIP a nonzero `skip_ptr` (an overflow found on
    the device) masks every load and store: the step leaves everything as it was."""
    pid = tl.program_id(0)
    lr = tl.load(hyper)
    weight_decay = tl.load(hyper + 1)
    bias_correction1 = tl.load(hyper + 2)
    bias_correction2_sqrt = tl.load(hyper + 3)
    t = tl.load(block_tensor + pid)
    offs = tl.load(block_chunk + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    numel = tl.load(numels + t)
    if HAS_SKIP:
        numel = tl.where(tl.load(skip_ptr) == 0, numel, 0)
    mask = offs < numel
    p_addr = tl.load(addrs + t)
    g_addr = tl.load(addrs + ntensors + t)
    m_addr = tl.load(addrs + 2 * ntensors + t)
    v_addr = tl.load(addrs + 3 * ntensors + t)
    o_addr = tl.load(addrs + 4 * ntensors + t)
    if ALIGNED:
        p_addr = tl.multiple_of(p_addr, 16)
        g_addr = tl.multiple_of(g_addr, 16)
        m_addr = tl.multiple_of(m_addr, 16)
        v_addr = tl.multiple_of(v_addr, 16)
    p_ptr = p_addr.to(tl.pointer_type(tl.float32))
    m_ptr = m_addr.to(tl.pointer_type(tl.float32))
    v_ptr = v_addr.to(tl.pointer_type(tl.float32))
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    if GRAD_DTYPE == tl.bfloat16:  # widen the bits by hand (exact; the interpreter lacks bf16)
        g_bits = tl.load(g_addr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        g = (g_bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        g = tl.load(g_addr.to(tl.pointer_type(GRAD_DTYPE)) + offs, mask=mask, other=0.0)
        g = g.to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * m / denom
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if o_addr != 0:
        if OUT_DTYPE == tl.bfloat16:
            # Round to nearest even by hand (bits of the fp32 value), so the CPU
            # interpreter rounds as the GPU does; NaN stays NaN.
            bits = p.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            half = tl.where(p != p, 0x7FC0, bits >> 16).to(tl.uint16)
            tl.store(o_addr.to(tl.pointer_type(tl.uint16)) + offs, half, mask=mask)
        else:
            tl.store(o_addr.to(tl.pointer_type(OUT_DTYPE)) + offs, p.to(OUT_DTYPE), mask=mask)


def _kernel():
    return jitted(_adamw_kernel_source, INTERPRET_ON_CPU)


def triton_available(device: torch.device) -> bool:
    """Whether the kernel can run for parameters on `device`."""
    if triton is None:
        return False
    return device.type == "cuda" or INTERPRET_ON_CPU


def supports(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """None when `optimizer` can be stepped by this kernel, else the reason it cannot."""
    if not isinstance(optimizer, torch.optim.AdamW):
        return f"{type(optimizer).__name__} is not AdamW"
    for group in optimizer.param_groups:
        for key in ("amsgrad", "maximize", "differentiable"):
            if group.get(key):
                return f"param group option {key}=True"
        params = group["params"]
        if any(p.dtype != torch.float32 for p in params):
            return "a parameter stepped by the optimizer is not fp32"
        if any(not triton_available(p.device) for p in params):
            return "Triton cannot run on the parameters' device"
        if len({p.device for p in params}) > 1:
            return "parameters on several devices"
    return None


class _GroupTables:
    """The address tables of one param group, and what they were built from."""

    def __init__(self, params, grads, model_params, state, device) -> None:
        self.params = params
        self.grad_ptrs = tuple(g.data_ptr() for g in grads)
        dtypes = {g.dtype for g in grads}
        self.grad_dtype = dtypes.pop() if len(dtypes) == 1 else None  # None: mixed, unusable
        self.states = [state[p] for p in params]
        self.exp_avgs = [s["exp_avg"] for s in self.states]
        outs = [0 if q is None else q.data_ptr() for q in model_params]
        rows = [[p.data_ptr() for p in params], list(self.grad_ptrs),
                [m.data_ptr() for m in self.exp_avgs],
                [s["exp_avg_sq"].data_ptr() for s in self.states], outs]
        self.aligned = all(a % 16 == 0 for row in rows[:4] for a in row)
        self.addrs = torch.tensor(rows, dtype=torch.int64).reshape(-1).to(device)
        numels = [p.numel() for p in params]
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        # A group may be empty on a rank (the distributed optimizer's shards): no blocks.
        chunks = [-(-n // BLOCK) for n in numels]
        self.block_tensor = torch.repeat_interleave(
            torch.arange(len(params), dtype=torch.int32),
            torch.tensor(chunks, dtype=torch.int64)).to(device)
        self.block_chunk = torch.cat([torch.zeros(0, dtype=torch.int32)] + [
            torch.arange(c, dtype=torch.int32) for c in chunks]).to(device)
        self.num_blocks = sum(chunks)
        self.out_dtypes = {q.dtype for q in model_params if q is not None}

    def still_valid(self, params, grads, state) -> bool:
        if len(params) != len(self.params) or any(a is not b for a, b in zip(params, self.params)):
            return False
        if tuple(g.data_ptr() for g in grads) != self.grad_ptrs:
            return False
        return all(state.get(p) is s and s.get("exp_avg") is m
                   for p, s, m in zip(params, self.states, self.exp_avgs))


class MultiTensorAdamW:
    """Steps a `torch.optim.AdamW` with the Triton kernel. `model_params[i][j]` is the
    16-bit model parameter whose values main parameter `param_groups[i]['params'][j]`
    holds (None: no copy, e.g. fp32 model parameters stepped directly). `grads()`, when
    given, returns per group the tensor to read as each parameter's gradient (e.g. the
    16-bit grad buffer of an fp16 run); else the kernel reads `param.grad`."""

    def __init__(self, optimizer: torch.optim.AdamW,
                 model_params: Sequence[Sequence[Optional[torch.Tensor]]],
                 grads: Optional[Callable[[], List[List[Optional[torch.Tensor]]]]] = None
                 ) -> None:
        reason = supports(optimizer)
        if reason is not None:
            raise ValueError(f"the Triton AdamW kernel cannot step this optimizer: {reason}")
        self.optimizer = optimizer
        self.model_params = [list(group) for group in model_params]
        self._grads = grads
        self.tables: List[Optional[_GroupTables]] = [None] * len(optimizer.param_groups)
        self.step_count: Optional[int] = None
        self._step_tensors: List[torch.Tensor] = []
        self.hyper: Optional[torch.Tensor] = None  # [groups, 4] on the params' device

    def _device(self) -> torch.device:
        """The parameters' device (the CPU when this rank steps none: nothing launches)."""
        params = (p for g in self.optimizer.param_groups for p in g["params"])
        return next((p.device for p in params), torch.device("cpu"))

    def _init_state(self, params) -> None:
        state = self.optimizer.state
        for p in params:
            if "exp_avg" not in state[p]:
                state[p]["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _refresh(self) -> Tuple[bool, bool]:
        """(tables usable, rebuilt). Rebuilds the tables that went stale; reads the step
        count from the state after a rebuild (one host synchronisation)."""
        rebuilt = False
        given = self._grads() if self._grads is not None else None
        for i, group in enumerate(self.optimizer.param_groups):
            params = group["params"]
            grads = given[i] if given is not None else [p.grad for p in params]
            if any(g is None for g in grads):
                return False, rebuilt
            table = self.tables[i]
            if table is None or not table.still_valid(params, grads, self.optimizer.state):
                self._init_state(params)
                self.tables[i] = _GroupTables(params, grads, self.model_params[i],
                                              self.optimizer.state, self._device())
                rebuilt = True
            if self.tables[i].grad_dtype is None and params:
                return False, rebuilt
        if (rebuilt or self.step_count is None) and capturing():
            raise RuntimeError("the Triton AdamW tables went stale inside a captured step "
                               "(optimizer state or grad buffers replaced after warm-up); "
                               "use --cuda-graph-step off")
        if rebuilt or self.step_count is None:
            steps = [self.optimizer.state[p]["step"] for t in self.tables for p in t.params]
            stacked = torch.stack([s.float().reshape(()) for s in steps]) if steps else None
            counts = set() if stacked is None else set(stacked.cpu().tolist())
            if len(counts) > 1:
                return False, rebuilt  # parameters at different steps: torch's kernel copes
            self.step_count = int(counts.pop()) if counts else 0
            self._step_tensors = steps
        if self.hyper is None:  # before any capture: a replay's host side writes it
            self.hyper = torch.zeros(len(self.tables), 4, dtype=torch.float32,
                                     device=self._device())
        return True, rebuilt

    def _rows(self, step: int, lr_wd: Sequence[Tuple[float, float]]) -> List[List[float]]:
        """Per group: lr, weight decay, 1 - beta1^step, sqrt(1 - beta2^step), computed in
        float64 as torch does (rounded to fp32 on upload)."""
        rows = []
        for group, (lr, wd) in zip(self.optimizer.param_groups, lr_wd):
            beta1, beta2 = group["betas"]
            rows.append([float(lr), float(wd), 1.0 - beta1 ** step,
                         math.sqrt(1.0 - beta2 ** step)])
        return rows

    def advance(self, if_skipped: Optional[Sequence[Tuple[float, float]]] = None,
                skipped: Optional[torch.Tensor] = None) -> None:
        """Count one step on the host and write its per-group values (lr, weight decay,
        bias corrections) into the device tensor the kernel reads: from pinned memory,
        without waiting for the GPU. `step()` does this itself, except while a whole-step
        graph is being captured: then the graph's driver calls it before each replay.

        With `if_skipped` (per group: lr and weight decay) and `skipped` (a 0-dim device
        flag), the previous step is still undecided on the host: it was counted, but the
        device may have skipped it. Both rows are uploaded -- this step's values if the
        previous one updated, and `if_skipped` at one step fewer if it did not -- and the
        device picks by `skipped`, so the host never waits for the flag."""
        step = self.step_count + 1
        rows = self._rows(step, [(g["lr"], g["weight_decay"]) for g in self.optimizer.param_groups])
        if if_skipped is not None:
            rows = [rows, self._rows(step - 1, if_skipped)]
        host = torch.tensor(rows, dtype=torch.float32)
        if self.hyper.is_cuda:
            host = host.pin_memory()
        if if_skipped is None:
            self.hyper.copy_(host, non_blocking=True)
        else:
            both = host.to(self.hyper.device, non_blocking=True)
            self.hyper.copy_(torch.where(skipped.reshape(()) != 0, both[1], both[0]))
        self.step_count = step

    def ready(self) -> bool:
        """Whether `step()` can run now (every gradient there, in one dtype per group, and
        every parameter at the same step count); builds stale tables."""
        return self._refresh()[0]

    def undo_advance(self) -> None:
        """A replayed step skipped its update on the device (loss-scale overflow): the
        host's step count goes back to where the device's is (the device tensor of the
        next step's values, if already written, was chosen for this outcome)."""
        self.step_count -= 1

    @torch.no_grad()
    def step(self, grad_scale: Optional[torch.Tensor] = None,
             skip: Optional[torch.Tensor] = None) -> bool:
        """One AdamW step of every parameter (grads divided by `grad_scale` when given);
        False, with nothing done, when some parameter has no gradient or the parameters
        are at different step counts (the caller then uses torch's optimizer). `skip`: a
        0-dim float tensor; where it is nonzero on the device, the launched step changes
        nothing (parameters, moments, step counts): a captured fp16 step's overflow."""
        ok, _ = self._refresh()
        if not ok:
            if capturing():
                raise RuntimeError("the Triton AdamW kernel cannot step inside a captured "
                                   "step (a parameter has no gradient, or parameters are at "
                                   "different step counts); use --cuda-graph-step off")
            return False
        if not capturing():
            self.advance()
        for i, (group, table) in enumerate(zip(self.optimizer.param_groups, self.tables)):
            if table.num_blocks == 0:
                continue
            beta1, beta2 = group["betas"]
            out_dtype = next(iter(table.out_dtypes), torch.bfloat16)
            scale = grad_scale if grad_scale is not None else table.numels
            _kernel()[(table.num_blocks,)](
                table.block_tensor, table.block_chunk, table.addrs, table.numels,
                len(table.params), scale, skip if skip is not None else table.numels,
                self.hyper[i], float(beta1), float(beta2), float(group["eps"]),
                OUT_DTYPE=_TL_DTYPES[out_dtype], GRAD_DTYPE=_TL_DTYPES[table.grad_dtype],
                HAS_SCALE=grad_scale is not None, HAS_SKIP=skip is not None,
                ALIGNED=table.aligned, BLOCK=BLOCK, num_warps=_NUM_WARPS)
        if not self._step_tensors:
            pass  # this rank steps no parameter (a distributed optimizer's empty shard)
        elif skip is None:
            torch._foreach_add_(self._step_tensors, 1.0)
        else:
            keep = (skip == 0).float()  # a list of tensors: the 0-dim-tensor overload syncs
            torch._foreach_add_(self._step_tensors, [keep] * len(self._step_tensors))
        return True


_TL_DTYPES = {}
if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                  torch.float32: tl.float32}
