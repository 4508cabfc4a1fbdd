"""How the app spells the settings the calibration's advice names (``clipamp_engine.spelling``)."""

from __future__ import annotations

from clipamp_engine.spelling import Spelling

#: The app's spelling of the settings the calibration's advice names: its config overrides (``clip.max_norm=``,
#: ``steps=``, ``calibrate.*``), as ``python -m sweep`` takes them.
APP_SPELLING = Spelling(
    threshold="clip.max_norm",
    length="steps",
    **{k: f"calibrate.{k}" for k in ("start", "window", "every", "validate", "quantile")},
    named="{}",
    auto="auto",
    band="null",
    lengthen="raise",
)
