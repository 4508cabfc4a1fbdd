"""Outside a terminal (nohup, CI, Slurm) progress is plain lines that arrive while the run goes on."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console

from sweep.run.loop import ProgressLines, progress_bar
from tests.app.helpers import TINY


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=200), out


def test_a_terminal_keeps_the_live_bar_and_a_pipe_gets_lines():
    assert not isinstance(progress_bar(True, console=_console(True)[0]), ProgressLines)
    assert isinstance(progress_bar(True, console=_console(False)[0]), ProgressLines)
    assert not isinstance(progress_bar(False, console=_console(False)[0]), ProgressLines)  # progress=false: silent


def test_lines_every_n_steps_at_marks_and_at_the_end():
    console, out = _console(False)
    with progress_bar(True, console=console, every=50) as bar:
        task = bar.add_task("run-a", total=120, info="")
        for step in range(1, 121):
            bar.update(task, completed=step, line=step == 31, info=f"loss {1 / step:.3f}")
    lines = [ln.split("  ") for ln in out.getvalue().splitlines()]
    assert [(ln[0], ln[1], ln[3]) for ln in lines] == [
        ("run-a", "31/120", "loss 0.032"),
        ("run-a", "50/120", "loss 0.020"),
        ("run-a", "100/120", "loss 0.010"),
        ("run-a", "120/120", "loss 0.008"),
    ]
    assert all(ln[2].endswith("s") and float(ln[2][:-1]) >= 0 for ln in lines)


def test_a_reset_task_starts_counting_again():
    console, out = _console(False)
    bar = progress_bar(True, console=console, every=5)
    task = bar.add_task("trial 1", total=5, info="")
    bar.update(task, completed=5)
    bar.reset(task, total=5, description="trial 2", info="")
    bar.update(task, completed=5)
    assert [ln.split("  ")[:2] for ln in out.getvalue().splitlines()] == [["trial 1", "5/5"], ["trial 2", "5/5"]]


@pytest.mark.slow
def test_a_piped_run_prints_progress_while_it_trains(tmp_path, store):  # the run's store, migrated already
    """stdout is a pipe (as under nohup): the step-40 line is read while the process still runs, and the
    first step after the calibration window (31, after the window 1–30) gets its own line with the τ set
    there (validate: the held-out steps at τ)."""
    args = [
        *[a for a in TINY if a != "progress=false"],
        "+experiment=calibrate",
        "steps=200",
        "progress_every=40",
        "calibrate.start=0",
        "calibrate.window=30",
        "calibrate.validate=0",
        "tracking.flush_every=1",
    ]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}  # the run's own store in tmp_path
    proc = subprocess.Popen(
        [sys.executable, "-m", "sweep", *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen, alive_at_40 = [], None
    for line in proc.stdout:
        seen.append(line.rstrip("\n"))
        if " 40/200 " in line:
            alive_at_40 = proc.poll() is None
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, err
    progress = [ln.split("  ") for ln in seen if ln.startswith("calibrate-") and "/200" in ln]
    marks = [p[1] for p in progress]
    assert marks == ["1/200", "31/200", "40/200", "80/200", "120/200", "160/200", "200/200"], seen
    assert alive_at_40 is True  # the line came while training went on, not at the end
    assert (
        progress[0][3] == "calibrate"
        and progress[1][3] == "validate"
        and progress[1][-1].startswith("τ ")
        and progress[0][-1] == "τ none"  # not clipped inside the window
    )


def test_a_task_that_starts_part_way_counts_the_runs_steps():
    """A run resumed after step 108 of 200: its lines say 150/200 and 200/200, not 42/92 and 92/92."""
    console, out = _console(False)
    with progress_bar(True, console=console, every=50) as bar:
        task = bar.add_task("run-a", total=200, completed=108, info="")
        for step in range(109, 201):
            bar.update(task, completed=step)
    assert [ln.split("  ")[1] for ln in out.getvalue().splitlines()] == ["150/200", "200/200"]
