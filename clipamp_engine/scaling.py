"""Dynamic loss scaling: torch's ``GradScaler`` plus the back-off it lacks for refused losses,
and a scaler with DeepSpeed's overflow hysteresis, GradScaler's growth count, a floor, a cap
and a floor alarm, updated on the device (no host sync per step).

References:
    Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740 (loss scaling).
    DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py`` ``DynamicLossScaler`` (hysteresis,
    ``delayed_shift``, ``consecutive_hysteresis``, ``min_scale``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from ._torch_compat import found_infs, record_found_inf, reset_inf_checks, scale_tensors
from .warn import warn

__all__ = ["HysteresisScaler", "LossScaleFloorWarning", "LossScaler"]

#: The scale lives in an fp32 tensor (as GradScaler's does): it can never exceed this.
FP32_MAX = torch.finfo(torch.float32).max

#: ``HysteresisScaler``'s device counters, in the order they are stored.
COUNTERS = ("hysteresis_left", "overflows", "overflow_streak", "backoffs", "at_floor", "floor_arrivals")


class LossScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` that can also back off on a step refused before backward.

    ``GradScaler.update()`` asserts that an inf check ran this iteration; a step skipped for a
    non-finite loss never reaches ``unscale_``, so ``back_off()`` applies the overflow rule
    (scale × backoff_factor, growth tracker reset) through the public state dict instead.
    Disabled (bf16/fp32) it is a no-op like the parent. Enabled, its settings are checked here (one
    ``ValueError`` each): ``GradScaler`` asserts only the factors, and takes an ``init_scale`` of 0, inf or
    NaN (every step skipped, the scale stuck) or a ``growth_interval`` of 0 (the scale never grows).
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if enabled:
            check_scaler_settings(init_scale, growth_factor, backoff_factor, growth_interval)
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )

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
        if self.is_enabled():
            record_found_inf(self, optimizer, found_inf)

    def scale_tensor(self) -> torch.Tensor | None:
        """The current scale as a device tensor (no sync); ``None`` when disabled or not yet used."""
        tensors = scale_tensors(self) if self.is_enabled() else None
        return None if tensors is None else tensors[0]

    def floor_flag(self) -> torch.Tensor | bool:
        """Whether the scale sits at a floor after the latest update, read later without a host sync
        now: ``False`` here (``GradScaler`` has no floor)."""
        return False

    def poll(self) -> None:
        """Bring host-side state up to date with the device (``AmpTrainState.flush`` calls it); nothing here."""


def check_scaler_settings(init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any) -> None:
    """``LossScaler``'s settings, each refused in one line naming its valid range."""
    if not (isinstance(init_scale, numbers.Real) and 0 < init_scale <= FP32_MAX):
        raise ValueError(f"init_scale={init_scale!r} must be a number > 0 that fits in fp32 (e.g. 2.0**16)")
    if not (isinstance(growth_factor, numbers.Real) and 1 < growth_factor < math.inf):
        raise ValueError(f"growth_factor={growth_factor!r} must be a finite number > 1 (e.g. 2.0)")
    if not (isinstance(backoff_factor, numbers.Real) and 0 < backoff_factor < 1):
        raise ValueError(f"backoff_factor={backoff_factor!r} must be in (0, 1) (e.g. 0.5)")
    if isinstance(growth_interval, bool) or not (
        isinstance(growth_interval, numbers.Integral) and growth_interval >= 1
    ):
        raise ValueError(f"growth_interval={growth_interval!r} must be an integer >= 1 (clean steps before a growth)")


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

    The rule runs on the device, like ``GradScaler``'s ``_amp_update_scale_``: the scale, the
    growth count and the counters (``hysteresis_left``, ``overflows``, ``overflow_streak``,
    ``backoffs``, ``at_floor``) are device tensors updated with branch-free tensor arithmetic
    (the scale in fp64, then rounded to the fp32 tensor), so ``update()`` never waits for the
    host. Reading a counter, ``get_scale()``, ``state_dict()`` or ``poll()`` brings them to the
    host in one transfer; the floor warning is issued there (``AmpTrainState`` polls at every
    flush). The device needs fp64 arithmetic (CUDA and CPU have it).

    It plugs into ``AmpTrainState(scaler=...)``: ``update()`` reads the inf checks that
    ``unscale_`` recorded (like ``GradScaler.update``) and ``back_off()`` applies the same
    overflow rule to a step refused before backward. Disabled, every method is a no-op.

    Args:
        device, init_scale, growth_factor, backoff_factor, growth_interval, enabled: as
            ``torch.amp.GradScaler``.
        hysteresis: N ≥ 1: the first N − 1 overflows are absorbed, the N-th backs off (DeepSpeed
            ``delayed_shift``; 1 = GradScaler behaviour).
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
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        # the counters (COUNTERS order) on the device, and their host copy as of the last transfer
        self._host = dict.fromkeys(COUNTERS, 0) | {"hysteresis_left": hysteresis}
        self._counters = torch.tensor([self._host[k] for k in COUNTERS], dtype=torch.int64)
        self._stale = False  # the device counters changed since the host copy was taken
        self._warned = 0  # floor arrivals already warned about

    # -- the rule (tensor arithmetic on the device) ----------------------------------------
    def _apply(self, overflow: torch.Tensor, scale: torch.Tensor, tracker: torch.Tensor) -> None:
        """One update from the 0-dim bool ``overflow``, in place on ``scale`` (fp32), ``tracker``
        (int32) and the counters, without a host sync."""
        if self._counters.device != scale.device:
            self._counters = self._counters.to(scale.device)
        left, overflows, streak, backoffs, at_floor, arrivals = self._counters.unbind()
        s = scale.double()
        clean_count = tracker.long() + 1
        backs = overflow if self.hysteresis == 1 else overflow & (left <= 1)
        backed = torch.clamp(s * self.get_backoff_factor(), min=self.min_scale)
        grows = ~overflow & (clean_count >= self.get_growth_interval())
        grown = torch.clamp(s * self.get_growth_factor(), max=self.max_scale)
        grown = torch.where(grown <= FP32_MAX, grown, s)  # a growth past fp32 is refused, as GradScaler's
        new_scale = torch.where(backs, backed, torch.where(grows, grown, s))
        restored = ~overflow if self.consecutive_hysteresis else grows
        new_left = torch.where(restored, self.hysteresis, torch.where(overflow & ~backs, left - 1, left))
        floor = new_scale <= self.min_scale
        arrived = floor & overflow & (at_floor == 0)
        counters = [
            new_left,
            overflows + overflow.long(),
            torch.where(overflow, streak + 1, 0),
            backoffs + (backs & (backed < s)).long(),
            floor.long(),
            arrivals + arrived.long(),
        ]
        scale.copy_(new_scale)  # rounded to fp32 as GradScaler's fill_ rounds a Python float
        tracker.copy_(torch.where(overflow | grows, 0, clean_count))
        self._counters.copy_(torch.stack(counters))
        self._stale = True

    # -- host view ---------------------------------------------------------------------------
    def _transfer(self) -> float:
        """The scale and the counters on the host in one transfer; warns on a new floor arrival."""
        tensors = scale_tensors(self)
        if tensors is None:  # before the first scale(): GradScaler keeps the scale on the host
            scale, counters = super().get_scale(), self._counters.tolist()  # sync: counters (CPU until then)
        else:
            scale, *counters = torch.cat(
                [tensors[0].double().reshape(1), self._counters.to(tensors[0].device).double()]
            ).tolist()  # sync: the scale and the counters, one transfer
        self._host = dict(zip(COUNTERS, map(int, counters)))
        self._stale = False
        if self._host["floor_arrivals"] > self._warned:
            self._warned = self._host["floor_arrivals"]
            warn(
                f"loss scale reached its floor min_scale={self.min_scale:g} ({self._host['overflows']} "
                "overflows so far): gradients overflow even at the smallest scale; check the loss, the LR "
                "and fp16 ranges (or use bf16)",
                LossScaleFloorWarning,
            )
        return scale

    def _counter(self, name: str) -> int:
        if self._stale:
            self._transfer()
        return self._host[name]

    @property
    def hysteresis_left(self) -> int:
        """The hysteresis counter L ≥ 1: the next L − 1 overflows are absorbed and the one after backs
        off (1: the next overflow backs off). Reading it syncs when it changed."""
        return self._counter("hysteresis_left")

    @property
    def overflows(self) -> int:
        """Overflow steps seen in all (absorbed or not)."""
        return self._counter("overflows")

    @property
    def overflow_streak(self) -> int:
        """Consecutive overflow steps ending at the latest update."""
        return self._counter("overflow_streak")

    @property
    def backoffs(self) -> int:
        """Overflows that lowered the scale."""
        return self._counter("backoffs")

    @property
    def at_floor(self) -> bool:
        """Whether the scale is at ``min_scale`` (reading it syncs when the counters changed)."""
        return bool(self._counter("at_floor"))

    def floor_flag(self) -> torch.Tensor | bool:
        """``at_floor`` as of the latest update without a host sync: a copy of the device counter
        (a 0-dim int64 tensor, nonzero at the floor) to read later, e.g. with a flush's records;
        ``False`` when disabled."""
        if not self.is_enabled():
            return False
        return self._counters[COUNTERS.index("at_floor")].clone()

    def poll(self) -> None:
        """Read the counters (one transfer when they changed) and warn if the floor was reached."""
        if self.is_enabled() and self._stale:
            self._transfer()

    # -- GradScaler interface ---------------------------------------------------------------
    def get_scale(self) -> float:
        return self._transfer() if self.is_enabled() else 1.0

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Apply the hysteresis rule to this iteration's inf checks (or set ``new_scale``), on the device."""
        if not self.is_enabled():
            return
        if new_scale is not None:
            super().update(new_scale)
            return
        tensors = scale_tensors(self)
        if tensors is None:
            raise AssertionError("Attempted update but the scale is not initialised: call scale(loss) first")
        infs = found_infs(self)
        if not infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        scale, tracker = tensors
        overflow = torch.stack([f.to(scale.device).float().reshape(()) for f in infs]).sum() > 0
        self._apply(overflow, scale, tracker)
        reset_inf_checks(self)

    def back_off(self) -> None:
        """A step refused before backward counts as an overflow under the same rule."""
        if not self.is_enabled():
            return
        tensors = scale_tensors(self)
        if tensors is not None:
            self._apply(torch.ones((), dtype=torch.bool, device=tensors[0].device), *tensors)
            return
        # before the first scale(): the rule on CPU copies of GradScaler's initial values, written back
        state = torch.amp.GradScaler.state_dict(self)
        scale = torch.tensor(state["scale"], dtype=torch.float32)
        tracker = torch.tensor(state["_growth_tracker"], dtype=torch.int32)
        self._apply(torch.ones((), dtype=torch.bool), scale, tracker)
        state.update(scale=scale.item(), _growth_tracker=int(tracker))  # CPU tensors: no device sync
        torch.amp.GradScaler.load_state_dict(self, state)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()  # get_scale(): the counters come with the scale
        if state:
            state.update(
                hysteresis=self.hysteresis,
                consecutive_hysteresis=self.consecutive_hysteresis,
                min_scale=self.min_scale,
                max_scale=self.max_scale,
                **{k: self._host[k] for k in COUNTERS if k != "at_floor"},
                at_floor=bool(self._host["at_floor"]),
            )
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if not self.is_enabled():
            return
        for key in ("hysteresis", "consecutive_hysteresis", "min_scale", "max_scale"):
            if key in state_dict:
                setattr(self, key, state_dict[key])
        host = {k: int(state_dict.get(k, self._host[k])) for k in COUNTERS}
        if "floor_arrivals" not in state_dict:  # a checkpoint from before the count: the floor was warned about
            host["floor_arrivals"] = host["at_floor"]
        self._counters.copy_(torch.tensor([host[k] for k in COUNTERS], dtype=torch.int64))
        self._host, self._stale, self._warned = host, False, host["floor_arrivals"]
