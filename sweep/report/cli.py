"""``python -m sweep.report [--tracking-uri URI] [--experiment NAME] [--out report.csv|report.md]``.

Reads every run of the experiment into pandas and prints, per run: task, dtype, clip mode,
quantiles, recommended τ, clipping and skip ratios, losses (the table to pick a threshold from);
then, per sweep study (``+experiment=sweep``), its trials and the configuration the pick rule chooses.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console

from sweep.errors import UserError, fail
from sweep.pick import flag_table, pick_trial
from sweep.report.format import frame_markdown
from sweep.report.sweep import sweep_markdown, sweep_table
from sweep.run.tracking import open_client, resolve_uri

DESCRIPTION = "Reports: a table across the runs of an experiment read from MLflow, and each sweep's pick."
SUMMARY_COLUMNS = {
    "tags.mlflow.runName": "run", "tags.run": "experiment", "tags.model": "model", "tags.data": "data",
    "tags.dtype": "dtype", "tags.clip": "clip", "metrics.grad_norm_p50": "p50", "metrics.grad_norm_p90": "p90",
    "metrics.grad_norm_p95": "p95", "metrics.grad_norm_p99": "p99",
    "metrics.recommended_max_norm": "recommended_max_norm", "metrics.clip_ratio": "clip_ratio",
    "metrics.skip_ratio": "skip_ratio", "metrics.final_loss": "final_loss", "metrics.eval_loss": "eval_loss",
}
_OUTCOME_STATE = {"complete": "COMPLETE", "pruned": "PRUNED"}


def search_all(client, experiment_id: str, filter_string: str = "") -> list:
    """Every run of the experiment matching ``filter_string``, oldest first (all pages)."""
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=filter_string, max_results=1000,
                                  page_token=token, order_by=["attributes.start_time ASC"])
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def runs_table(client, experiment_name: str) -> pd.DataFrame:
    """Every run of ``experiment_name`` as a pandas DataFrame with the summary columns."""
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        raise UserError(f"experiment {experiment_name!r} not found in the tracking store; run "
                        f"`python -m sweep +experiment=calibrate` first or pass --experiment NAME")
    rows = []
    for run in search_all(client, exp.experiment_id):
        row = {"run_id": run.info.run_id[:8], "status": run.info.status}
        for key, name in SUMMARY_COLUMNS.items():
            kind, _, field = key.partition(".")
            source = run.data.tags if kind == "tags" else run.data.metrics
            row[name] = source.get(field, math.nan if kind == "metrics" else "")
        rows.append(row)
    return pd.DataFrame(rows, columns=["run_id", *SUMMARY_COLUMNS.values(), "status"])


def sweeps_tables(client, experiment_name: str) -> list[tuple[str, Any, Any, tuple[float, float], str]]:
    """Per study found in MLflow: (name, trials DataFrame, pick, band, mode), from its trial child runs.

    The band and mode come from the study's latest parent run; the pick is ``sweep.pick.pick_trial``
    over the trials recorded so far (every invocation, every worker).
    """
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    parents = {r.data.tags.get("study"): r for r in search_all(client, exp.experiment_id, "tags.sweep_role = 'parent'")}
    trials: dict[str, list] = {}
    for r in search_all(client, exp.experiment_id, "tags.sweep_role = 'trial'"):
        t, m = r.data.tags, r.data.metrics
        state = "RUNNING" if r.info.status == "RUNNING" else _OUTCOME_STATE.get(t.get("outcome", ""), "FAIL")
        trials.setdefault(t.get("study", "?"), []).append({
            "trial": int(t.get("trial", -1)), "state": state, "dtype": t.get("dtype", ""),
            "max_norm": float(r.data.params.get("clip.max_norm", t.get("max_norm", "nan"))),
            "eval_loss": m.get("eval_loss", math.nan), "clip_ratio": m.get("clip_ratio", math.nan),
            "skip_ratio": m.get("skip_ratio", math.nan), "final_loss": m.get("final_loss", math.nan),
            "steps_run": int(m.get("steps_run", 0) or 0), "run_id": r.info.run_id})
    out = []
    for name, rows in trials.items():
        parent = parents.get(name)
        p = parent.data.params if parent else {}
        band = (float(p.get("study.target_clip_low", 0.0)), float(p.get("study.target_clip_high", 1.0)))
        df = pd.DataFrame(rows).sort_values("trial").drop_duplicates("trial", keep="last").reset_index(drop=True)
        df = flag_table(df, band)
        out.append((name, df, pick_trial(df, band), band, p.get("study.mode", "")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sweep.report", description=DESCRIPTION)
    ap.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlruns/mlflow.db")
    ap.add_argument("--experiment", default="clipamp")
    ap.add_argument("--out", default=None, help="also save the table as CSV (or .md for markdown)")
    args = ap.parse_args(argv)
    try:
        if args.out:
            check_out(args.out)
        client = open_client(resolve_uri(args.tracking_uri))
        df = runs_table(client, args.experiment)
        sweeps = sweeps_tables(client, args.experiment)
    except UserError as e:
        fail(str(e))
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.4g}".format):
        print(df.to_string(index=False) if not df.empty else "no runs yet")
    console = Console(soft_wrap=True)
    for name, sdf, pick, band, mode in sweeps:
        console.print(sweep_table(sdf, pick, f"Study {name}" + (f" ({mode})" if mode else "")))
        console.print(f"band [{band[0]:g}, {band[1]:g}]; " + (
            f"[bold green]pick: trial {pick.trial}: {pick.override()}[/] ({pick.rule}: {pick.reason})"
            if pick else "no completed trial: no pick"))
    if args.out:
        save(args.out, df, sweeps)
    return 0


def check_out(out: str) -> None:
    """Before anything is printed: ``out``'s folder exists (created if missing) and is writable."""
    folder = Path(out).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create {folder}/ ({e.strerror}): pass a path in a writable folder") from None
    if Path(out).is_dir() or not os.access(folder, os.W_OK):
        raise UserError(f"--out {out}: not a writable file path: pass e.g. --out report.md in a writable folder")


def save(out: str, df: pd.DataFrame, sweeps: list) -> None:
    """``out`` as markdown (``.md``: runs and studies) or CSV (runs; studies beside it as ``.sweeps.csv``)."""
    if out.endswith(".md"):
        with open(out, "w") as f:
            f.write(frame_markdown(df))
            for name, sdf, pick, band, mode in sweeps:
                f.write("\n" + sweep_markdown(name, sdf, pick, band=band, mode=mode))
    else:
        df.to_csv(out, index=False)
        if sweeps:
            stem = out[:-4] if out.endswith(".csv") else out
            pd.concat([sdf.assign(study=name) for name, sdf, *_ in sweeps]).to_csv(f"{stem}.sweeps.csv", index=False)
            print(f"saved {stem}.sweeps.csv")
    print(f"saved {out}")
