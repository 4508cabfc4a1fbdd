"""Rolling monitors over step records: skip-rate alarm (with fail-fast) and clipping ratio.

A few skipped steps per run are normal under fp16; hundreds per epoch mean the loop is failing
silently. The skip rate is an alarm, not a log line.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from .warn import warn


class SkipRateExceeded(RuntimeError):
    """Raised by the fail-fast check when too many recent steps were skipped."""


class SkipRateWarning(RuntimeWarning):
    """Emitted once each time the rolling skip rate rises above its warning threshold."""


class RollingRate:
    """Fraction of true events over the last ``window`` observations, plus totals and streak."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self.window = window
        self._events: deque[bool] = deque(maxlen=window)
        self._in_window = 0
        self.total = 0
        self.hits = 0
        self.streak = 0  # consecutive true events ending at the latest observation

    def add(self, event: bool) -> None:
        if len(self._events) == self.window:
            self._in_window -= self._events[0]
        self._events.append(bool(event))
        self._in_window += bool(event)
        self.total += 1
        self.hits += bool(event)
        self.streak = self.streak + 1 if event else 0

    @property
    def count(self) -> int:
        return len(self._events)

    @property
    def rate(self) -> float:
        return self._in_window / len(self._events) if self._events else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "events": list(self._events),
            "total": self.total,
            "hits": self.hits,
            "streak": self.streak,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__init__(state["window"])
        for e in state["events"]:
            self.add(e)
        self.total, self.hits, self.streak = state["total"], state["hits"], state["streak"]


class SkipRateMonitor:
    """Rolling skip rate with a warning and an optional fail-fast check.

    Args:
        window: steps in the warning window (default 1,000).
        warn_above: warn when the rolling skip rate exceeds this (default 5%), once the window
            holds at least ``min(window, 100)`` steps (a rate over a handful of steps is noise).
        fail_window: steps in the fail-fast window (default 100).
        fail_above: raise ``SkipRateExceeded`` when, over the last ``fail_window`` steps (a
            full window), the skip rate exceeds this; ``None`` disables fail-fast.
    """

    def __init__(
        self, window: int = 1000, warn_above: float = 0.05, fail_window: int = 100, fail_above: float | None = None
    ) -> None:
        for name, value in (("warn_above", warn_above), ("fail_above", fail_above)):
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} must be a rate in [0, 1]")
        self.warn_above, self.fail_above = warn_above, fail_above
        self.long = RollingRate(window)
        self.short = RollingRate(fail_window)
        self.alarm = False

    def update(self, skipped: bool, step: int | None = None) -> None:
        self.long.add(skipped)
        self.short.add(skipped)
        over = self.long.count >= min(self.long.window, 100) and self.long.rate > self.warn_above
        if over and not self.alarm:
            warn(
                f"skip rate {self.long.rate:.1%} over the last {self.long.count} steps exceeds "
                f"{self.warn_above:.1%} (step {step}): the loop is skipping too many updates",
                SkipRateWarning,
            )
        self.alarm = over
        if self.fail_above is not None and self.short.count == self.short.window and self.short.rate > self.fail_above:
            raise SkipRateExceeded(
                f"skip rate {self.short.rate:.1%} over the last {self.short.window} steps exceeds "
                f"the fail-fast threshold {self.fail_above:.1%} at step {step} "
                f"({self.long.hits} skipped of {self.long.total}); check dtype, loss scale and data"
            )

    @property
    def rate(self) -> float:
        return self.long.rate

    def state_dict(self) -> dict[str, Any]:
        return {"long": self.long.state_dict(), "short": self.short.state_dict(), "alarm": self.alarm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.long.load_state_dict(state["long"])
        self.short.load_state_dict(state["short"])
        self.alarm = state["alarm"]


class ClipRatioMonitor(RollingRate):
    """Rolling clipping ratio: the share of taken steps whose record says ``clipped`` (post-clip
    norm below the pre-clip norm).

    Skipped steps are not observations (they were never clipped nor taken).
    """

    def __init__(self, window: int = 1000) -> None:
        super().__init__(window)
