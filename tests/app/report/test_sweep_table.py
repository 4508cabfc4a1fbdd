"""The sweep's terminal table marks a Pareto front only for a study that has one."""

from __future__ import annotations

import pandas as pd
import pytest
from rich.console import Console

from sweep.report.sweep import sweep_table


@pytest.mark.parametrize("pareto", [True, False])
def test_the_pareto_mark_and_legend_belong_to_two_objective_studies(pareto):
    df = pd.DataFrame(
        {"trial": [0, 1], "state": ["COMPLETE", "COMPLETE"], "eval_loss": [2.5, 2.6], "clip_ratio": [0.03, 0.3]}
    )
    df["pareto"], df["in_band"] = [True, True], [True, False]
    console = Console(record=True, width=200)
    console.print(sweep_table(df, None, "Study s", pareto=pareto))
    text = console.export_text()
    rows = [line for line in text.splitlines() if line.strip().startswith(("│ 0", "│ 1"))]
    marks = [[cell.strip() for cell in line.strip().strip("│").split("│")][-1] for line in rows]
    assert marks == (["PB", "P"] if pareto else ["B", ""])
    assert ("P Pareto front" in text) is pareto
