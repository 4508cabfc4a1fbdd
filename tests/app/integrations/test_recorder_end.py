"""``StepRecorder.end`` of a run that ended before its first calibration window held two norms: one line says
why there is no recommendation and what places a window, rather than nothing at all."""

from __future__ import annotations

import pytest
import torch

from sweep.integrations.recorder import StepRecorder

STEPS, WINDOW = 30, 10


def run(tmp_path, total_steps=None, **calibrate) -> StepRecorder:
    """``STEPS`` steps whose norms fall 10% a step (they never settle), at a constant LR."""
    rec = StepRecorder(calibrate={"window": WINDOW, **calibrate}, tracking=None, csv_path=tmp_path / "steps.csv")
    rec.begin(total_steps=total_steps, user_tau=None, default_csv=tmp_path / "unused.csv")
    p = torch.nn.Parameter(torch.zeros(4))
    for step in range(1, STEPS + 1):
        p.grad = torch.full((4,), 0.9**step)
        rec.record(step, 1e-3, rec.measure([p], step, host_clips=False))
    rec.end(STEPS)
    return rec


@pytest.mark.parametrize(
    "total_steps,calibrate,why",
    [
        (
            None,
            {},
            "the norms had not settled and the run's length is unknown, so start='auto' waits on: give its length "
            "(total_steps=N) to place the window within it, or start=N",
        ),
        (
            100,
            {},
            f"the norms had not settled; the window would have started by step {100 - 2 * WINDOW + 1} "
            "(the run ended before)",
        ),
        (None, {"start": 40}, f"the {WINDOW}-step window starts at step 41"),
    ],
)
def test_a_run_without_a_window_says_why(tmp_path, capsys, total_steps, calibrate, why):
    rec = run(tmp_path, total_steps, **calibrate)
    assert rec.summary is None and rec.policy.phase(STEPS) == "settle"
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "no calibration window" in line] == [
        f"clipamp: no calibration window by step {STEPS}: {why}: no recommendation"
    ]


def test_a_window_cut_short_is_still_summarised_without_that_line(tmp_path, capsys):
    rec = run(tmp_path, start=25)
    assert (rec.summary.start_step, rec.summary.end_step) == (26, STEPS)
    assert "no calibration window" not in capsys.readouterr().out


def test_the_first_window_says_where_it_lies_and_why_as_recommend_does_on_its_csv(tmp_path, capsys):
    """A run whose norms never settle, of known length: the window is placed by the run's end, and the live
    line says so in the words ``python -m sweep.recommend`` uses for the same CSV, each naming the settings as
    its own user writes them (the recorder's keywords, ``start=N``; the command's flags, ``--start N``): the
    same line once the settings are spelled alike."""
    from sweep.recommend.cli import main
    from sweep.recommend.replay import RECOMMEND_SPELLING

    rec = run(tmp_path, total_steps=STEPS)
    assert (rec.summary.start_step, rec.summary.end_step) == (STEPS - 2 * WINDOW + 1, STEPS - WINDOW)
    live = [line for line in capsys.readouterr().out.splitlines() if "window placement (" in line]
    assert len(live) == 1 and live[0].startswith("clipamp: window placement (start='auto'): ")
    assert main([str(tmp_path / "steps.csv"), "--window", str(WINDOW)]) == 0
    offline = [line for line in capsys.readouterr().out.splitlines() if line.startswith("window placement")]
    assert len(offline) == 1 and offline[0].startswith("window placement (--start auto): ")
    said = live[0].split("): ", 1)[1]
    assert "start=N" in said  # the deadline's advice: what places the window otherwise
    own_loop = "lengthen your loop to N steps and pass total_steps=N, or start=N"  # the length only tells the policy
    assert offline[0].split("): ", 1)[1] == said.replace(
        own_loop, f"use a longer run or {RECOMMEND_SPELLING.set('start', 'N')}"
    )
