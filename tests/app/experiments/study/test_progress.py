"""The sweep's display outside a terminal: each trial's line comes before the count it completes."""

from __future__ import annotations

import io

from rich.console import Console

from sweep.experiments.study.progress import TrialProgress


def test_the_last_trials_line_precedes_the_closing_count():
    out = io.StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    with TrialProgress(console, enabled=True, total=2, best=lambda: "#0") as ui:
        for n in range(2):
            ui.start_trial(n, "bf16", 1.0, steps=3)
            ui.step(3)
            ui.end_trial(n, "COMPLETE", "eval 2.5")
    lines = [line for line in out.getvalue().splitlines() if line.startswith(("trial ", "trials "))]
    last_trial = max(i for i, line in enumerate(lines) if line.startswith("trial   1 COMPLETE"))
    closing = next(i for i, line in enumerate(lines) if line.startswith("trials") and "2/2" in line)
    assert last_trial < closing, lines
