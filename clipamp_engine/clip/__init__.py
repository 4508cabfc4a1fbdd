"""Clipping policies: how gradients are clipped once their pre-clip global norm is known.

``make_clip_policy(mode, **options)`` (``registry``) builds one of ``CLIP_MODES``:
``fixed`` (norm, none, value, staged, per_group), ``agc``, ``update``, ``adaptive``
(quantile, zscore), ``calibrated`` and ``dpsgd``; ``base.ClipPolicy`` is their interface, and
``base.GlobalCoefficientClip`` a base for policies whose clip is one global coefficient. The fused
path runs the policies that declare ``single_coefficient`` (``CalibratedClip`` declares it without
that base).
"""

from .adaptive import QuantileClip, ZScoreClip
from .agc import AdaptiveGradClip, unitwise_norm
from .base import ClipPolicy, GlobalCoefficientClip
from .calibrated import CalibratedClip
from .dpsgd import DPSGDClip, dp_sgd_grads
from .fixed import GlobalNormClip, NoClip, PerGroupClip, StagedNormClip, ValueClip
from .registry import CLIP_MODES, clip_mode_options, make_clip_policy
from .update import UpdateNormClip

__all__ = [
    "CLIP_MODES",
    "AdaptiveGradClip",
    "CalibratedClip",
    "ClipPolicy",
    "DPSGDClip",
    "GlobalCoefficientClip",
    "GlobalNormClip",
    "NoClip",
    "PerGroupClip",
    "QuantileClip",
    "StagedNormClip",
    "UpdateNormClip",
    "ValueClip",
    "ZScoreClip",
    "clip_mode_options",
    "dp_sgd_grads",
    "make_clip_policy",
    "unitwise_norm",
]
