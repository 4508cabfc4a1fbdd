"""The one dispatch point over the closed set of clipping modes ``CLIP_MODES``.

A policy is a small object (``clip.base.ClipPolicy``); state that must survive a checkpoint
goes through ``state_dict()`` / ``load_state_dict()``. Every constructor option is a plain
value (float, int, str, bool, list, dict) with a default, so the app can expose them as
config keys; run-time objects (``CONTEXT_ARGS``) are keyword-only.

==============  ==============================================================  ==========
mode            what is bounded                                                 state
==============  ==============================================================  ==========
``norm``        global L2 norm of the gradient at a fixed τ (a projection)      none
``none``        nothing (norms are still measured and recorded)                 none
``value``       every gradient coordinate to ``[-clip_value, clip_value]``      none
``staged``      global L2 norm at a τ that depends on the step range            none
``per_group``   each param group's / name pattern's gradient norm at its τ_j    none
``agc``         each unit's gradient norm relative to its weight norm (NFNets)  none
``update``      the optimizer's data update Δθ (decoupled weight decay apart)   none
``quantile``    global norm at a quantile of recent norms (AutoClip)            history
``zscore``      global norm at an EMA z-score rule (ZClip)                      EMA μ, σ²
``dpsgd``       every example's gradient norm, plus Gaussian noise (DP-SGD)     CPU RNG
``calibrated``  global L2 norm at τ = Quantile_q of a calibration window        window, τ
==============  ==============================================================  ==========
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..spelling import Spelling
from .adaptive import QuantileClip, ZScoreClip
from .agc import AdaptiveGradClip
from .base import ClipPolicy, NamedParams
from .calibrated import CalibratedClip
from .dpsgd import DPSGDClip
from .fixed import GlobalNormClip, NoClip, PerGroupClip, StagedNormClip, ValueClip
from .update import UpdateNormClip

__all__ = ["CLIP_MODES", "CONTEXT_ARGS", "clip_mode_options", "make_clip_policy", "whole_param_modes"]


CLIP_MODES: dict[str, type[ClipPolicy]] = {
    "norm": GlobalNormClip,
    "none": NoClip,
    "value": ValueClip,
    "staged": StagedNormClip,
    "per_group": PerGroupClip,
    "agc": AdaptiveGradClip,
    "update": UpdateNormClip,
    "quantile": QuantileClip,
    "zscore": ZScoreClip,
    "dpsgd": DPSGDClip,
    "calibrated": CalibratedClip,
}

#: Constructor arguments that are run-time objects, not config options: passed by the caller
#: to every mode and forwarded only to the policies that take them.
CONTEXT_ARGS = ("named_params", "optimizer", "total_steps", "spelling")


def clip_mode_options(mode: str) -> dict[str, Any]:
    """The config options of ``mode`` with their defaults (context objects excluded)."""
    cls = _mode_class(mode)
    sig = inspect.signature(cls.__init__)
    return {
        name: _plain(p.default)
        for name, p in sig.parameters.items()
        if name != "self" and name not in CONTEXT_ARGS and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def _plain(value: Any) -> Any:
    """Tuples (immutable defaults) as lists, so defaults read like YAML values."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _mode_class(mode: str) -> type[ClipPolicy]:
    try:
        return CLIP_MODES[mode]
    except (KeyError, TypeError):
        raise ValueError(f"clip mode {mode!r} is not one of {', '.join(CLIP_MODES)}") from None


def make_clip_policy(
    mode: str = "norm",
    *,
    named_params: NamedParams | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    total_steps: int | None = None,
    spelling: Spelling | None = None,
    **options: Any,
) -> ClipPolicy:
    """Build the policy for ``mode`` with its options.

    Args:
        mode: one of ``CLIP_MODES``.
        named_params: ``model`` or ``model.named_parameters()``; forwarded to the modes that
            select parameters by name (``per_group`` patterns, ``agc`` exclusions), ignored by
            the others, so a caller can always pass it.
        optimizer: the optimizer; forwarded to ``per_group`` (τ by param-group index),
            ignored by the others.
        total_steps: the run length; forwarded to ``calibrated`` (a window cut by the end of
            the run), ignored by the others.
        spelling: how ``calibrated``'s advice names the settings (``clipamp_engine.spelling``; ``None``: the
            engine's keywords), ignored by the others.
        **options: the mode's own options (see ``clip_mode_options(mode)``).

    Raises:
        ValueError: unknown mode (lists the modes), unknown option (lists the mode's
            options), or an invalid option value (names it and the valid range).
    """
    cls = _mode_class(mode)
    valid = clip_mode_options(mode)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"clip mode {mode!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(valid) or '(none)'}"
        )
    accepted = inspect.signature(cls.__init__).parameters
    given = {"named_params": named_params, "optimizer": optimizer, "total_steps": total_steps, "spelling": spelling}
    context = {k: v for k, v in given.items() if k in accepted and v is not None}
    try:
        return cls(**options, **context)
    except TypeError as e:
        raise ValueError(f"clip mode {mode!r}: {e}") from None


def whole_param_modes() -> list[str]:
    """The clip modes whose policies need whole (unsharded) parameters."""
    return [mode for mode, cls in CLIP_MODES.items() if cls.needs_whole_params]
