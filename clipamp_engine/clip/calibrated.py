"""``clip=calibrated``: measure the norms in calibration windows, then clip at τ = Quantile_q of them.

A calibration window: train a short interval without clipping (or at a
conservative cap), take a high quantile of the finite pre-clip norms as the threshold, check
that it clips as predicted on the following steps, and revise it in later windows if asked.
The policy owns the whole procedure — where the window starts (``start``, see
``clipamp_engine.placement``), the window's norms, each window's summary with the confidence
interval of every quantile, the adopted τ, the validation counts behind each τ's band check
(``clipamp_engine.band``) and the drift between windows — so ``state_dict()`` is all a resumed
run needs, and a user's own loop around ``AmpTrainState`` calibrates exactly as the app does.

References:
    Pascanu, Mikolov, Bengio, "On the difficulty of training recurrent neural networks", ICML 2013
        (the threshold from the statistics of the norms over many updates).
    Seetharaman et al., "AutoClip", arXiv:2007.14469 (a percentile of the observed norms).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..band import PRETRAINING_BAND, BandCheck, band_quantile, check_band, validate_band
from ..calibration import (
    CONFIDENCE,
    DEFAULT_CANDIDATES,
    DEFAULT_QUANTILE,
    DEFAULT_WINDOW,
    CalibrationError,
    CalibrationSummary,
    CalibrationWindows,
    NormCalibrator,
)
from ..placement import Placement, StartDetector, fixed_placement
from ..records import StepLog
from ..spelling import ENGINE, Spelling
from .base import ClipPolicy, positive
from .fixed import GlobalNormClip, NoClip

__all__ = ["RECOMMENDED", "CalibratedClip", "recommended_calibration"]

PHASES = ("settle", "calibrate", "validate", "train")


class CalibratedClip(ClipPolicy):
    """Global-norm clipping at a threshold measured in calibration windows, checked on held-out steps.

    Before the first window (``start``: ``"auto"`` or a number of steps to wait) steps are in
    phase ``settle``; ``auto`` opens the window once the LR warm-up is over and the rolling median
    of the norms has settled (``StartDetector``, at the latest when the window and its validation
    still fit in ``total_steps``). A window (phase ``calibrate``) lasts ``window`` steps, then one
    opens every ``every`` steps after the first. Until the first window closes, steps are clipped
    at ``cap`` (or not at all); at the last step of each window its finite pre-clip norms are
    summarised (``NormCalibrator``: quantiles with order-statistic intervals) and, from the next
    step on, gradients are clipped at τ = Quantile_``quantile`` (``quantile=None``: the quantile
    aiming at the centre of ``target_clip``, ``band_quantile``). The ``validate`` steps after a
    window (0: every step while its τ is in force, i.e. until the next window closes or the run
    ends) count how often τ clips: held-out steps, the next window's included, since τ still clips
    them (phase ``validate``, or ``calibrate`` inside the next window; later steps are ``train``);
    ``checks()`` compares that with the window's prediction and the band. A later window whose τ
    interval does not overlap the previous one's is flagged as drift (``drift()``). Skipped steps
    are counted, never mixed into quantiles or ratios.

    The norms reach the policy through ``observe(record)`` (host values the step already read
    back), so calibrating adds no per-step sync; on the fused path ``needs_records`` makes it flush
    once more (one transfer) at each window's last step, unless a flush falls there anyway.

    Args:
        window: steps per window (>= 2).
        every: steps between window starts (0: one window; else >= ``window``).
        quantile: q of τ = Quantile_q (0 < q < 1), or ``None`` to aim at ``target_clip``.
        candidates: fixed thresholds whose would-be clipping ratio each summary reports, in any order, none listed
            twice (``[]``: none; the summary reports the ratio at its quantiles and τ only).
        cap: τ until the first window closes (``None``: no clipping then).
        start: ``"auto"``, or the number of steps before the first window (0: it starts at step 1).
        validate: held-out steps after each window that check τ (0: all while τ is in force).
        target_clip: the clipping-ratio band ``[low, high]`` τ is judged against (the
            pretraining band of ``clipamp_engine.band`` by default).
        confidence: level of the quantile and ratio intervals.
        total_steps: the run length (context, not an option): a window cut by the end of the
            run is kept only with >= 2 steps; ``auto`` starts early enough to fit. ``None``: unknown.
        spelling: how the advice (placement reasons, warnings, next actions) names the settings, in the
            front end that built the policy (context, not an option; ``clipamp_engine.spelling``).

    Raises (from ``observe``, i.e. ``AmpTrainState.step``, ``step_deferred`` or ``flush``):
        CalibrationError: a window had no finite norm, or recommends τ <= 0.
    """

    mode = "calibrated"
    single_coefficient = True  # the threshold in force is a GlobalNormClip (or NoClip before a window)

    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        every: int = 0,
        quantile: float | None = DEFAULT_QUANTILE,
        candidates: Sequence[float] = DEFAULT_CANDIDATES,
        cap: float | None = None,
        start: int | str = 0,
        validate: int = 0,
        target_clip: Sequence[float] = PRETRAINING_BAND,
        confidence: float = CONFIDENCE,
        *,
        total_steps: int | None = None,
        spelling: Spelling = ENGINE,
    ) -> None:
        self.spelling = spelling
        self.band = validate_band(target_clip)
        self.quantile = band_quantile(self.band) if quantile is None else quantile
        self.candidates, self.confidence = tuple(candidates), confidence
        NormCalibrator(self.quantile, self.candidates, confidence)  # validates quantile
        self.cap = None if cap is None else positive("cap", cap)
        if not (start == "auto" or (isinstance(start, int) and not isinstance(start, bool) and start >= 0)):
            raise ValueError(
                f"{spelling.set('start', repr(start))} must be {spelling.auto} or a number of steps >= 0 (0: the "
                "window starts at step 1)"
            )
        if not isinstance(validate, int) or validate < 0:
            raise ValueError(f"validate={validate!r} must be a number of steps >= 0 (0: every step after the window)")
        self.start, self.validate, self.total_steps = start, validate, total_steps
        CalibrationWindows(window, every, total_steps)  # validates window, every, total_steps
        self.window, self.every = window, every
        latest = self._latest_start()
        self.detector = StartDetector(latest=latest, spelling=spelling) if start == "auto" else None
        self.placement: Placement | None = None if start == "auto" else fixed_placement(start, spelling)
        if start == "auto" and latest == 1:  # no room to wait: the window and its validation fill the run
            why = {"code": "no_room", "total_steps": total_steps, "window": window}
            self.placement = Placement(1, None, None, None, "deadline", why, spelling)
        self.windows = self._windows()
        self.summaries: list[CalibrationSummary] = []
        self.validation: list[list[int]] = []  # per closed window: [clipped, taken] over its validation steps
        self._calibrator: NormCalibrator | None = None  # the open window's
        self._active: GlobalNormClip | NoClip = self._before_first_window()

    def _latest_start(self) -> int | None:
        if self.total_steps is None:
            return None
        return max(1, self.total_steps - self.window - (self.validate or self.window) + 1)

    def _windows(self) -> CalibrationWindows | None:
        if self.placement is None:
            return None
        return CalibrationWindows(self.window, self.every, self.total_steps, first=self.placement.start)

    def _before_first_window(self) -> GlobalNormClip | NoClip:
        return GlobalNormClip(self.cap) if self.cap is not None else NoClip()

    @property
    def tau(self) -> float | None:
        """The τ adopted from the latest closed window (``None`` before the first closes)."""
        return self.summaries[-1].recommended_max_norm if self.summaries else None

    def phase(self, step: int) -> str:
        """``settle`` before the first window, ``calibrate`` in one, ``validate`` after one, then ``train``."""
        if self.windows is None or step < self.windows.first:
            return "settle"
        if self.windows.window_at(step) is not None:
            return "calibrate"
        if not self.validate:
            return "validate"
        last = self.windows.window_at(self._last_window_start(step))
        return "validate" if last is not None and step - last[-1] <= self.validate else "train"

    def _last_window_start(self, step: int) -> int:
        w = self.windows
        return w.first + ((step - w.first) // w.every * w.every if w.every else 0)

    def clip_(self, params, grads, pre, step):
        return self._active.clip_(params, grads, pre, step)

    def coefficient(self, pre, step):
        return self._active.coefficient(pre, step)

    @property
    def threshold(self) -> float | None:
        return self._active.threshold

    def observe(self, record: StepLog) -> None:
        if self.placement is None:
            self.placement = self.detector.update(record.step, record.lr, record.grad_l2_pre_clip, record.skipped)
            self.windows = self._windows()
            return
        if (
            self.validation
            and not record.skipped
            and (not self.validate or record.step - self.summaries[-1].end_step <= self.validate)
        ):
            self.validation[-1][0] += bool(record.clipped)  # a held-out step clipped (or not) at the latest τ
            self.validation[-1][1] += 1
        window = self.windows.window_at(record.step)
        if window is None:
            return
        if self._calibrator is None:
            self._calibrator = self._new_calibrator()
        self._calibrator.add(record)
        if record.step == window[-1]:
            summary = self._calibrator.summary()
            self._calibrator = None
            self._adopt(summary)

    def _new_calibrator(self) -> NormCalibrator:
        return NormCalibrator(self.quantile, self.candidates, self.confidence, spelling=self.spelling)

    def needs_records(self, step: int) -> bool:
        """At a window's last step: τ must be adopted before the next step clips. While ``start="auto"``
        waits, every ``window`` steps too: the window opens after the record that decides it, so it ends
        on a step not yet run, where the flush above adopts τ (a longer interval could run past it)."""
        if self.placement is None:
            return step % self.window == 0
        window = self.windows.window_at(step)
        return window is not None and step == window[-1]

    def close_early(self) -> bool:
        """The run stopped inside its first window: summarise the norms that window holds so far (two finite
        ones at least) and adopt their τ, as its last step would have; whether it did. Once a window closed, an
        open one is left as it is (the τ in force came from the window before it).

        Raises:
            CalibrationError: the window's norms are zero (as at the window's end).
        """
        if self.summaries or self._calibrator is None or len(self._calibrator.norms) < 2:
            return False
        summary = self._calibrator.summary()
        self._calibrator = None
        self._adopt(summary)
        return True

    def planned_held_out(self, index: int) -> int | None:
        """The held-out steps the run's length plans for closed window ``index``: until its ``validate`` steps end,
        the next window closes or the run's ``total_steps`` end (``None``: the length is unknown)."""
        if self.total_steps is None:
            return None
        end = self.summaries[index].end_step
        nxt = self.windows.next_start(end) if self.every else None
        until = self.windows.window_at(nxt)[-1] if nxt is not None else self.total_steps
        return min(until - end, self.validate) if self.validate else until - end

    def stopped_early(self, step: int) -> str | None:
        """One line when the run stopped at ``step``, before the ``total_steps`` its windows were placed for: what
        the stop cut from the calibration, with the figures (``None``: it ran its length, or the length is unknown).
        Call it after ``close_early``, which summarises a first window the stop cut short."""
        if self.total_steps is None or step >= self.total_steps:
            return None
        sp = self.spelling  # a length the user told (their loop's): as they passed it; a host's: its step count
        said = f"the run stopped at step {step} of " + (
            sp.set("length", self.total_steps) if sp.lengthen == "loop" else f"{self.total_steps} steps"
        )
        if not self.summaries:
            first = self.windows.window_at(self.windows.first) if self.windows is not None else None
            where = f" (steps {first[0]}–{first[-1]})" if first else ""
            return f"{said}, before its first {self.window}-step window{where} closed: no τ was recommended or checked"
        last, taken = self.summaries[-1], self.validation[-1][1]
        planned = self.windows.window_at(last.start_step)
        if last.end_step < planned[-1]:  # the first window, summarised as it stood by close_early
            return (
                f"{said}, inside its window (steps {planned[0]}–{planned[-1]}): τ={last.recommended_max_norm:.4g} is "
                f"from {last.end_step - last.start_step + 1} of its {len(planned)} steps, and no held-out step "
                "checked it"
            )
        need = self.planned_held_out(len(self.summaries) - 1)
        cut = f"{taken} held-out steps instead of {need}" if taken < need else f"its {need} held-out steps"
        never = "" if self._calibrator is None else f"; the window from step {self._calibrator.steps[0]} never closed"
        return f"{said}: the check of τ={last.recommended_max_norm:.4g} covered {cut}{never}"

    def _adopt(self, summary: CalibrationSummary) -> None:
        tau = summary.recommended_max_norm
        if not tau > 0:
            raise CalibrationError(
                f"calibration window (steps {summary.start_step}-{summary.end_step}) recommends "
                f"max_norm={tau!r}: its gradient norms are zero (a detached graph or frozen "
                f"parameters?)"
            )
        self.summaries.append(summary)
        self.validation.append([0, 0])
        self._active = GlobalNormClip(tau)

    def checks(self) -> list[BandCheck | None]:
        """Per closed window: its τ judged on its validation steps so far (None: none taken yet)."""
        last = len(self.summaries) - 1
        return [
            check_band(
                s.recommended_max_norm,
                s.predicted_clip_ratio,
                clipped,
                taken,
                self.band,
                self.confidence,
                repeating=self._has_later_window(s),
                placed_auto=self.start == "auto",
                quantile=s.quantile,
                norms=s.n_finite,
                room=None if self.total_steps is None else self.total_steps - s.end_step,
                validate=self.validate,
                spelling=self.spelling,
                held_out_by="validate"
                if self.validate and taken >= self.validate
                else "every"
                if i < last
                else "steps",
            )
            if taken
            else None
            for i, (s, (clipped, taken)) in enumerate(zip(self.summaries, self.validation))
        ]

    def _has_later_window(self, summary: CalibrationSummary) -> bool:
        """Whether a window opens after ``summary``'s in this run (``every`` past the run's end opens none)."""
        return bool(self.every) and self.windows is not None and self.windows.next_start(summary.end_step) is not None

    def drift(self) -> list[bool]:
        """Per closed window: whether its τ interval is separate from the previous window's (False for the first)."""
        return [False] + [not b.tau_ci.overlaps(a.tau_ci) for a, b in zip(self.summaries, self.summaries[1:])]

    def state_dict(self) -> dict[str, Any]:
        """Placement (or the detector deciding it), the open window's norms, every closed window's summary
        and validation counts (the last summary's τ is in force)."""
        return {
            "placement": self.placement.as_dict() if self.placement else None,
            "detector": self.detector.state_dict() if self.detector else None,
            "calibrator": None if self._calibrator is None else self._calibrator.state_dict(),
            "summaries": [s.as_state() for s in self.summaries],
            "validation": [list(v) for v in self.validation],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; an undecided ``auto`` start keeps its deadline for this policy's ``total_steps``
        (a resume that changed the run's length: the latest start that leaves room in the run it now is)."""
        if self.detector is not None and state.get("detector") is not None:
            self.detector.load_state_dict(state["detector"])
            self.detector.latest = self._latest_start()
        saved = state.get("placement")
        self.placement = Placement.from_dict(saved, self.spelling) if saved else self.placement
        self.windows = self._windows()
        self._calibrator = None
        if state["calibrator"] is not None:
            self._calibrator = self._new_calibrator()
            self._calibrator.load_state_dict(state["calibrator"])
        self.summaries = [CalibrationSummary.from_state(s, self.spelling) for s in state["summaries"]]
        self.validation = [list(v) for v in state.get("validation", [[0, 0]] * len(self.summaries))]
        self._active = GlobalNormClip(self.tau) if self.summaries else self._before_first_window()


#: The calibration ``+experiment=calibrate`` runs (``conf/experiment/calibrate.yaml`` states the
#: values that differ from ``CalibratedClip``'s defaults, tested equal), and every integration by
#: default: one 200-step window placed after the LR warm-up and the norms' initial transient, τ aimed
#: at the middle of the pretraining band (Quantile_0.97 for [1%, 5%]) with its interval, checked on
#: every later step (verdict and next action), drift flagged across windows.
RECOMMENDED: dict[str, Any] = {
    "window": 200,
    "every": 0,
    "quantile": None,
    "candidates": DEFAULT_CANDIDATES,
    "cap": None,
    "start": "auto",
    "validate": 0,
    "target_clip": PRETRAINING_BAND,
    "confidence": CONFIDENCE,
}


def recommended_calibration(
    *, total_steps: int | None = None, spelling: Spelling = ENGINE, **overrides: Any
) -> CalibratedClip:
    """``CalibratedClip`` with ``RECOMMENDED``'s options, any of them overridden by name.

    ``AmpTrainState(..., clip=recommended_calibration(total_steps=N))`` in a user's own loop
    calibrates exactly as the runner and the integrations do.
    """
    unknown = sorted(set(overrides) - set(RECOMMENDED))
    if unknown:
        raise ValueError(
            f"calibration options {', '.join(unknown)} are not among {', '.join(RECOMMENDED)} (CalibratedClip's)"
        )
    return CalibratedClip(**{**RECOMMENDED, **overrides}, total_steps=total_steps, spelling=spelling)
