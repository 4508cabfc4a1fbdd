"""``python -m sweep.report [--tracking-uri URI] [--experiment NAME] [--last N] [--wide] [--out FILE]``.

Reads the runs of the experiment with ``mlflow.search_runs`` and prints, newest first, per run: clip
mode, dtype, the τ it trained at (per phase), the recommended τ, p95, clipping and skip ratios, losses
(the table to pick a threshold from, in 100 columns; ``--wide``: ids, model, data, every quantile);
then, per sweep study (``+experiment=sweep``), its trials and the configuration the pick rule chooses.
"""

from __future__ import annotations

import argparse
import ast
import math
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console

from sweep.errors import UserError, fail, for_commands
from sweep.offline import stay_offline
from sweep.paths import write_refusal
from sweep.pick import flag_table, pick_trial
from sweep.report.format import frame_markdown, print_wide
from sweep.report.runs import WIDTH, search, table, text, values
from sweep.report.sweep import sweep_markdown, sweep_table
from sweep.report.unfinished import fill, legend, steps_done
from sweep.run.liveness import DIED, died_line, trial_state
from sweep.tracking.tracker import open_client, resolve_uri, sqlite_path

DESCRIPTION = "Reports: a table across the runs of an experiment read from MLflow, and each sweep's pick."
_OUTCOME_STATE = {"complete": "COMPLETE", "pruned": "PRUNED"}


def _trial_state(status: str, outcome: str) -> str:
    """A trial child run's state for the table: its outcome tag, else RUNNING, KILLED (a signal) or FAIL
    (and DIED, see ``sweeps_tables``: RUNNING, its worker of this host dead)."""
    if outcome in _OUTCOME_STATE:
        return _OUTCOME_STATE[outcome]
    return status if status in ("RUNNING", "KILLED") else "FAIL"


def logged_band(params: dict[str, str]) -> tuple[float, float]:
    """A sweep parent's clipping band from its params: ``study.target_clip`` (``[0.01, 0.2]``), or the
    ``study.target_clip_low``/``_high`` pair of older runs; ``(0, 1)`` when neither is there."""
    if "study.target_clip" in params:
        low, high = ast.literal_eval(params["study.target_clip"])
        return float(low), float(high)
    return float(params.get("study.target_clip_low", 0.0)), float(params.get("study.target_clip_high", 1.0))


def search_all(client, experiment_id: str, filter_string: str = "") -> list:
    """Every run of the experiment matching ``filter_string``, oldest first (all pages)."""
    runs, token = [], None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string=filter_string,
            max_results=1000,
            page_token=token,
            order_by=["attributes.start_time ASC"],
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def sweeps_tables(client, experiment_name: str) -> list[tuple[str, Any, Any, tuple[float, float], str]]:
    """Per study found in MLflow: (name, trials DataFrame, pick, band, mode), from its trial child runs.

    The band and mode come from the study's latest parent run that logged its config; the pick is
    ``sweep.pick.pick_trial`` over the trials recorded so far (every invocation, every worker).
    """
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    every = search_all(client, exp.experiment_id, "tags.sweep_role = 'parent'")
    parents, by_id = {}, {r.info.run_id: r for r in every}
    for r in every:  # the latest parent that logged its config (one still waiting for the study lock has none)
        if r.data.params or r.data.tags.get("study") not in parents:
            parents[r.data.tags.get("study")] = r
    trials: dict[str, list] = {}
    for r in search_all(client, exp.experiment_id, "tags.sweep_role = 'trial'"):
        t, m = r.data.tags, r.data.metrics
        state = _trial_state(r.info.status, t.get("outcome", ""))
        worker = by_id.get(t.get("sweep_parent") or t.get("mlflow.parentRunId", ""))
        state = trial_state(state, worker.data.tags if worker is not None else None)  # DIED: the next run recovers it
        steps_run = m.get("steps_run")
        if steps_run is None:  # no summary yet (running) or ever (a signal, a dead worker): the steps it did
            steps_run = steps_done(client, r)
        trials.setdefault(t.get("study", "?"), []).append(
            {
                "trial": int(t.get("trial", -1)),
                "state": state,
                "dtype": t.get("dtype", ""),
                "max_norm": float(r.data.params.get("clip.max_norm", t.get("max_norm", "nan"))),
                "eval_loss": m.get("eval_loss", math.nan),
                "clip_ratio": m.get("clip_ratio", math.nan),
                "skip_ratio": m.get("skip_ratio", math.nan),
                "final_loss": m.get("final_loss", math.nan),
                "steps_run": int(steps_run or 0),
                "run_id": r.info.run_id,
            }
        )
    out = []
    for name, rows in trials.items():
        parent = parents.get(name)
        p = parent.data.params if parent else {}
        band = logged_band(p)
        df = pd.DataFrame(rows).sort_values("trial").drop_duplicates("trial", keep="last").reset_index(drop=True)
        df = flag_table(df, band)
        out.append((name, df, pick_trial(df, band), band, p.get("study.mode", "")))
    return out


def main(argv: list[str] | None = None) -> int:
    stay_offline()
    ap = argparse.ArgumentParser(prog="python -m sweep.report", description=DESCRIPTION)
    ap.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlruns/mlflow.db")
    ap.add_argument("--experiment", default="clipamp", help="the MLflow experiment (tracking.experiment)")
    ap.add_argument(
        "--last",
        type=int,
        default=None,
        metavar="N",
        help="only the N newest runs in the runs table (a study's table keeps every trial: its pick covers them all)",
    )
    ap.add_argument(
        "--wide", action="store_true", help="every column (ids, experiment, model, data, p50/p90/p99, status, started)"
    )
    ap.add_argument("--out", default=None, help="also save the wide table as CSV (or .md for markdown)")
    args = ap.parse_args(argv)
    try:
        if args.last is not None and args.last < 1:
            raise UserError(f"--last {args.last} must be >= 1, e.g. --last 10")
        if args.out:
            check_out(args.out)
        uri = resolve_uri(args.tracking_uri)
        db = sqlite_path(uri)
        if db is not None and not db.exists():  # a report never creates a store
            print(f"no runs yet: no tracking store at {db} (pass --tracking-uri, or run from the runs' folder)")
            return 0
        client = open_client(uri)
        found = search(client.tracking_uri, args.experiment, args.last)
        shown = fill(found, client.tracking_uri, client)  # unfinished runs: what their steps.csv supports
        sweeps = sweeps_tables(client, args.experiment)
    except UserError as e:
        fail(for_commands(str(e)))
    df = table(shown, wide=args.wide)
    print(text(df, width=None if args.wide else WIDTH))
    for line in legend(shown):
        print(line)
    console = Console(soft_wrap=True)
    for name, sdf, pick, band, mode in sweeps:
        title = f"Study {name}" + (f" ({mode})" if mode else "")
        print_wide(console, sweep_table(sdf, pick, title, pareto=mode != "constrained"))
        console.print(
            f"band [{band[0]:g}, {band[1]:g}]; "
            + (
                f"[bold green]pick: trial {pick.trial}: {pick.override()}[/] ({pick.rule}: {pick.reason})"
                if pick
                else "no completed trial: no pick"
            )
        )
        died = sorted(int(n) for n in sdf.loc[sdf["state"] == DIED, "trial"])
        if died:
            console.print(died_line(died))
    if args.out:
        try:
            save(args.out, found, sweeps, shown)
        except OSError as e:  # unwritable file, a folder in its place, a full disk
            fail(
                f"--out {args.out}: cannot write {e.filename or args.out} ({e.strerror or type(e).__name__}); "
                "the table above is complete: pass a writable file path, e.g. --out report.md"
            )
    return 0


def check_out(out: str) -> None:
    """Before anything is printed: ``out``'s folder exists (created if missing) and is writable."""
    folder = Path(out).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"--out {out}: cannot create {folder}/ ({e.strerror}): pass a path in a writable folder"
        ) from None
    if write_refusal(Path(out), is_file=True) is not None:
        raise UserError(f"--out {out}: not a writable file path: pass e.g. --out report.md in a writable folder")


def save(out: str, runs: pd.DataFrame, sweeps: list, shown: pd.DataFrame | None = None) -> None:
    """``out`` as markdown (``.md``: the wide table as printed, ``shown``: with unfinished runs' figures and
    their legend, and the studies) or CSV (the wide table's columns with the store's values; studies beside
    it as ``.sweeps.csv``)."""
    if out.lower().endswith(".md"):  # REPORT.MD is markdown too
        shown = runs if shown is None else shown
        with open(out, "w") as f:
            f.write(frame_markdown(table(shown, wide=True)))
            f.write("".join(f"\n{line}" for line in legend(shown, limit=None, markdown=True)) + "\n")
            for name, sdf, pick, band, mode in sweeps:
                f.write("\n" + sweep_markdown(name, sdf, pick, band=band, mode=mode))
    else:
        values(runs).to_csv(out, index=False)
        if sweeps:
            stem = out[:-4] if out.lower().endswith(".csv") else out
            pd.concat([sdf.assign(study=name) for name, sdf, *_ in sweeps]).to_csv(f"{stem}.sweeps.csv", index=False)
            print(f"saved {stem}.sweeps.csv")
    print(f"saved {out}")
