"""What a sweep invocation did, and the study's trials as a table (from Optuna's user attributes)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from sweep.pick import TABLE_COLUMNS, Pick, flag_table


@dataclass
class SweepResult:
    """What one invocation did, and the study as it stands after it."""

    study_name: str
    storage: str  # redacted
    mode: str
    parent_run_id: str
    trials: pd.DataFrame  # every trial of the study (earlier invocations too), TABLE_COLUMNS
    pick: Pick | None
    trials_run: int  # this invocation
    pruned: int  # this invocation
    failed: int  # this invocation
    steps_run: int  # optimizer steps the trials of this invocation actually ran
    steps_budget: int  # trials_run × steps: what the same trials would have run unpruned
    seconds_saved_est: float  # Σ over pruned trials of (steps not run) × (their own s/step in the loop)
    prune_overhead_s: float  # time in trial.report / trial.should_prune
    wall_s: float
    anchor: dict[str, float] | None = None
    band: tuple[float, float] = (0.0, 1.0)

    @property
    def steps_saved(self) -> int:
        return self.steps_budget - self.steps_run

    @property
    def pruned_share(self) -> float:
        return self.pruned / self.trials_run if self.trials_run else 0.0


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


#: User attr ``outcome`` of a trial a signal stopped, or whose worker died: FAIL in Optuna (no other state fits),
#: KILLED in the tables.
KILLED_OUTCOME = "killed"


def trials_table(study, band: tuple[float, float]) -> pd.DataFrame:
    """Every trial of ``study`` (user attrs hold the figures) with ``in_band`` and ``pareto`` flags; a trial a
    signal stopped is KILLED, as its MLflow run (and ``sweep.report``) says."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        killed = t.state.name == "FAIL" and ua.get("outcome") == KILLED_OUTCOME
        row = {
            "trial": t.number,
            "state": "KILLED" if killed else t.state.name,
            "dtype": t.params.get("dtype", ""),
            "max_norm": t.params.get("max_norm", math.nan),
        }
        for k in ("eval_loss", "clip_ratio", "skip_ratio", "final_loss", "wall_s"):
            v = ua.get(k)
            row[k] = float(v) if _finite(v) else math.nan
        row["steps_run"] = int(ua.get("steps_run") or 0)
        row["run_id"] = ua.get("run_id", "")
        row["parent_run_id"] = ua.get("parent_run_id", "")
        rows.append(row)
    df = pd.DataFrame(rows, columns=[c for c in TABLE_COLUMNS if c not in ("in_band", "pareto")])
    return flag_table(df, band)
