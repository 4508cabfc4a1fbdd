"""A run that stops before the ``total_steps`` its windows were placed for says so, with what the stop cut: the
held-out steps its check covered against those the full run checks, or a window summarised part way."""

from __future__ import annotations

import numpy as np
import pytest

from clipamp_engine.clip.calibrated import CalibratedClip
from clipamp_engine.records import StepLog
from clipamp_engine.spelling import Spelling

TOTAL = 100


def run(stop: int, total_steps: int | None = TOTAL, spelling: Spelling | None = None, **options) -> CalibratedClip:
    """``stop`` steps of steady log-normal norms, each clipped at the τ in force, as ``AmpTrainState`` feeds them;
    then ``close_early``, as an end of run does."""
    clip = CalibratedClip(total_steps=total_steps, **options, **({"spelling": spelling} if spelling else {}))
    norms = np.random.default_rng(0).lognormal(0, 0.3, stop)
    for step, norm in enumerate(norms.tolist(), start=1):
        tau = clip.threshold
        post = norm if tau is None else min(norm, tau)
        clip.observe(StepLog(step, 1e-3, norm, post, loss=1.0, scaler_scale=1.0, clipped=post < norm, max_norm=tau))
    clip.close_early()
    return clip


@pytest.mark.parametrize(
    "stop,options,opened",
    [
        (60, {"window": 20}, None),  # the check runs to the run's end: 80 steps
        (45, {"window": 20, "every": 30}, 31),  # the first window's check runs to the second window's end
        (70, {"window": 20, "every": 30}, 61),  # the second's to the third's
        (30, {"window": 20, "validate": 30}, None),  # validate=30 planned, the stop left 10
    ],
)
def test_a_stop_says_how_many_held_out_steps_the_check_covered_of_the_full_runs(stop, options, opened):
    """The figures are the control's: the full run's check covers the planned held-out steps."""
    full, cut = run(TOTAL, **options), run(stop, **options)
    i = len(cut.summaries) - 1
    window, check, planned = cut.summaries[i], cut.checks()[i], full.checks()[i]
    assert window.recommended_max_norm == full.summaries[i].recommended_max_norm
    assert check.steps < planned.steps == cut.planned_held_out(i) == full.planned_held_out(i)
    line = cut.stopped_early(stop)
    assert line.startswith(
        f"the run stopped at step {stop} of total_steps={TOTAL}: the check of τ={window.recommended_max_norm:.4g} "
        f"covered {check.steps} held-out steps instead of {planned.steps}"
    ), line
    assert full.stopped_early(TOTAL) is None
    never = f"; the window from step {opened} never closed"  # a later window the stop cut: its τ never adopted
    assert line.endswith(never) == (opened is not None), line


def test_a_stop_inside_the_first_window_says_how_much_of_it_tau_is_from():
    cut = run(15, window=20)
    [window] = cut.summaries
    assert cut.checks() == [None]
    assert cut.stopped_early(15) == (
        f"the run stopped at step 15 of total_steps={TOTAL}, inside its window (steps 1–20): "
        f"τ={window.recommended_max_norm:.4g} is from 15 of its 20 steps, and no held-out step checked it"
    )


def test_a_stop_before_the_first_window_and_a_run_of_unknown_length():
    assert run(5, window=20, start=10).stopped_early(5) == (
        f"the run stopped at step 5 of total_steps={TOTAL}, before its first 20-step window (steps 11–30) closed: "
        "no τ was recommended or checked"
    )
    assert run(30, total_steps=None, window=20).stopped_early(30) is None  # no length: nothing planned
    checked = run(30, window=20, validate=10)  # its 10 held-out steps all taken before the stop
    assert checked.stopped_early(30).endswith("covered its 10 held-out steps")


def test_a_hosts_length_is_said_as_a_step_count():
    """A front end whose length setting lengthens the run (``max_steps``, the app's ``steps``, a fit of
    ``max_epochs``) counts the steps, not a setting's value."""
    host = Spelling(length="max_epochs", lengthen="raise")
    assert run(60, spelling=host, window=20).stopped_early(60).startswith("the run stopped at step 60 of 100 steps:")
