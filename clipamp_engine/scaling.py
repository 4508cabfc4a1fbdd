"""Dynamic loss scaling: torch's ``GradScaler`` plus the back-off it lacks for refused losses,
and a scaler with DeepSpeed's overflow hysteresis, GradScaler's growth count, a floor, a cap
and a floor alarm.

References:
    Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740 (loss scaling).
    DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py`` ``DynamicLossScaler`` (hysteresis,
    ``delayed_shift``, ``consecutive_hysteresis``, ``min_scale``).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any

import torch
from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

__all__ = ["HysteresisScaler", "LossScaleFloorWarning", "LossScaler"]

#: The scale lives in an fp32 tensor (as GradScaler's does): it can never exceed this.
FP32_MAX = torch.finfo(torch.float32).max


class LossScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` that can also back off on a step refused before backward.

    ``GradScaler.update()`` asserts that an inf check ran this iteration; a step skipped for a
    non-finite loss never reaches ``unscale_``, so ``back_off()`` applies the overflow rule
    (scale × backoff_factor, growth tracker reset) through the public state dict instead.
    Disabled (bf16/fp32) it is a no-op like the parent.
    """

    def back_off(self) -> None:
        if not self.is_enabled():
            return
        state = self.state_dict()
        state["scale"] = state["scale"] * state["backoff_factor"]
        state["_growth_tracker"] = 0
        self.load_state_dict(state)

    def record_inf_check(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """Record ``found_inf`` as ``optimizer``'s inf check of this iteration, as ``unscale_`` +
        ``step`` would, for an update that unscaled inside a fused optimizer; ``update()`` follows."""
        if not self.is_enabled():
            return
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.STEPPED

    def scale_tensor(self) -> torch.Tensor | None:
        """The current scale as a device tensor (no sync); ``None`` when disabled or not yet used."""
        return self._scale if self.is_enabled() else None


class LossScaleFloorWarning(RuntimeWarning):
    """The loss scale reached its floor: overflows persist even at the smallest scale allowed."""


class HysteresisScaler(LossScaler):
    """Dynamic loss scaler: DeepSpeed's overflow hysteresis, GradScaler's growth, a floor and a cap.

    Overflow rule — DeepSpeed's (``DynamicLossScaler.update_scale``): an overflow first spends
    one unit of hysteresis; only when ``hysteresis == 1`` or the counter is down to 1 does the
    scale back off, to ``max(scale · backoff_factor, min_scale)``; the counter stays at 1, so
    further overflows back off immediately. The counter is restored to ``hysteresis`` on every
    overflow-free step when ``consecutive_hysteresis`` is true, otherwise only when the scale
    grows.

    Growth — counted as ``torch.amp.GradScaler`` counts it, not as DeepSpeed does: after
    ``growth_interval`` consecutive overflow-free steps, ``scale ← min(scale · growth_factor,
    max_scale)``. DeepSpeed grows when ``cur_iter − last_overflow_iter − 1`` is a positive
    multiple of ``scale_window``, i.e. after ``scale_window + 1`` clean steps: with
    ``growth_interval = scale_window`` every growth here comes one clean step earlier than
    DeepSpeed's (the spacing between growths is the same). A growth that would leave the fp32
    range is refused (scale kept, count restarted), as GradScaler's ``_amp_update_scale_``
    refuses it, whatever ``max_scale`` says.

    Example (init_scale 256, factor 2, hysteresis 3): four overflows in a row leave the scale
    at 256, 256, 128, 64.

    When the scale reaches ``min_scale``, ``at_floor`` becomes true and a
    ``LossScaleFloorWarning`` is issued (once each time the floor is reached): the run keeps
    overflowing even at the smallest scale, so scaling cannot help (DeepSpeed raises there).
    Everything survives ``state_dict()`` / ``load_state_dict()``.

    It plugs into ``AmpTrainState(scaler=...)``: ``update()`` reads the inf checks that
    ``unscale_`` recorded (like ``GradScaler.update``) and ``back_off()`` applies the same
    overflow rule to a step refused before backward. Disabled, every method is a no-op.

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            ``torch.amp.GradScaler``.
        hysteresis: overflows absorbed before backing off (DeepSpeed ``delayed_shift``; ≥ 1,
            1 = GradScaler behaviour).
        consecutive_hysteresis: restore the counter on every overflow-free step.
        min_scale: the floor (> 0).
        max_scale: the cap (≥ init_scale; may be inf: the fp32 range caps it anyway).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        if not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis={hysteresis!r} must be an integer >= 1 (1 = back off on every overflow)")
        if not min_scale > 0:
            raise ValueError(f"min_scale={min_scale!r} must be > 0")
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"need min_scale <= init_scale <= max_scale, got {min_scale} <= {init_scale} <= {max_scale}"
            )
        if not init_scale <= FP32_MAX:
            raise ValueError(f"init_scale={init_scale!r} must fit in fp32 (<= {FP32_MAX:.4g}), where the scale is kept")
        self.hysteresis = hysteresis
        self.hysteresis_left = hysteresis
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.at_floor = False
        self.overflows = 0  # total overflow steps seen (absorbed or not)
        self.overflow_streak = 0  # consecutive overflow steps ending at the latest update
        self.backoffs = 0  # overflows that lowered the scale

    # -- the rule (host arithmetic on the current scale) ----------------------------------
    def _read(self) -> tuple[float, int]:
        if self._scale is None:
            return float(self._init_scale), int(self._init_growth_tracker)
        scale, tracker = torch.stack([self._scale.float(), self._growth_tracker.float()]).tolist()  # sync
        return scale, int(tracker)

    def _write(self, scale: float, tracker: int) -> None:
        if self._scale is None:
            self._init_scale, self._init_growth_tracker = scale, tracker
        else:
            self._scale.fill_(scale)
            self._growth_tracker.fill_(tracker)

    def _apply(self, overflow: bool, scale: float, tracker: int) -> None:
        if overflow:
            self.overflows += 1
            self.overflow_streak += 1
            tracker = 0
            if self.hysteresis == 1 or self.hysteresis_left <= 1:
                new = max(scale * self._backoff_factor, self.min_scale)
                self.backoffs += new < scale
                scale = new
            else:
                self.hysteresis_left -= 1
        else:
            self.overflow_streak = 0
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            tracker += 1
            if tracker >= self._growth_interval:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                grown = min(scale * self._growth_factor, self.max_scale)
                if grown <= FP32_MAX:  # else refused, as GradScaler refuses to grow the scale to inf
                    scale = grown
                tracker = 0
        self._write(scale, tracker)
        floor = scale <= self.min_scale
        if floor and overflow and not self.at_floor:
            warnings.warn(
                f"loss scale reached its floor min_scale={self.min_scale:g} after {self.overflows} overflows: "
                "gradients overflow even at the smallest scale; check the loss, the LR and fp16 ranges "
                "(or use bf16)",
                LossScaleFloorWarning,
                stacklevel=3,
            )
        self.at_floor = floor

    # -- GradScaler interface ---------------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Apply the hysteresis rule to this iteration's inf checks (or set ``new_scale``)."""
        if not self._enabled:
            return
        if new_scale is not None:
            super().update(new_scale)
            return
        _scale, _tracker = self._check_scale_growth_tracker("update")
        found_infs = [
            found_inf.float().to(_scale.device)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        # sync: the rule branches on the overflow flag (GradScaler.step already synced it)
        found, scale, tracker = torch.stack([torch.stack(found_infs).sum(), _scale.float(), _tracker.float()]).tolist()
        self._apply(found > 0, scale, int(tracker))
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def back_off(self) -> None:
        """A step refused before backward counts as an overflow under the same rule."""
        if not self._enabled:
            return
        self._apply(True, *self._read())

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if state:
            state.update(
                hysteresis=self.hysteresis,
                hysteresis_left=self.hysteresis_left,
                consecutive_hysteresis=self.consecutive_hysteresis,
                min_scale=self.min_scale,
                max_scale=self.max_scale,
                at_floor=self.at_floor,
                overflows=self.overflows,
                overflow_streak=self.overflow_streak,
                backoffs=self.backoffs,
            )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if not self._enabled:
            return
        for key in (
            "hysteresis",
            "hysteresis_left",
            "consecutive_hysteresis",
            "min_scale",
            "max_scale",
            "at_floor",
            "overflows",
            "overflow_streak",
            "backoffs",
        ):
            if key in state_dict:
                setattr(self, key, state_dict[key])
