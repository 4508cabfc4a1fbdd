"""Where a run's calibration windows lie: the first at a given step, then one every ``every`` steps."""

from __future__ import annotations

from .checks import check_window_options

#: Steps per calibration window by default (``CalibrationWindows``, ``CalibratedClip``, the app's ``calibrate.window``).
DEFAULT_WINDOW = 100


class CalibrationWindows:
    """Where the calibration windows of a run lie: the first at step ``first``, then one every ``every`` steps.

    Each window is ``window`` steps long; with ``total_steps`` known, a window cut short by the
    end of the run is kept only if it still has 2 steps (a quantile of one norm says nothing).

    Args:
        window: steps per window (>= 2).
        every: steps between window starts (0: one window; else >= ``window``, no overlap).
        total_steps: the run length, if known (``None``: windows never end early).
        first: the first window's first step (1: from the start of the run).
    """

    def __init__(
        self, window: int = DEFAULT_WINDOW, every: int = 0, total_steps: int | None = None, first: int = 1
    ) -> None:
        check_window_options(window, every, total_steps, first)
        self.window, self.every, self.total_steps, self.first = int(window), int(every), total_steps, first

    def window_at(self, step: int) -> range | None:
        """The window (a range of 1-based steps) that contains ``step``, or ``None``."""
        if step < self.first or (self.total_steps is not None and step > self.total_steps):
            return None
        offset = (step - self.first) // self.every * self.every if self.every else 0
        start = self.first + offset
        end = start + self.window
        if self.total_steps is not None:
            end = min(end, self.total_steps + 1)
        return range(start, end) if start <= step < end and end - start >= 2 else None

    def next_start(self, step: int) -> int | None:
        """The first step of the next window that opens after ``step`` (None: no more windows)."""
        if step < self.first:
            nxt = self.first
        elif self.every:
            nxt = self.first + ((step - self.first) // self.every + 1) * self.every
        else:
            return None
        return nxt if self.total_steps is None or self.window_at(nxt) is not None else None

    def ranges(self) -> list[range]:
        """Every window of the run, in order (needs ``total_steps``)."""
        if self.total_steps is None:
            raise ValueError("the windows of a run of unknown length cannot be listed: pass total_steps")
        starts = range(self.first, self.total_steps + 1, self.every) if self.every else [self.first]
        return [w for w in map(self.window_at, starts) if w is not None]
