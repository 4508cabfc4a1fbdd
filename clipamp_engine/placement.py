"""Where a calibration window should start: after the LR warm-up and the norms' initial transient.

A window that covers the warm-up measures a burst that never comes back (norms fall once the LR
stops rising and the loss leaves its initial plateau), so its quantiles overstate τ. The rule
(``start='auto'``), decided online from the records a policy sees, one step at a time:

1. **warm-up over**: the first step whose LR is not above the previous step's (a schedule
   without warm-up ends it at step 2; the LR is read from the records, nothing is configured;
   records with no LR, NaN, have no warm-up to see either: the norms alone place the window, and
   its reason says so);
2. **transient over**: from then on, the rolling median of the last ``span`` finite pre-clip
   norms (measured after the warm-up only) has stayed within a relative band — max/min of the
   last ``patience`` rolling medians ≤ 1 + ``band``. A median ignores isolated spikes, so a bad
   batch does not delay the window; a trend (decay or growth faster than the band per
   ``patience`` steps) does.

The window starts on the step after both hold. ``latest`` caps the wait (the window must
still fit in the run): reaching it starts the window anyway and says so.

References:
    Page, "Continuous inspection schemes", Biometrika 41 (1954) (stopping once a monitored
    statistic stays in control; here the statistic is a rolling median).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .spelling import ENGINE, Spelling


@dataclass(frozen=True)
class Placement:
    """Where the window starts and why."""

    start: int  # first step of the window (1-based)
    warmup_end: int | None  # first step whose LR did not rise (None: not seen before `latest`)
    settled_at: int | None  # step at which the rolling median had been in band for `patience` steps
    median: float | None  # rolling median of the norms at that point (None when none was computed)
    rule: str  # "auto" | "fixed" | "deadline"
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "warmup_end": self.warmup_end,
            "settled_at": self.settled_at,
            "median": self.median,
            "rule": self.rule,
            "reason": self.reason,
        }


def fixed_placement(skip: int, spelling: Spelling = ENGINE) -> Placement:
    """``start=N``: the window starts after ``N`` steps (``0``: at step 1, as before); its reason names the
    option as ``spelling`` writes it."""
    return Placement(
        skip + 1,
        None,
        None,
        None,
        "fixed",
        f"{spelling.set('start', skip)}: the window starts at step {skip + 1}"
        + (" (it includes any LR warm-up)" if skip == 0 else ""),
    )


def _not_rising(previous: float, lr: float) -> bool:
    return lr <= previous * (1 + 1e-12)


class StartDetector:
    """The online rule of this module: feed every record, ``placement`` is set once the window may start.

    Args:
        span: norms in each rolling median.
        band: allowed relative spread (max/min − 1) of the last ``patience`` rolling medians.
        patience: how many consecutive rolling medians must stay in the band.
        latest: the window starts at this step at the latest (None: no deadline).
        spelling: how a reason names the options (``clipamp_engine.spelling``).
    """

    def __init__(
        self,
        span: int = 20,
        band: float = 0.25,
        patience: int = 20,
        latest: int | None = None,
        *,
        spelling: Spelling = ENGINE,
    ) -> None:
        if span < 1 or patience < 1 or not band > 0:
            raise ValueError(f"span={span}, patience={patience} must be >= 1 and band={band} > 0")
        self.span, self.band, self.patience, self.latest = span, band, patience, latest
        self.spelling = spelling
        self.warmup_end: int | None = None
        self.placement: Placement | None = None
        self._previous_lr: float | None = None
        self._lr_seen = False  # a finite LR in any record so far: else the norms alone place the window
        self._norms: deque[float] = deque(maxlen=span)
        self._medians: deque[float] = deque(maxlen=patience)
        self._median_steps: deque[int] = deque(maxlen=patience)  # the step of each median: a sparse log's span

    def update(self, step: int, lr: float, norm: float, skipped: bool = False) -> Placement | None:
        """Read one record; return the placement on the step it is decided (then keep returning it)."""
        if self.placement is not None:
            return self.placement
        known = math.isfinite(lr)
        self._lr_seen |= known
        if self.warmup_end is None and self._previous_lr is not None:
            if not (known and math.isfinite(self._previous_lr)) or _not_rising(self._previous_lr, lr):
                self.warmup_end = step  # no LR to rise: as a constant one, the second record ends it
        self._previous_lr = lr
        if self.warmup_end is not None and not skipped and math.isfinite(norm):
            self._norms.append(norm)
            if len(self._norms) == self.span:
                self._medians.append(statistics.median(self._norms))
                self._median_steps.append(step)
        if len(self._medians) == self.patience and self._in_band():
            m = self._medians[-1]
            self.placement = Placement(
                step + 1,
                self.warmup_end,
                step,
                m,
                "auto",
                f"{self._warmup_text()}; the rolling median of {self.span} norms varied by at most {self.band:.0%} "
                f"over its last {self.patience} values ({self._span_text(step)}, median {m:.3g}): "
                f"the window starts at step {step + 1}",
            )
        elif self.latest is not None and step + 1 >= self.latest:
            self.placement = self._deadline(step)
        return self.placement

    def _warmup_text(self) -> str:
        if not self._lr_seen:
            return (
                f"no LR in the records, so no warm-up to wait for: placed by the norms alone from step "
                f"{self.warmup_end}"
            )
        return f"LR warm-up over at step {self.warmup_end} (the LR stopped rising)"

    def _span_text(self, step: int) -> str:
        """The steps the last ``patience`` medians were taken at: as many steps as medians only where every step
        logged a finite norm (a log every N steps, or skipped steps, spread them wider)."""
        first = self._median_steps[0] if len(self._median_steps) == self.patience else None
        return f"steps {first}–{step}" if first is not None else f"to step {step}"  # a state saved before the steps

    def _in_band(self) -> bool:
        lo, hi = min(self._medians), max(self._medians)
        return lo > 0 and hi / lo <= 1 + self.band

    def _deadline(self, step: int) -> Placement:
        why = (
            "the LR was still rising"
            if self.warmup_end is None
            else f"the rolling median of the norms still varied by more than {self.band:.0%} "
            + (f"(warm-up over at step {self.warmup_end})" if self._lr_seen else "(no LR in the records)")
        )
        m = self._medians[-1] if self._medians else None
        sp = self.spelling
        # the deadline moves with the run's length: where that is only told, the loop must lengthen with it
        longer = "use a longer run" if sp.lengthen == "raise" else f"{sp.longer_run()},"
        return Placement(
            step + 1,
            self.warmup_end,
            None,
            m,
            "deadline",
            f"{why} by step {step}; the window starts at step {step + 1} anyway, the latest start that "
            f"leaves room for the window and its validation steps: its quantiles may still include "
            f"a transient ({longer} or {sp.set('start', 'N')})",
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "warmup_end": self.warmup_end,
            "last_lr": self._previous_lr,
            "lr_seen": self._lr_seen,
            "norms": list(self._norms),
            "medians": list(self._medians),
            "median_steps": list(self._median_steps),
            "latest": self.latest,
            "placement": self.placement.as_dict() if self.placement else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.warmup_end, self._previous_lr, self.latest = state["warmup_end"], state["last_lr"], state["latest"]
        self._lr_seen = state.get("lr_seen", True)  # a state saved before the flag: its run had an LR
        self._norms = deque(state["norms"], maxlen=self.span)
        self._medians = deque(state["medians"], maxlen=self.patience)
        self._median_steps = deque(state.get("median_steps", ()), maxlen=self.patience)
        self.placement = Placement(**state["placement"]) if state["placement"] else None


def auto_window_start(trace: Iterable[tuple[int, float, float]], **rule: Any) -> Placement | None:
    """The ``auto`` start for a recorded trace of ``(step, lr, norm)``: the step the online rule picks.

    ``rule``: ``StartDetector`` arguments. ``None`` when the rule never fires within the trace.
    """
    detector = StartDetector(**rule)
    for step, lr, norm in trace:
        placement = detector.update(step, lr, norm, skipped=not math.isfinite(norm))
        if placement is not None:
            return placement
    return None


def warmup_end(lrs: Iterable[float]) -> int | None:
    """1-based index of the first LR not above its predecessor (the end of a warm-up), or None."""
    last = None
    for i, lr in enumerate(lrs, start=1):
        if last is not None and _not_rising(last, lr):
            return i
        last = lr
    return None
