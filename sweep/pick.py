"""The sweep's trials table, its Pareto front and the pick rule: pure functions over pandas frames.

They sit below both the sweep (``sweep.experiments.study``) and the reports (``sweep.report``),
which read the same tables, from Optuna and from MLflow. The rule, in both study modes, is
``PICK_RULES``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

PICK_RULES = """\
1. among COMPLETE trials with a finite eval loss whose clipping ratio lies in the target band
   ``study.target_clip=[low, high]``: the lowest eval loss (ties: lower clipping ratio, then
   the earlier trial) — rule ``in-band-min-loss``;
2. if none lies in the band: the trial whose clipping ratio is nearest to the band (ties: lower
   eval loss) — rule ``nearest-band``;
3. no COMPLETE trial: no pick (rule ``none``). Pruned and failed trials are never picked."""

TABLE_COLUMNS = (
    "trial",
    "state",
    "dtype",
    "max_norm",
    "eval_loss",
    "clip_ratio",
    "skip_ratio",
    "final_loss",
    "steps_run",
    "wall_s",
    "in_band",
    "pareto",
    "run_id",
    "parent_run_id",
)


@dataclass(frozen=True)
class Pick:
    """The chosen configuration and the rule that chose it."""

    trial: int
    dtype: str
    max_norm: float
    eval_loss: float
    clip_ratio: float
    rule: str  # in-band-min-loss | nearest-band
    reason: str

    def override(self) -> str:
        return f"amp.dtype={self.dtype} clip.max_norm={self.max_norm:.4g}"


def pareto_mask(losses: list[float], ratios: list[float]) -> list[bool]:
    """True where no other point is at least as good on both objectives and better on one."""
    pts = list(zip(losses, ratios))
    return [not any(l2 <= l1 and r2 <= r1 and (l2 < l1 or r2 < r1) for l2, r2 in pts) for l1, r1 in pts]


def completed(df: pd.DataFrame) -> pd.DataFrame:
    """The COMPLETE trials with a finite eval loss and clipping ratio: the candidates of the pick."""
    ok = (
        (df["state"] == "COMPLETE")
        & np.isfinite(df["eval_loss"].astype(float))
        & np.isfinite(df["clip_ratio"].astype(float))
    )
    return df[ok]


def flag_table(df: pd.DataFrame, band: tuple[float, float]) -> pd.DataFrame:
    """Add ``in_band`` (COMPLETE, clip ratio in band) and ``pareto`` (non-dominated COMPLETE) columns."""
    df = df.copy()
    done = completed(df)
    df["in_band"] = False
    df.loc[done.index, "in_band"] = (done["clip_ratio"] >= band[0]) & (done["clip_ratio"] <= band[1])
    df["pareto"] = False
    if len(done):
        df.loc[done.index, "pareto"] = pareto_mask(done["eval_loss"].tolist(), done["clip_ratio"].tolist())
    return df[[c for c in TABLE_COLUMNS if c in df.columns]]


def pick_trial(df: pd.DataFrame, band: tuple[float, float]) -> Pick | None:
    """The configuration to use (``PICK_RULES``); ``df`` needs trial, state, dtype, max_norm, eval_loss,
    clip_ratio."""
    low, high = band
    done = completed(df)
    if done.empty:
        return None
    ratio = done["clip_ratio"].astype(float)
    in_band = done[(ratio >= low) & (ratio <= high)]
    if len(in_band):
        best = in_band.sort_values(["eval_loss", "clip_ratio", "trial"]).iloc[0]
        rule = "in-band-min-loss"
        reason = (
            f"lowest eval loss among the {len(in_band)} of {len(done)} completed trials whose clipping "
            f"ratio is in [{low:g}, {high:g}]"
        )
    else:
        dist = (low - ratio).clip(lower=0) + (ratio - high).clip(lower=0)
        best = done.assign(_dist=dist).sort_values(["_dist", "eval_loss", "trial"]).iloc[0]
        rule = "nearest-band"
        reason = (
            f"none of the {len(done)} completed trials clips within [{low:g}, {high:g}]; "
            f"the one whose clipping ratio is nearest to the band (ties: lower eval loss)"
        )
    return Pick(
        int(best["trial"]),
        str(best["dtype"]),
        float(best["max_norm"]),
        float(best["eval_loss"]),
        float(best["clip_ratio"]),
        rule,
        reason,
    )
