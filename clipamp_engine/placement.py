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
from dataclasses import dataclass, field
from typing import Any

from .spelling import ENGINE, Spelling


@dataclass(frozen=True)
class Placement:
    """Where the window starts and why: ``why`` is the reason as a code and its figures (``{"code": "fixed",
    "skip": 0}``), which a checkpoint keeps; ``reason`` renders it as ``spelling`` names the options, so a state
    loaded by another front end (``CalibratedClip(spelling=…)``) or a later wording shows that one's."""

    start: int  # first step of the window (1-based)
    warmup_end: int | None  # first step whose LR did not rise (None: not seen before `latest`)
    settled_at: int | None  # step at which the rolling median had been in band for `patience` steps
    median: float | None  # rolling median of the norms at that point (None when none was computed)
    rule: str  # "auto" | "fixed" | "deadline"
    why: dict[str, Any]
    spelling: Spelling = field(default=ENGINE, compare=False, repr=False)

    @property
    def reason(self) -> str:
        return _REASONS[self.why["code"]](self.why, self.spelling)

    def as_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the reason as its code and figures, never rendered."""
        return {k: getattr(self, k) for k in ("start", "warmup_end", "settled_at", "median", "rule")} | {
            "why": dict(self.why)
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any], spelling: Spelling = ENGINE) -> Placement:
        """``as_dict``'s placement, its reason rendered with ``spelling``; a state saved with the reason rendered
        (``"reason"``: a text) keeps that text."""
        state = dict(state)
        text = state.pop("reason", None)
        why = state.pop("why", None) or {"code": "text", "text": text}
        return cls(**state, why=why, spelling=spelling)


def _fixed(why: dict[str, Any], spelling: Spelling) -> str:
    skip = why["skip"]
    return f"{spelling.set('start', skip)}: the window starts at step {skip + 1}" + (
        " (it includes any LR warm-up)" if skip == 0 else ""
    )


def _warmup(why: dict[str, Any]) -> str:
    if not why["lr_seen"]:
        return (
            f"no LR in the records, so no warm-up to wait for: placed by the norms alone from step {why['warmup_end']}"
        )
    return f"LR warm-up over at step {why['warmup_end']} (the LR stopped rising)"


def _auto(why: dict[str, Any], spelling: Spelling) -> str:
    step, first = why["step"], why["first"]
    seen = f"steps {first}–{step}" if first is not None else f"to step {step}"  # a state saved before the steps
    return (
        f"{_warmup(why)}; the rolling median of {why['span']} norms varied by at most {why['band']:.0%} over its "
        f"last {why['patience']} values ({seen}, median {why['median']:.3g}): the window starts at step {step + 1}"
    )


def _deadline(why: dict[str, Any], spelling: Spelling) -> str:
    step = why["step"]
    # the deadline moves with the run's length: where that is only told, the loop must lengthen with it
    longer = "use a longer run" if spelling.lengthen == "raise" else f"{spelling.longer_run()},"
    cause = (
        "the LR was still rising"
        if why["warmup_end"] is None
        else f"the rolling median of the norms still varied by more than {why['band']:.0%} "
        + (f"(warm-up over at step {why['warmup_end']})" if why["lr_seen"] else "(no LR in the records)")
    )
    return (
        f"{cause} by step {step}; the window starts at step {step + 1} anyway, the latest start that "
        f"leaves room for the window and its validation steps: its quantiles may still include "
        f"a transient ({longer} or {spelling.set('start', 'N')})"
    )


def _no_room(why: dict[str, Any], spelling: Spelling) -> str:
    return (
        f"the run ({why['total_steps']} steps) leaves no room to wait for the warm-up before a {why['window']}-step "
        f"window and its validation: the window starts at step 1 ({spelling.longer_run()} to let "
        f"{spelling.set('start', spelling.auto)} wait)"
    )


#: Each reason's rendering by its code; ``text``: a reason a checkpoint kept rendered (before codes).
_REASONS = {
    "fixed": _fixed,
    "auto": _auto,
    "deadline": _deadline,
    "no_room": _no_room,
    "text": lambda why, spelling: why["text"],
}


def fixed_placement(skip: int, spelling: Spelling = ENGINE) -> Placement:
    """``start=N``: the window starts after ``N`` steps (``0``: at step 1, as before); its reason names the
    option as ``spelling`` writes it."""
    return Placement(skip + 1, None, None, None, "fixed", {"code": "fixed", "skip": skip}, spelling)


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
            first = self._median_steps[0] if len(self._median_steps) == self.patience else None
            figures = {"span": self.span, "band": self.band, "patience": self.patience, "first": first, "median": m}
            why = {"code": "auto", "warmup_end": self.warmup_end, "lr_seen": self._lr_seen, "step": step, **figures}
            self.placement = Placement(step + 1, self.warmup_end, step, m, "auto", why, self.spelling)
        elif self.latest is not None and step + 1 >= self.latest:
            self.placement = self._deadline(step)
        return self.placement

    def _in_band(self) -> bool:
        lo, hi = min(self._medians), max(self._medians)
        return lo > 0 and hi / lo <= 1 + self.band

    def _deadline(self, step: int) -> Placement:
        why = {"code": "deadline", "warmup_end": self.warmup_end, "lr_seen": self._lr_seen, "band": self.band}
        m = self._medians[-1] if self._medians else None
        return Placement(step + 1, self.warmup_end, None, m, "deadline", {**why, "step": step}, self.spelling)

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
        self.placement = Placement.from_dict(state["placement"], self.spelling) if state["placement"] else None


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
