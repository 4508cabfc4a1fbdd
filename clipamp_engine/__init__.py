"""clipamp engine: safe mixed-precision steps with global-norm clipping and per-step forensics.

Depends on torch only. See ``AmpTrainState`` for the step, ``clip_global_l2_norm`` for the clip.
"""

from .calibration import CalibrationError, CalibrationSummary, CalibrationWindows, NormCalibrator
from .clip import (
    CLIP_MODES,
    AdaptiveGradClip,
    CalibratedClip,
    ClipPolicy,
    DPSGDClip,
    GlobalNormClip,
    NoClip,
    PerGroupClip,
    QuantileClip,
    StagedNormClip,
    UpdateNormClip,
    ValueClip,
    ZScoreClip,
    clip_mode_options,
    dp_sgd_grads,
    make_clip_policy,
)
from .csvlog import StepCSVWriter
from .diagnosis import Finding, diagnose, format_findings
from .forensics import FORENSICS_COLUMNS, StepForensics
from .monitors import ClipRatioMonitor, RollingRate, SkipRateExceeded, SkipRateMonitor, SkipRateWarning
from .norms import clip_global_l2_norm, has_non_finite_grad, total_norm
from .records import CANONICAL_COLUMNS, SKIP_REASONS, SkipLog, StepLog
from .scaling import HysteresisScaler, LossScaleFloorWarning, LossScaler
from .step import DTYPES, AmpTrainState, parse_dtype

__all__ = [
    "AdaptiveGradClip",
    "AmpTrainState",
    "CANONICAL_COLUMNS",
    "CLIP_MODES",
    "CalibratedClip",
    "CalibrationError",
    "CalibrationSummary",
    "CalibrationWindows",
    "ClipPolicy",
    "ClipRatioMonitor",
    "DPSGDClip",
    "DTYPES",
    "FORENSICS_COLUMNS",
    "Finding",
    "GlobalNormClip",
    "HysteresisScaler",
    "LossScaleFloorWarning",
    "LossScaler",
    "NoClip",
    "NormCalibrator",
    "PerGroupClip",
    "QuantileClip",
    "RollingRate",
    "SKIP_REASONS",
    "SkipLog",
    "SkipRateExceeded",
    "SkipRateMonitor",
    "SkipRateWarning",
    "StagedNormClip",
    "StepCSVWriter",
    "StepForensics",
    "StepLog",
    "UpdateNormClip",
    "ValueClip",
    "ZScoreClip",
    "clip_global_l2_norm",
    "clip_mode_options",
    "diagnose",
    "dp_sgd_grads",
    "format_findings",
    "has_non_finite_grad",
    "make_clip_policy",
    "parse_dtype",
    "total_norm",
]
