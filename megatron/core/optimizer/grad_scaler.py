"""Loss scalers for fp16 (and optionally bf16) training, with Megatron's update rule.

The scale lives in a 0-dim float32 tensor on the parameters' device so that scaling the
loss and unscaling the gradients need no host synchronisation. The dynamic scaler keeps
its two trackers on that device too and updates all three with tensor operations, so
`update()` takes the overflow flag as a bool (an eager step that has read it) or as a
device tensor (a step captured in a CUDA graph, which never reads it on the host); only
`state_dict()` reads the trackers back.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Optional, Union

import torch

# The smallest normal float32. A smaller scale rounds to 0 or has an infinite reciprocal:
# gradients then unscale to NaN after the overflow check has found them finite.
FLOAT32_TINY = 2.0 ** -126


def _check_float32_scale(what: str, value: float) -> None:
    if value < FLOAT32_TINY:
        raise ValueError(f"{what} {value:g} is below the smallest normal float32 "
                         f"({FLOAT32_TINY:g}): its float32 reciprocal, which unscales the "
                         "gradients, is not finite")


class MegatronGradScaler:
    """Base: holds the current scale; `update(found_inf)` is called once per step."""

    def __init__(self, initial_scale: float, device: Optional[torch.device] = None) -> None:
        if not initial_scale > 0.0:
            raise ValueError(f"initial loss scale must be > 0, got {initial_scale}")
        _check_float32_scale("loss scale", float(initial_scale))
        self._scale = torch.tensor(float(initial_scale), dtype=torch.float32, device=device)

    @property
    def scale(self) -> torch.Tensor:
        """Current loss scale (0-dim float32 tensor)."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """1 / scale, computed in double precision then rounded to float32."""
        return self._scale.double().reciprocal().float()

    def to(self, device) -> "MegatronGradScaler":
        """Move the scale tensor to `device` (the optimizer puts it beside the grads)."""
        self._scale = self._scale.to(device)
        return self

    def update(self, found_inf: Union[bool, torch.Tensor]) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """A fixed scale (`--loss-scale X`). Its checkpoint entry is an empty dict."""

    def __init__(self, scale: float, device: Optional[torch.device] = None) -> None:
        super().__init__(scale, device)

    def update(self, found_inf: Union[bool, torch.Tensor]) -> None:
        pass

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        pass


class DynamicGradScaler(MegatronGradScaler):
    """Megatron's dynamic loss scale with hysteresis.

    On an overflow the growth tracker resets and the hysteresis tracker drops by one; once
    it is <= 0 every overflow multiplies the scale by `backoff_factor` (never below
    `min_scale`). Clean steps do NOT restore the hysteresis tracker: only a growth event
    does, which happens after `growth_interval` consecutive clean steps and multiplies the
    scale by `growth_factor` (no upper bound).
    """

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        device: Optional[torch.device] = None,
    ) -> None:
        super().__init__(initial_scale, device)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(
                f"min loss scale must satisfy 0 < min ({min_scale}) <= initial "
                f"({initial_scale}); fix --min-loss-scale / --initial-loss-scale"
            )
        _check_float32_scale("min loss scale", float(min_scale))
        if not growth_factor > 1.0:
            raise ValueError(f"growth factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff factor must be in (0, 1), got {backoff_factor}")
        if growth_interval <= 0:
            raise ValueError(f"loss scale window must be > 0, got {growth_interval}")
        if hysteresis <= 0:
            raise ValueError(f"hysteresis must be > 0, got {hysteresis}")
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth = torch.zeros((), dtype=torch.int64, device=device)
        self._hyst = torch.full((), self.hysteresis, dtype=torch.int64, device=device)

    def to(self, device) -> "DynamicGradScaler":
        super().to(device)
        self._growth, self._hyst = self._growth.to(device), self._hyst.to(device)
        return self

    @property
    def growth_tracker(self) -> int:
        """Clean steps since the last growth or overflow (reads the device: a sync)."""
        return int(self._growth)

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows still tolerated before the scale backs off (reads the device)."""
        return int(self._hyst)

    def update(self, found_inf: Union[bool, torch.Tensor]) -> None:
        """Advance the trackers and the scale after one step. `found_inf`: any non-finite
        grad, as a bool or a 0-dim device tensor (nonzero: found). Everything is updated
        in place on the device (a captured step reads and updates these tensors)."""
        if not torch.is_tensor(found_inf):
            self._update_known(bool(found_inf))
            return
        found = found_inf.reshape(()).to(self._scale.device) != 0
        hyst = torch.where(found, self._hyst - 1, self._hyst)
        growth = torch.where(found, torch.zeros_like(self._growth), self._growth + 1)
        grow = growth == self.growth_interval
        backoff = found & (hyst <= 0)
        scale = torch.where(backoff, torch.clamp(self._scale * self.backoff_factor,
                                                 min=self.min_scale), self._scale)
        self._scale.copy_(torch.where(grow, scale * self.growth_factor, scale))
        self._hyst.copy_(torch.where(grow, torch.full_like(hyst, self.hysteresis), hyst))
        self._growth.copy_(torch.where(grow, torch.zeros_like(growth), growth))

    def _update_known(self, found: bool) -> None:
        """`update()` for a flag the host has read: fewer kernels, the same rule."""
        if found:
            self._growth.zero_()
            self._hyst.sub_(1)
            backed = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
            self._scale.copy_(torch.where(self._hyst <= 0, backed, self._scale))
            return
        self._growth.add_(1)
        grow = self._growth == self.growth_interval
        self._scale.copy_(torch.where(grow, self._scale * self.growth_factor, self._scale))
        self._hyst.copy_(torch.where(grow, torch.full_like(self._hyst, self.hysteresis),
                                     self._hyst))
        self._growth.masked_fill_(grow, 0)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "scale": self._scale.detach().clone(),
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """The saved scale and trackers, each tracker capped by this run's settings: a
        resume at a smaller --loss-scale-window than the clean steps already counted grows
        the scale at its next clean step (Megatron-LM's `==` test never fires again until an
        overflow resets the count: the new window was silently ignored), and one at a
        smaller --hysteresis tolerates at most that many overflows."""
        scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32)
        self._scale.copy_(scale.reshape(()))
        self._growth.fill_(min(int(state_dict["growth_tracker"]), self.growth_interval - 1))
        self._hyst.fill_(min(int(state_dict["hysteresis_tracker"]), self.hysteresis))


def load_scaler_state(scaler: Optional[MegatronGradScaler], state_dict: Dict[str, Any]) -> None:
    """Restore `scaler` from an optimizer checkpoint entry (its "grad_scaler", if any),
    Megatron's rule: a saved state loads into a scaler of the run; a constant scaler keeps
    its --loss-scale. Where the checkpoint's loss scaling is not the run's, a warning says
    what the run uses instead: no scaler saved (bf16, fp32 or an older checkpoint) or a
    constant --loss-scale's empty entry under a dynamic scaler -> the dynamic scale
    starts at --initial-loss-scale (Megatron-LM stops with a KeyError on the latter); a
    dynamic state under a run without a scaler (bf16) is ignored."""
    saved = state_dict.get("grad_scaler")
    if isinstance(scaler, DynamicGradScaler):
        if not saved:
            what = ("a constant --loss-scale" if saved is not None
                    else "no loss scaler (bf16/fp32, or an older checkpoint)")
            warnings.warn(f"the checkpoint was saved with {what}; the dynamic loss scale "
                          f"starts at --initial-loss-scale {float(scaler.scale):g}")
            return
        scaler.load_state_dict(saved)
    elif scaler is not None:
        scaler.load_state_dict(saved or {})
    elif saved:
        warnings.warn("the checkpoint has a dynamic loss scaler but this run uses none "
                      "(bf16); ignoring it")
