"""clipamp engine: safe mixed-precision steps with global-norm clipping and per-step forensics.

Depends on torch only (``diagnosis`` also on numpy). The top level is what a training loop needs:
``AmpTrainState`` (the step) and its records, the CSV writer, the common clip policies and
``make_clip_policy``, the loss scalers, calibration (``CalibratedClip``), the two exceptions a step
raises, and the norm functions. Everything else is imported from its module:

- ``clipamp_engine.clip``: every clip policy (``StagedNormClip``, ``PerGroupClip``,
  ``QuantileClip``, ``DPSGDClip``, …), ``CLIP_MODES``, ``clip_mode_options``;
- ``clipamp_engine.calibration``: ``NormCalibrator``, ``CalibrationWindows``, ``CalibrationSummary``,
  ``quantile_label`` (``p95``: the name of a quantile in summaries and metrics);
- ``clipamp_engine.spelling``: ``Spelling`` (how the calibration's advice names the settings, per front end);
- ``clipamp_engine.monitors``: ``SkipRateMonitor``, ``ClipRatioMonitor``, ``SkipRateWarning``;
- ``clipamp_engine.forensics``, ``clipamp_engine.diagnosis``, ``clipamp_engine.records``
  (``SKIP_REASONS``), ``clipamp_engine.scaling`` (``LossScaleFloorWarning``),
  ``clipamp_engine.step`` (``DTYPES``, ``parse_dtype``), ``clipamp_engine.fused`` and
  ``clipamp_engine.fused_step`` (the fused path).
"""

from .calibration import CalibrationError
from .clip import CalibratedClip, ClipPolicy, GlobalNormClip, NoClip, make_clip_policy
from .csvlog import StepCSVWriter
from .monitors import SkipRateExceeded
from .norms import clip_global_l2_norm, has_non_finite_grad, total_norm
from .records import CANONICAL_COLUMNS, SkipLog, StepLog
from .scaling import HysteresisScaler, LossScaler
from .step import AmpTrainState

__all__ = [
    "AmpTrainState",
    "CANONICAL_COLUMNS",
    "CalibratedClip",
    "CalibrationError",
    "ClipPolicy",
    "GlobalNormClip",
    "HysteresisScaler",
    "LossScaler",
    "NoClip",
    "SkipLog",
    "SkipRateExceeded",
    "StepCSVWriter",
    "StepLog",
    "clip_global_l2_norm",
    "has_non_finite_grad",
    "make_clip_policy",
    "total_norm",
]
