"""Megatron's optimizer wrappers: fp32, and mixed precision with fp32 main parameters.

Contract shared by both (what `train_step` relies on):

    optimizer.zero_grad()                    # grads of model and main params -> None
    loss = optimizer.scale_loss(loss)        # loss * loss scale, before backward
    ok, grad_norm, num_zeros = optimizer.step()

`step()` reads each model parameter's gradient from `param.main_grad` (the data-parallel
grad buffer) when it exists, else from `param.grad`. `grad_norm` and `num_zeros` are
0-dim tensors (or None): the only host synchronisation inside `step()` is the overflow
decision when a loss scaler is present. A skipped step returns `(False, None, None)`.

Collectives inside `step()`: all-reduce MAX of the found-inf flag over the model-parallel
group (only with a loss scaler), then the all-reduce of the squared grad norm over the
model-parallel group (only when `clip_grad > 0`), and of the zero count when asked.
The distributed optimizer (`distrib_optimizer.py`, same contract) reduces those over the
whole world and all-gathers the updated parameters over the data-parallel group.
`build.py` reads the config and picks one of them (`build_optimizer`).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from megatron.core.graph_capture import capturing
from megatron.core.optimizer.clip_grads import (
    clip_grad_norm,
    count_zeros,
    get_grad_norm,
    get_params_norm,
)
from megatron.core.optimizer.grad_scaler import MegatronGradScaler, load_scaler_state
from megatron.core.optimizer.inner_state import load_inner_state
from megatron.core.optimizer.multi_tensor_adam import MultiTensorAdamW, supports
from megatron.core.timing import TimerHook, timed

StepResult = Tuple[bool, Optional[torch.Tensor], Optional[torch.Tensor]]

# Attributes set by the tensor-parallel layers that the fp32 main copy must carry, so that
# the grad-norm rule (no TP duplicates, no shared copies) still applies to it.
_COPIED_ATTRIBUTES = (
    "tensor_model_parallel", "partition_dim", "partition_stride", "shared", "sequence_parallel",
)


def _model_grad(param: torch.Tensor) -> Optional[torch.Tensor]:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


def _in_fp32_grad_buffer(param: torch.Tensor) -> bool:
    """True when the parameter's gradient lives in an fp32 grad buffer (`main_grad`), so
    the tensor the optimizer reads it from is the same storage every step."""
    main_grad = getattr(param, "main_grad", None)
    return main_grad is not None and main_grad.dtype == torch.float32


def _zero_grad_group(params: List[torch.Tensor], set_to_none: bool) -> None:
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad = p.grad.detach()
            p.grad.zero_()


def _by_device(pairs):
    out: Dict[torch.device, Tuple[list, list]] = {}
    for a, b in pairs:
        dst, src = out.setdefault(a.device, ([], []))
        dst.append(a)
        src.append(b)
    return out.values()


class MegatronOptimizer:
    """Common part: wraps a torch optimizer, clips and counts zeros over the mp group."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        clip_grad: float,
        log_num_zeros_in_grad: bool,
        mp_group=None,
        tp_rank: int = 0,
    ) -> None:
        if clip_grad < 0.0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got {clip_grad}")
        self.optimizer = optimizer
        self.clip_grad = float(clip_grad)
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        self.mp_group = mp_group
        self.tp_rank = tp_rank
        self._unit_scale: Optional[torch.Tensor] = None
        # "auto" | "torch" | "triton" (--adam-kernel); see _multi_tensor().
        self.adam_kernel = "auto"
        self._multi = None  # MultiTensorAdamW, False when not used, None before deciding
        self._model_params_written = False
        self._deferred_found: Optional[torch.Tensor] = None  # a captured step's overflow flag

    # --- access --------------------------------------------------------------------------
    @property
    def param_groups(self) -> List[Dict]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    def get_parameters(self) -> List[torch.Tensor]:
        """The parameters the inner optimizer updates (fp32 main params when mixed)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def _device(self) -> torch.device:
        params = self.get_parameters()
        return params[0].device if params else torch.device("cpu")

    def _unit(self) -> torch.Tensor:
        if self._unit_scale is None:
            self._unit_scale = torch.ones((), dtype=torch.float32, device=self._device())
        return self._unit_scale

    # --- loss scale ----------------------------------------------------------------------
    def get_loss_scale(self) -> torch.Tensor:
        """Current loss scale as a 0-dim float32 tensor (1.0 without a scaler)."""
        return self._unit()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * loss_scale`, to call backward on."""
        return loss * self.get_loss_scale()

    # --- step pieces ---------------------------------------------------------------------
    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(self.get_parameters(), max_norm, self.mp_group, self.tp_rank)

    def count_zeros(self) -> torch.Tensor:
        return count_zeros(self.get_parameters(), self.mp_group, self.tp_rank)

    @torch.no_grad()
    def get_params_norm(self) -> torch.Tensor:
        """L2 norm of the model's parameters (one replica, each element once), from the
        parameters this optimizer steps: the fp32 main copies when mixed precision, this
        rank's shards with the distributed optimizer (then reduced over the world).
        Collective over the optimizer's model-parallel (or world) group; no host sync."""
        return get_params_norm(self.get_parameters(), self.mp_group, self.tp_rank)

    def _model_copies(self) -> Optional[List[List[Optional[torch.Tensor]]]]:
        """Per inner param group, the model parameter each stepped parameter is copied to
        (None: none), for the Triton AdamW kernel; None when that kernel must not be used."""
        return None

    def _no_copies_reason(self) -> str:
        """Why `_model_copies()` is None (for the --adam-kernel triton error)."""
        return ("the parameters' gradients are not all in grad buffers (--DDP-impl local "
                "with contiguous buffers)")

    def _kernel_grads(self):
        """None (the kernel reads `param.grad`) or a function returning, per inner param
        group, the tensor the kernel reads as each parameter's gradient."""
        return None

    def _multi_tensor(self) -> Optional[MultiTensorAdamW]:
        """The Triton AdamW stepper (`--adam-kernel`): "auto" uses it when it can run (CUDA,
        Triton importable, AdamW, every gradient in a grad buffer); "triton" insists."""
        if self._multi is None:
            self._multi = False
            if self.adam_kernel != "torch":
                copies = self._model_copies()
                reason = (self._no_copies_reason() if copies is None
                          else supports(self.optimizer))
                if reason is None:
                    self._multi = MultiTensorAdamW(self.optimizer, copies, self._kernel_grads())
                elif self.adam_kernel == "triton":
                    raise ValueError(f"--adam-kernel triton cannot be used: {reason}; use "
                                     "--adam-kernel auto or torch")
        return self._multi or None

    def graph_capture_reason(self) -> Optional[str]:
        """None when `step()` can be recorded in a whole-step CUDA graph (no host decision
        inside it, step-dependent values read from device memory), else why not."""
        if self._multi_tensor() is None:
            return ("the optimizer step is not the Triton AdamW kernel (it needs AdamW, "
                    "Triton, grads in grad buffers and no --adam-kernel torch)")
        return None

    def prepare_replay(self, if_skipped: Optional[Sequence[Tuple[float, float]]] = None
                       ) -> None:
        """The host side of `step()` for one replay of a captured step: count the step
        and write its learning rate, weight decay and bias corrections to the device.
        `if_skipped` (per group: lr and weight decay): the previous replay's overflow flag
        is not read yet; the device picks this step's values by it (see
        `MultiTensorAdamW.advance`)."""
        flag = None if if_skipped is None else self.replay_flag()
        self._multi_tensor().advance(if_skipped, flag)

    def replay_flag(self) -> Optional[torch.Tensor]:
        """The captured step's overflow flag (0-dim, on the device; nonzero: the replay
        skipped its update), or None when the step has no loss scaler (it always updates).
        Each replay overwrites it."""
        return self._deferred_found

    def take_back_step(self) -> None:
        """A replay turned out to have skipped its update (its flag, read later): the
        host's count of steps goes back by the one `prepare_replay()` counted."""
        self._multi_tensor().undo_advance()

    def _clip_scale(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(grad norm, divisor that clips): dividing the gradients by the divisor is
        multiplying them by the clip coefficient min(1, clip_grad / (norm + 1e-6))."""
        total_norm = get_grad_norm(self.get_parameters(), self.mp_group, self.tp_rank)
        coeff = float(self.clip_grad) / (total_norm + 1.0e-6)
        # As the unfused path: a NaN norm leaves the gradients unscaled, an inf one zeroes
        # them (divisor inf).
        coeff = torch.where(coeff < 1.0, coeff, torch.ones_like(coeff))
        device = next(p.device for g in self.optimizer.param_groups for p in g["params"])
        return total_norm, (1.0 / coeff).to(device)

    def _clip_and_step(self, timers: Optional[TimerHook] = None
                       ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Count zeros (when asked), clip, step: Megatron's `optimizer-count-zeros`,
        `optimizer-clip-main-grad` and `optimizer-inner-step` phases, each timed only when
        it runs. With a fused kernel (Triton or torch's fused AdamW) the clip is folded into
        it: instead of a pass that multiplies every gradient by the clip coefficient, the
        kernel divides them by `grad_scale` = 1 / coefficient as it reads them (the stored
        gradients stay unclipped); the clip phase then only computes the norm."""
        num_zeros = None
        if self.log_num_zeros_in_grad:
            with timed(timers, "optimizer-count-zeros"):
                num_zeros = self.count_zeros()
        self._model_params_written = False
        multi = self._multi_tensor()
        grad_norm = grad_scale = None
        if self.clip_grad > 0.0:
            with timed(timers, "optimizer-clip-main-grad"):
                if multi is not None or self._inner_is_fused():
                    grad_norm, grad_scale = self._clip_scale()
                else:
                    grad_norm = self.clip_grad_norm(self.clip_grad)
        with timed(timers, "optimizer-inner-step"):
            self._inner_step(multi, grad_scale)
        return grad_norm, num_zeros

    def _inner_step(self, multi: Optional[MultiTensorAdamW],
                    grad_scale: Optional[torch.Tensor]) -> None:
        """The update itself; `grad_scale` (not None): divide the gradients by it first."""
        if multi is not None and multi.step(grad_scale):
            self._model_params_written = True
        elif grad_scale is not None and self._inner_is_fused():
            self.optimizer.grad_scale = grad_scale
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale
        else:
            if grad_scale is not None:  # the Triton kernel declined this step
                grads = [p.grad for p in self.get_parameters() if p.grad is not None]
                torch._foreach_div_(grads, grad_scale)
            self.optimizer.step()

    def _inner_is_fused(self) -> bool:
        return all(g.get("fused") for g in self.optimizer.param_groups)

    @staticmethod
    def _alias_main_grads(params: List[torch.Tensor]) -> List[torch.Tensor]:
        """Point `param.grad` at `param.main_grad` where a grad buffer exists."""
        aliased = []
        for p in params:
            main_grad = getattr(p, "main_grad", None)
            if main_grad is not None:
                p.grad = main_grad
                aliased.append(p)
        return aliased

    # --- interface -----------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        raise NotImplementedError

    def step(self, timers: Optional[TimerHook] = None) -> StepResult:
        """One update; `timers` times its phases (see megatron/core/timing.py)."""
        raise NotImplementedError

    def reload_model_params(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Dict) -> List[str]:
        """Restore from `state_dict()`'s shape; returns one note per hyper-parameter
        (--adam-beta1/2, --adam-eps, --sgd-momentum) on which this run's value replaces
        the checkpoint's (inner_state.settle_groups), for the caller to print."""
        raise NotImplementedError


class FP32Optimizer(MegatronOptimizer):
    """fp32 model parameters: loss scale 1.0, never skips a step."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        _zero_grad_group(self.get_parameters(), set_to_none)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss  # the scale is exactly 1.0

    def _model_copies(self):
        params = self.get_parameters()
        if not all(_in_fp32_grad_buffer(p) for p in params):
            return None
        return [[None] * len(g["params"]) for g in self.optimizer.param_groups]

    @torch.no_grad()
    def step(self, timers: Optional[TimerHook] = None) -> StepResult:
        """Point the grads at the grad buffer (Megatron's `optimizer-copy-to-main-grad`
        phase of this optimizer), clip (global norm over the mp group), count zeros if
        asked, inner step. `timers`: see megatron/core/timing.py (None: untimed)."""
        with timed(timers, "optimizer-copy-to-main-grad"):
            aliased = self._alias_main_grads(self.get_parameters())
        grad_norm, num_zeros = self._clip_and_step(timers)
        # A grad aliasing the grad buffer must not meet the next backward.
        for p in aliased:
            p.grad = None
        return True, grad_norm, num_zeros

    def reload_model_params(self) -> None:
        pass  # the model parameters are the optimizer's parameters

    def state_dict(self) -> Dict:
        """The torch optimizer state dict itself (Megatron's fp32 checkpoint shape)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict) -> List[str]:
        return load_inner_state(self.optimizer, state_dict)


class MixedPrecisionOptimizer(MegatronOptimizer):
    """fp16/bf16 model parameters with fp32 main copies that the inner optimizer steps.

    fp32 model parameters (if any) are stepped directly. With a loss scaler (fp16, or
    `--loss-scale`), grads are unscaled and checked for inf/NaN; an overflow anywhere in
    the model-parallel group skips the step. bf16 without a scaler never skips; a
    non-finite gradient then shows in the returned grad norm.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        clip_grad: float,
        log_num_zeros_in_grad: bool,
        mp_group=None,
        tp_rank: int = 0,
        grad_scaler: Optional[MegatronGradScaler] = None,
    ) -> None:
        super().__init__(optimizer, clip_grad, log_num_zeros_in_grad, mp_group, tp_rank)
        self.grad_scaler = grad_scaler
        self.float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_float16_groups: List[List[torch.Tensor]] = []
        self.fp32_from_fp32_groups: List[List[torch.Tensor]] = []
        for group in self.optimizer.param_groups:
            self._make_main_params(group)
        if self.grad_scaler is not None:
            self.grad_scaler.to(self._device())
        self._found_inf = torch.zeros((), dtype=torch.float32, device=self._device())

    def _make_main_params(self, group: Dict) -> None:
        """Swap every fp16/bf16 param of `group` for an fp32 copy (moving any state)."""
        float16, main, fp32 = [], [], []
        for i, param in enumerate(group["params"]):
            if param.dtype in (torch.float16, torch.bfloat16):
                main_param = torch.nn.Parameter(param.detach().clone().float())
                for attr in _COPIED_ATTRIBUTES:
                    if hasattr(param, attr):
                        setattr(main_param, attr, getattr(param, attr))
                group["params"][i] = main_param
                if param in self.optimizer.state:
                    self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                float16.append(param)
                main.append(main_param)
            elif param.dtype == torch.float32:
                fp32.append(param)
            else:
                raise TypeError(f"cannot optimize a parameter of dtype {param.dtype}")
        self.float16_groups.append(float16)
        self.fp32_from_float16_groups.append(main)
        self.fp32_from_fp32_groups.append(fp32)

    def _model_main_pairs(self):
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            yield from zip(model_group, main_group)

    def _model_copies(self):
        model_of = {}
        for model, main in self._model_main_pairs():
            if getattr(model, "main_grad", None) is None:
                return None
            model_of[main] = model
        if not all(_in_fp32_grad_buffer(p) for g in self.fp32_from_fp32_groups for p in g):
            return None
        return [[model_of.get(p) for p in g["params"]] for g in self.optimizer.param_groups]

    def _grad_holders(self) -> List[List[torch.Tensor]]:
        """Per inner param group, the parameter whose `main_grad` holds each stepped
        parameter's gradient: its 16-bit model parameter, or itself when fp32."""
        model_of = {main: model for model, main in self._model_main_pairs()}
        return [[model_of.get(p, p) for p in g["params"]] for g in self.optimizer.param_groups]

    def _kernel_grads(self):
        return lambda: [[p.main_grad for p in group] for group in self._grad_holders()]

    def _buffer_step(self, multi: MultiTensorAdamW,
                     timers: Optional[TimerHook] = None) -> StepResult:
        """The step on the grad buffers as they are (fp32, or 16-bit in an fp16 run), every
        update in one Triton kernel: no fp32 copy of the gradients, no unscaling pass. With
        a loss scaler the overflow check is the norm of the scaled gradients (non-finite
        exactly when some gradient is), reported divided by the scale (exact for a power
        of two), and the kernel divides the gradients by scale / clip coefficient as it
        reads them. Eagerly, the overflow decision is the step's one host sync; inside a
        captured step nothing waits for it: the kernel masks itself off on the device, the
        scaler updates on the device, and the host learns the outcome later from
        `replay_flag()` (megatron/step_graph.py).

        Timed phases (`timers`): count-zeros; unscale-and-check-inf is the norm and the
        overflow decision (with a scaler); clip-main-grad the norm (without a scaler) and
        the clip coefficient; inner-step the kernel. Nothing is copied, so the copy phases
        do not occur."""
        holders = [p for group in self._grad_holders() for p in group]
        num_zeros = None
        if self.log_num_zeros_in_grad:
            with timed(timers, "optimizer-count-zeros"):
                num_zeros = count_zeros(holders, self.mp_group, self.tp_rank)
        scaler, divisor, found, norm = self.grad_scaler, None, None, None
        self._deferred_found = None
        if scaler is not None:
            with timed(timers, "optimizer-unscale-and-check-inf"):
                norm = get_grad_norm(holders, self.mp_group, self.tp_rank)
                found = (~torch.isfinite(norm)).float()
                norm, divisor = norm / scaler.scale, scaler.scale
                # eagerly, the step's one host synchronisation
                overflow = not capturing() and bool(found.item())
            if overflow:
                scaler.update(True)
                return False, None, None
        if self.clip_grad > 0.0:
            with timed(timers, "optimizer-clip-main-grad"):
                if norm is None:
                    norm = get_grad_norm(holders, self.mp_group, self.tp_rank)
                coeff = float(self.clip_grad) / (norm + 1.0e-6)
                coeff = torch.where(coeff < 1.0, coeff, torch.ones_like(coeff))
                divisor = 1.0 / coeff if divisor is None else divisor / coeff
        with timed(timers, "optimizer-inner-step"):
            if found is not None and not capturing():
                multi.step(divisor)
                scaler.update(False)  # after the launch: the kernel read this step's scale
            else:
                multi.step(divisor, skip=found)
                if found is not None:  # captured: decided and counted on the device
                    scaler.update(found)
                    self._deferred_found = found
        self._model_params_written = True
        return True, norm if self.clip_grad > 0.0 else None, num_zeros

    # --- loss scale ----------------------------------------------------------------------
    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is None:
            return self._unit()
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.grad_scaler is None else loss * self.grad_scaler.scale

    # --- step ----------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        for groups in (self.float16_groups, self.fp32_from_float16_groups,
                       self.fp32_from_fp32_groups):
            for group in groups:
                _zero_grad_group(group, set_to_none)

    def _copy_model_grads_to_main_grads(self) -> List[torch.Tensor]:
        for model_param, main_param in self._model_main_pairs():
            grad = _model_grad(model_param)
            main_param.grad = None if grad is None else grad.float()
            model_param.grad = None  # its data now lives in the main grad
        return self._alias_main_grads([p for g in self.fp32_from_fp32_groups for p in g])

    def _unscale_and_check_for_inf(self) -> bool:
        """Unscale main grads by 1/scale; True when any rank of the mp group saw inf/NaN.

        Collective: all-reduce MAX of one flag over the model-parallel group, then the
        step's only host synchronisation (`.item()`)."""
        self._found_inf.fill_(0.0)
        inv_scale = self.grad_scaler.inv_scale
        by_device: Dict[torch.device, List[torch.Tensor]] = {}
        for p in self.get_parameters():
            if p.grad is not None:
                by_device.setdefault(p.grad.device, []).append(p.grad)
        for device, grads in by_device.items():
            on_flag_device = device == self._found_inf.device
            found = self._found_inf if on_flag_device else torch.zeros((), device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv_scale.to(device))
            if not on_flag_device:
                self._found_inf.add_(found.to(self._found_inf.device))
        if self.mp_group is not None:
            dist.all_reduce(self._found_inf, op=dist.ReduceOp.MAX, group=self.mp_group)
        return self._found_inf.item() > 0

    @torch.no_grad()
    def step(self, timers: Optional[TimerHook] = None) -> StepResult:
        """With the Triton kernel, `_buffer_step`. Otherwise: copy model grads to fp32
        main grads, unscale and check for overflow (skip on overflow), clip, count zeros if
        asked, inner step, copy main params to the model. `timers` times these phases
        under Megatron's names (`optimizer-copy-to-main-grad`, ...), each only when it
        runs (see megatron/core/timing.py; None: untimed)."""
        multi = self._multi_tensor()
        if multi is not None and multi.ready():
            return self._buffer_step(multi, timers)
        with timed(timers, "optimizer-copy-to-main-grad"):
            aliased = self._copy_model_grads_to_main_grads()
        try:
            if self.grad_scaler is not None:
                with timed(timers, "optimizer-unscale-and-check-inf"):
                    found_inf = self._unscale_and_check_for_inf()
                self.grad_scaler.update(found_inf)
                if found_inf:
                    return False, None, None
            grad_norm, num_zeros = self._clip_and_step(timers)
            if not self._model_params_written:  # the Triton kernel wrote them already
                with timed(timers, "optimizer-copy-main-to-model-params"):
                    self._copy_main_params_to_model_params()
            return True, grad_norm, num_zeros
        finally:
            for p in aliased:
                p.grad = None

    def _copy_main_params_to_model_params(self) -> None:
        for model_params, main_params in _by_device(self._model_main_pairs()):
            torch._foreach_copy_(model_params, main_params)

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the fp32 main params from the model (when no optimizer state is loaded)."""
        for main_params, model_params in _by_device(
            (main, model) for model, main in self._model_main_pairs()
        ):
            torch._foreach_copy_(main_params, model_params)

    # --- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> Dict:
        """Megatron's shape: {optimizer, grad_scaler (if any), fp32_from_fp16_params}."""
        state_dict = {"optimizer": self.optimizer.state_dict()}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        state_dict["fp32_from_fp16_params"] = [
            [p.detach() for p in group] for group in self.fp32_from_float16_groups
        ]
        return state_dict

    @torch.no_grad()
    def load_state_dict(self, state_dict: Dict) -> List[str]:
        key = "optimizer" if "optimizer" in state_dict else "optimizer_state_dict"
        notes = load_inner_state(self.optimizer, state_dict[key])
        load_scaler_state(self.grad_scaler, state_dict)
        key = "fp32_from_fp16_params" if "fp32_from_fp16_params" in state_dict else "fp32_from_fp16"
        saved_groups = state_dict[key]
        if [len(g) for g in saved_groups] != [len(g) for g in self.fp32_from_float16_groups]:
            raise ValueError(
                f"checkpoint fp32 main params have group sizes {[len(g) for g in saved_groups]}"
                f" but this model has {[len(g) for g in self.fp32_from_float16_groups]}; the "
                f"model or its precision differs from the one that was saved"
            )
        for current, saved in zip(self.fp32_from_float16_groups, saved_groups):
            for param, value in zip(current, saved):
                if value.shape != param.shape:  # copy_ would broadcast a smaller one
                    raise ValueError(
                        f"checkpoint fp32 main param of shape {tuple(value.shape)} for a "
                        f"parameter of shape {tuple(param.shape)}; the model or its "
                        "parameter groups differ from the ones that were saved")
                param.copy_(value)
        return notes
