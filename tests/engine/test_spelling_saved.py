"""A calibration state keeps the window placement's reason as a code and its figures, never rendered: loaded by
another front end (another ``Spelling``), or by a later wording, it reads as that one writes it; a state saved with
the reason rendered still loads and shows its text."""

from __future__ import annotations

import json

import pytest

from clipamp_engine.clip.calibrated import CalibratedClip
from clipamp_engine.placement import StartDetector
from clipamp_engine.spelling import ENGINE, Spelling
from tests.engine.test_spelling import FLAGS


def _saved(state: dict) -> dict:
    """``state`` as a checkpoint gives it back (an integration's is JSON)."""
    return json.loads(json.dumps(state))


@pytest.mark.parametrize(
    "options",
    [
        {"window": 5, "start": 3},  # start=3: the window starts at step 4
        {"window": 20, "start": "auto", "total_steps": 40},  # no room to wait: raise total_steps …
    ],
    ids=["fixed", "no room"],
)
def test_a_placement_saved_under_one_spelling_reads_in_the_loading_front_ends(options):
    saved = _saved(CalibratedClip(**options, spelling=ENGINE).state_dict())
    loaded = CalibratedClip(**options, spelling=FLAGS)
    loaded.load_state_dict(saved)
    assert loaded.placement.reason == CalibratedClip(**options, spelling=FLAGS).placement.reason
    assert "--start" in loaded.placement.reason and "start=" not in loaded.placement.reason


def test_a_detectors_deadline_saved_under_one_spelling_reads_in_the_loading_front_ends():
    def placed(spelling: Spelling) -> StartDetector:
        detector = StartDetector(latest=3, spelling=spelling)
        for step in (1, 2):
            detector.update(step, 1e-3 * step, 1.0)
        return detector

    loaded = StartDetector(latest=3, spelling=FLAGS)
    loaded.load_state_dict(_saved(placed(ENGINE).state_dict()))
    assert loaded.placement == placed(FLAGS).placement
    assert loaded.placement.reason == placed(FLAGS).placement.reason
    assert loaded.placement.reason.endswith("(use a longer run or --start N)")


def test_a_state_saved_with_the_reason_rendered_still_loads_and_shows_it():
    state = _saved(CalibratedClip(window=5, start=3).state_dict())
    old_text = "start=3: the window starts at step 4"
    state["placement"] = {k: v for k, v in state["placement"].items() if k != "why"} | {"reason": old_text}
    loaded = CalibratedClip(window=5, start=3, spelling=FLAGS)
    loaded.load_state_dict(state)
    assert (loaded.placement.start, loaded.placement.rule, loaded.placement.reason) == (4, "fixed", old_text)


def _closed(spelling: Spelling) -> CalibratedClip:
    """A policy whose window (steps 4-8) closed too short to bound its Quantile_0.99: its summary warns."""
    from clipamp_engine.records import StepLog

    policy = CalibratedClip(window=5, start=3, quantile=0.99, spelling=spelling)
    for step in range(1, 12):
        norm = 1.0 + step % 3
        policy.observe(StepLog(step=step, lr=1e-3, grad_l2_pre_clip=norm, grad_l2_post_clip=norm, loss=1.0,
                               scaler_scale=None, clipped=False))  # fmt: skip
    return policy


def test_a_windows_warning_saved_under_one_spelling_reads_in_the_loading_front_ends():
    saved = _saved(_closed(ENGINE).state_dict())
    assert "lengthen window=N to ≥" in _closed(ENGINE).summaries[0].warnings[0]
    loaded = CalibratedClip(window=5, start=3, quantile=0.99, spelling=FLAGS)
    loaded.load_state_dict(saved)
    [summary] = loaded.summaries
    assert summary.warnings == _closed(FLAGS).summaries[0].warnings
    assert "lengthen --window to ≥" in summary.warnings[0] and "use a lower --quantile" in summary.warnings[0]


def test_a_windows_warning_saved_rendered_still_loads_and_shows_it():
    state = _saved(_closed(ENGINE).state_dict())
    [old] = _closed(ENGINE).summaries[0].warnings
    state["summaries"] = [
        {k: v for k, v in s.items() if k != "notes"} | {"warnings": [old]} for s in state["summaries"]
    ]
    loaded = CalibratedClip(window=5, start=3, quantile=0.99, spelling=FLAGS)
    loaded.load_state_dict(state)
    assert loaded.summaries[0].warnings == [old]
