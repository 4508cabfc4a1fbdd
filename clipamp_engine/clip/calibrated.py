"""``clip=calibrated``: measure the norms in calibration windows, then clip at τ = Quantile_q of them.

The seed's "Norm Calibration Window": train a short interval without clipping (or at a
conservative cap), take a high quantile of the finite pre-clip norms as the threshold, and
revise it in later windows if asked. The policy owns the whole procedure (window schedule,
the window's norms, the summaries, the adopted τ), so ``state_dict()`` is all a resumed run
needs, and a user's own loop around ``AmpTrainState`` calibrates exactly as the app does.

References:
    Seed lesson 004, "Choosing the threshold" and "Norm Calibration Window".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..calibration import CalibrationError, CalibrationSummary, CalibrationWindows, NormCalibrator
from ..records import StepLog
from .base import ClipPolicy, positive
from .fixed import GlobalNormClip, NoClip

__all__ = ["CalibratedClip"]


class CalibratedClip(ClipPolicy):
    """Global-norm clipping at a threshold measured in calibration windows.

    Steps 1 … ``window`` form the first window, then one starts every ``every`` steps
    (see ``CalibrationWindows``). Until the first window closes, steps are clipped at ``cap``
    (or not at all); at the last step of each window its finite pre-clip norms are summarised
    (``NormCalibrator``) and, from the next step on, gradients are clipped at
    τ = Quantile_``quantile`` of them (``GlobalNormClip(τ)``). Later windows measure under the
    τ in force and replace it when they close. Skipped steps inside a window are counted,
    never mixed into the quantiles.

    The norms reach the policy through ``observe(record)`` (host values the step already
    read back), so calibrating adds no host sync. ``phase(step)`` names a step's role:
    ``"calibrate"`` inside a window, ``"validate"`` outside.

    Args:
        window: steps per window (>= 2).
        every: steps between window starts (0: one window; else >= ``window``).
        quantile: q of the recommendation τ = Quantile_q (0 < q < 1).
        candidates: fixed thresholds whose would-be clipping ratio each summary reports.
        cap: τ while the first window measures (``None``: no clipping then).
        total_steps: the run length (context, not an option): a window cut by the end of the
            run is kept only with >= 2 steps. ``None``: the run length is unknown.

    Raises (from ``observe``, i.e. ``AmpTrainState.step``):
        CalibrationError: a window had no finite norm, or recommends τ <= 0.
    """

    mode = "calibrated"

    def __init__(self, window: int = 100, every: int = 0, quantile: float = 0.95,
                 candidates: Sequence[float] = (0.5, 1.0, 2.0, 5.0), cap: float | None = None, *,
                 total_steps: int | None = None) -> None:
        self.windows = CalibrationWindows(window, every, total_steps)
        self.quantile, self.candidates = quantile, tuple(candidates)
        NormCalibrator(quantile, self.candidates)  # validates quantile
        self.cap = None if cap is None else positive("cap", cap)
        self.summaries: list[CalibrationSummary] = []
        self._calibrator: NormCalibrator | None = None  # the open window's
        self._active: ClipPolicy = self._before_first_window()

    def _before_first_window(self) -> ClipPolicy:
        return GlobalNormClip(self.cap) if self.cap is not None else NoClip()

    @property
    def tau(self) -> float | None:
        """The τ adopted from the latest closed window (``None`` before the first closes)."""
        return self.summaries[-1].recommended_max_norm if self.summaries else None

    def phase(self, step: int) -> str:
        return "calibrate" if self.windows.window_at(step) is not None else "validate"

    def clip_(self, params, grads, pre, step):
        return self._active.clip_(params, grads, pre, step)

    @property
    def threshold(self) -> float | None:
        return self._active.threshold

    def observe(self, record: StepLog) -> None:
        window = self.windows.window_at(record.step)
        if window is None:
            return
        if self._calibrator is None:
            self._calibrator = NormCalibrator(self.quantile, self.candidates)
        self._calibrator.add(record)
        if record.step == window[-1]:
            summary = self._calibrator.summary()
            self._calibrator = None
            self._adopt(summary)

    def _adopt(self, summary: CalibrationSummary) -> None:
        tau = summary.recommended_max_norm
        if not tau > 0:
            raise CalibrationError(f"calibration window (steps {summary.start_step}-{summary.end_step}) recommends "
                                   f"max_norm={tau!r}: its gradient norms are zero (a detached graph or frozen "
                                   f"parameters?)")
        self.summaries.append(summary)
        self._active = GlobalNormClip(tau)

    def state_dict(self) -> dict[str, Any]:
        """The open window's norms, every closed window's summary (the last one's τ is in force)."""
        return {"calibrator": None if self._calibrator is None else self._calibrator.state_dict(),
                "summaries": [s.as_state() for s in self.summaries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._calibrator = None
        if state["calibrator"] is not None:
            self._calibrator = NormCalibrator(self.quantile, self.candidates)
            self._calibrator.load_state_dict(state["calibrator"])
        self.summaries = [CalibrationSummary.from_state(s) for s in state["summaries"]]
        self._active = GlobalNormClip(self.tau) if self.summaries else self._before_first_window()
