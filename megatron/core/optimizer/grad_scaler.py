"""Loss scalers for fp16 (and optionally bf16) training, with Megatron's update rule.

The scale lives in a 0-dim float32 tensor on the parameters' device so that scaling the
loss and unscaling the gradients need no host synchronisation; the trackers are Python
ints because `update(found_inf)` is called after the (single) host sync of a step.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch


class MegatronGradScaler:
    """Base: holds the current scale; `update(found_inf)` is called once per step."""

    def __init__(self, initial_scale: float, device: Optional[torch.device] = None) -> None:
        if not initial_scale > 0.0:
            raise ValueError(f"initial loss scale must be > 0, got {initial_scale}")
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

    def update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        raise NotImplementedError


class ConstantGradScaler(MegatronGradScaler):
    """A fixed scale (`--loss-scale X`). Its checkpoint entry is an empty dict."""

    def __init__(self, scale: float, device: Optional[torch.device] = None) -> None:
        super().__init__(scale, device)

    def update(self, found_inf: bool) -> None:
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
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Advance the trackers after one step (found_inf: any non-finite grad)."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:  # in place: a captured step reads this tensor
                self._scale.copy_(torch.clamp(self._scale * self.backoff_factor,
                                              min=self.min_scale))
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale.mul_(self.growth_factor)

    def state_dict(self) -> Dict[str, Any]:
        return {
            "scale": self._scale.detach().clone(),
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        scale = torch.as_tensor(state_dict["scale"], dtype=torch.float32)
        self._scale.copy_(scale.reshape(()))
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
