"""clipamp engine: safe mixed-precision steps with global-norm clipping and per-step forensics.

Depends on torch only. See ``AmpTrainState`` for the step, ``clip_global_l2_norm`` for the clip.
"""

from .calibration import CalibrationSummary, NormCalibrator
from .clipping import CLIP_MODES, ClipPolicy, GlobalNormClip, NoClip, clip_mode_options, make_clip_policy
from .diagnosis import Finding, diagnose, format_findings
from .dpsgd import DPSGDClip, dp_sgd_grads
from .forensics import FORENSICS_COLUMNS, StepForensics
from .policies import (AdaptiveGradClip, PerGroupClip, QuantileClip, StagedNormClip, UpdateNormClip, ValueClip,
                       ZScoreClip)
from .csvlog import StepCSVWriter
from .monitors import ClipRatioMonitor, RollingRate, SkipRateExceeded, SkipRateMonitor, SkipRateWarning
from .norms import clip_global_l2_norm, has_non_finite_grad, total_norm
from .records import CANONICAL_COLUMNS, SKIP_REASONS, SkipLog, StepLog
from .scaling import HysteresisScaler, LossScaleFloorWarning, LossScaler
from .state import DTYPES, AmpTrainState, parse_dtype

__all__ = [
    "AdaptiveGradClip", "CalibrationSummary", "DPSGDClip", "FORENSICS_COLUMNS", "Finding", "HysteresisScaler",
    "LossScaleFloorWarning", "NormCalibrator", "PerGroupClip", "QuantileClip", "StagedNormClip", "StepForensics",
    "UpdateNormClip", "ValueClip", "ZScoreClip", "clip_mode_options", "diagnose", "dp_sgd_grads", "format_findings",
    "AmpTrainState", "CANONICAL_COLUMNS", "CLIP_MODES", "ClipPolicy", "ClipRatioMonitor", "DTYPES",
    "GlobalNormClip", "LossScaler", "NoClip", "RollingRate", "SKIP_REASONS", "SkipLog",
    "SkipRateExceeded", "SkipRateMonitor", "SkipRateWarning", "StepCSVWriter", "StepLog",
    "clip_global_l2_norm", "has_non_finite_grad", "make_clip_policy", "parse_dtype", "total_norm",
]
