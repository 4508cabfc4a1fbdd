"""Every text of the calibration that names a setting, rendered in one ``Spelling``: each branch of the band
check's next action, the window placements' reasons, the short window's warning, the refused check.

Shared by the engine's test and the front ends' (``tests/app/integrations/test_advice_spelling.py``): each
asserts that a front end's texts name only settings its user can set."""

from __future__ import annotations

import re

import pytest

from clipamp_engine.band import check_band
from clipamp_engine.calibration import quantile_ci, short_window_warning
from clipamp_engine.clip.calibrated import CalibratedClip
from clipamp_engine.placement import StartDetector, fixed_placement
from clipamp_engine.spelling import Spelling

BAND = (0.01, 0.05)


def _actions(sp: Spelling) -> dict[str, str]:
    """``check_band``'s next action in each of its branches (numbers as in ``tests/engine/test_band.py``)."""
    few = dict(predicted=0.022, clipped=0, steps=100, band=BAND, spelling=sp)
    fell = dict(predicted=0.05, clipped=0, steps=200, band=BAND, spelling=sp)
    return {
        "inside": check_band(2.0, 0.022, 3, 140, BAND, spelling=sp).action,
        "few: the run ended": check_band(2.0, **few).action,
        "few: validate ended them": check_band(2.0, **few, held_out_by="validate").action,
        "few: validate and the run": check_band(2.0, **few, held_out_by="validate", room=100, validate=100).action,
        "few: the run, capped": check_band(2.0, **few, room=100, validate=150).action,
        "few: the next window": check_band(2.0, **few, held_out_by="every").action,
        "outside: the quantile": check_band(1.0, 0.10, 11, 100, BAND, spelling=sp, quantile=0.9, norms=10).action,
        "outside: short": check_band(1.4, 0.1, 40, 390, BAND, spelling=sp, quantile=0.97, norms=10).action,
        "outside: ties": check_band(1.2, 0.0, 0, 200, BAND, spelling=sp, quantile=0.97, norms=200).action,
        "rose": check_band(1.0, 0.02, 30, 100, BAND, spelling=sp).action,
        "fell": check_band(4.0, **fell).action,
        "fell, placed by auto": check_band(4.0, **fell, placed_auto=True).action,
    }


def _refused(sp: Spelling) -> str:
    with pytest.raises(ValueError) as e:
        check_band(2.0, 0.02, 0, 0, BAND, spelling=sp)
    return str(e.value)


def _deadline(sp: Spelling) -> str:
    detector = StartDetector(latest=3, spelling=sp)
    for step in (1, 2):
        placement = detector.update(step, 1e-3 * step, 1.0)
    return placement.reason


def advice(sp: Spelling) -> dict[str, str]:
    """Every text that names a setting, by branch, in ``sp``."""
    return {
        **_actions(sp),
        "no validation step": _refused(sp),
        "placed at N": fixed_placement(5, sp).reason,
        "placed at 0": fixed_placement(0, sp).reason,
        "placed by the deadline": _deadline(sp),
        "no room to wait": CalibratedClip(window=20, start="auto", total_steps=40, spelling=sp).placement.reason,
        "short window": short_window_warning(quantile_ci([float(x) for x in range(1, 101)], 0.99), 1.0, sp),
    }


#: ``name=`` in a text: a keyword argument (``start=N``, ``max_norm=2``, ``every=``).
KEYWORD = re.compile(r"(?<![\w.\-])([A-Za-z_]\w*)=")
#: The app's spelling, where a front end is not the app: ``calibrate.start``, ``clip.max_norm``, "raise steps".
APP_WORDS = re.compile(r"\bcalibrate\.|\bclip\.max_norm|\braise steps\b|\bsteps=")


def keywords(text: str) -> set[str]:
    return set(KEYWORD.findall(text))
