"""The figures of runs that did not finish (KILLED, FAILED, RUNNING), from the steps their ``steps.csv`` holds.

A run logs its summary (quantiles, recommended τ, ratios, loss) and τ tags when it ends. One a signal stopped,
that failed or is still training has none of them (a pruned or killed trial only its ratios), though its
``steps.csv`` keeps every step it completed. ``fill`` gives such a run what those rows support, by the rules of
``sweep.run.summary.summary_metrics`` over the steps done: quantiles over the finite pre-clip norms of taken
steps; without a calibration window τ rec. is their quantile ``calibrate.quantile``; with one
(``clip=calibrated``), the first window's τ and quantiles as the run logged them when it closed, the clipping
ratio over the taken steps after it, and ``OPEN`` while that window never closed (no τ was recommended: a
quantile of part of a window would pass for one). Figures the store holds are never replaced.
"""

from __future__ import annotations

import ast
import contextlib
import math
import socket
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote, urlparse

import pandas as pd

#: Shown after the name of a run whose figures come from its steps.csv, and where τ rec./quantiles await a window.
MARK, OPEN = "*", "open"
QUANTILE_COLUMNS = ("metrics.grad_norm_p50", "metrics.grad_norm_p90", "metrics.grad_norm_p95", "metrics.grad_norm_p99")
FIGURES = (*QUANTILE_COLUMNS, "metrics.recommended_max_norm", "metrics.clip_ratio", "metrics.skip_ratio")
PARTIAL, WINDOW_OPEN, WHY = "report.partial", "report.window_open", "report.why"  # columns fill adds
WINDOW_PHASES = {"settle", "calibrate", "validate"}
LEGEND_RUNS = 10


def steps_csv(run: pd.Series, tmp: str, client, download: bool = True) -> Path | None:
    """The run's steps.csv: in its local artifact folder, in ``mlruns/uploads/RUN_ID/`` (a server's run kept
    locally), else downloaded from the store (``download``); None where there is none."""
    from sweep.tracking.tracker import fetch_artifact, upload_dir

    uri = str(run.get("artifact_uri") or "")
    parsed = urlparse(uri)
    local = parsed.scheme in ("", "file")
    for path in [Path(unquote(parsed.path)) / "steps.csv"] if local else [upload_dir(run["run_id"]) / "steps.csv"]:
        if path.is_file():
            return path
    if local or not download:
        return None
    with contextlib.suppress(Exception):  # a remote store: the file once uploaded, else none
        return fetch_artifact(client, run["run_id"], "steps.csv", tmp)
    return None


def steps_done(client, run) -> int:
    """The steps an MLflow ``run`` (an unfinished one: a killed trial, say) completed: the rows of its
    ``steps.csv`` on this disk, written as each step ends; else the last step of its per-step ``loss`` in the
    store, which is sent in batches (``tracking.flush_every``) and so lags behind after a SIGKILL."""
    from sweep.run.summary import read_rows

    row = pd.Series({"artifact_uri": run.info.artifact_uri, "run_id": run.info.run_id})
    path = steps_csv(row, "", client, download=False)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # not a steps CSV: the store's count
        if path is not None:
            return len(read_rows(path, whole_lines=True))
    return int(max((m.step for m in client.get_metric_history(run.info.run_id, "loss")), default=0))


def _param(run: pd.Series, key: str) -> Any:
    value = run.get(f"params.{key}")
    if not isinstance(value, str):
        return None
    with contextlib.suppress(ValueError, SyntaxError):
        return ast.literal_eval(value)
    return None


def _first_window(client, run_id: str) -> dict[str, float] | None:
    """The first calibration window's figures as the run logged them when it closed (its first values)."""
    out = {}
    for name in ("window_recommended_max_norm", *(c.replace("metrics.grad_norm", "window") for c in QUANTILE_COLUMNS)):
        history = sorted(client.get_metric_history(run_id, name), key=lambda m: (m.step, m.timestamp))
        if not history:
            return None
        out[name] = history[0].value
        out["end_step"] = history[0].step
    return out


def figures(rows: list[dict[str, Any]], run: pd.Series, client) -> tuple[dict[str, float], bool]:
    """What ``rows`` support as the summary figures (``FIGURES``, ``final_loss``), and whether the run's first
    calibration window is still open."""
    from clipamp_engine.band import PRETRAINING_BAND
    from sweep.run.loop import RunRecords, clipped_share
    from sweep.run.summary import summary_metrics

    records = RunRecords(rows)
    if not any(r.get("phase") in WINDOW_PHASES for r in rows):  # no window: exactly a finished run's rules
        q = _param(run, "calibrate.quantile")
        band = _param(run, "calibrate.target_clip") or PRETRAINING_BAND
        cfg = SimpleNamespace(calibrate=SimpleNamespace(quantile=q, target_clip=band))
        m = summary_metrics(cfg, records, [])
        return {k: m[k.split(".", 1)[1]] for k in FIGURES} | {"metrics.final_loss": m["final_loss"]}, False
    window = _first_window(client, run["run_id"])
    out = {"metrics.skip_ratio": records.skip_ratio(), "metrics.final_loss": records.final_loss()}
    if window is None:
        return out, True
    out |= {c: window[c.replace("metrics.grad_norm", "window")] for c in QUANTILE_COLUMNS}
    out["metrics.recommended_max_norm"] = window["window_recommended_max_norm"]
    out["metrics.clip_ratio"] = clipped_share([r for r in records.taken() if r["step"] > window["end_step"]])
    return out, False


def _alive(run: pd.Series, uri: str) -> bool | None:
    """Is a RUNNING run's process alive? Its ``run.lock`` (held while it trains) says so on this host."""
    from sweep.run.checkpoint import checkpoint_path
    from sweep.run.liveness import lock_says

    lock = checkpoint_path(uri, run["run_id"]).with_name("run.lock")
    return lock_says({"worker_host": socket.gethostname(), "worker_lock": str(lock)})


def why(run: pd.Series, steps: int, uri: str, window_open: bool) -> str:
    """How the run stands: its status, the steps done of its ``steps``, and what continues it."""
    from sweep.run.checkpoint import checkpoint_path

    tags = run.get
    total = _param(run, "steps")
    done = f"{steps} of {total} steps" if isinstance(total, int) else f"{steps} steps"
    status = run["status"]
    alive = _alive(run, uri) if status == "RUNNING" else None
    if status == "RUNNING" and alive is not False:
        text = f"RUNNING: {done} so far"
    elif status == "RUNNING":
        text = f"RUNNING in the store, but its process is gone (its run.lock is free: killed, e.g. SIGKILL): {done}"
    elif tags("tags.pruned") == "true":
        text = f"pruned after {done} ({tags('tags.pruned_by') or 'the pruner'})"
    else:
        reason = tags("tags.failure_reason") or tags("tags.error")
        text = f"{status} after {done}" + (f" ({reason})" if isinstance(reason, str) and reason else "")
    own = not isinstance(tags("tags.mlflow.parentRunId"), str) and tags("tags.run") in ("train", "calibrate")
    if status != "FAILED" and alive is not True and own and checkpoint_path(uri, run["run_id"]).exists():
        text += (
            f"; resumable: its command plus resume={run['run_id']}"
            if not isinstance(total, int) or steps < total
            else "; every step ran, its end-of-run phase was cut short: re-run without resume= for its summary"
        )
    if window_open:
        text += f"; its first calibration window never closed: τ rec. and the quantiles are {OPEN}"
    return text


def fill(runs: pd.DataFrame, uri: str, client, download: bool = True) -> pd.DataFrame:
    """``runs`` with the figures of each unfinished run that its steps.csv supports (stored figures kept), and
    the columns ``PARTIAL`` (figures from steps.csv), ``WINDOW_OPEN`` and ``WHY`` (for ``legend``).
    ``download=False``: only the steps.csv files on this disk are read (a run's end writing its experiment's
    note downloads no other run's file from a tracking server)."""
    runs = runs.copy()
    runs[PARTIAL], runs[WINDOW_OPEN], runs[WHY] = False, False, ""
    unfinished = runs.index[runs["status"] != "FINISHED"] if "status" in runs else []
    if not len(unfinished):
        return runs
    from sweep.run.summary import read_rows, tau_tags

    with tempfile.TemporaryDirectory() as tmp:
        for i in unfinished:
            run = runs.loc[i]
            path = steps_csv(run, tmp, client, download)
            try:
                rows = read_rows(path, whole_lines=True) if path is not None else []
            except (OSError, ValueError, KeyError, TypeError):  # not a steps CSV: the row stays as stored
                rows = []
            if not rows:
                continue
            found, window_open = figures(rows, run, client)
            found["tags.tau_used"] = tau_tags(rows)["tau_used"]
            missing = [c for c in found if _missing(run.get(c))]
            if not missing and not window_open:  # its summary was logged (e.g. FAILED after it): as stored
                continue
            for column in missing:
                runs.loc[i, column] = found[column]
            runs.loc[i, [PARTIAL, WINDOW_OPEN, WHY]] = [True, window_open, why(run, len(rows), uri, window_open)]
    return runs


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def legend(runs: pd.DataFrame, limit: int | None = LEGEND_RUNS, markdown: bool = False) -> list[str]:
    """What the runs marked ``MARK`` are and how they stand (the ``limit`` newest named), one line each
    (``markdown``: a paragraph and a list)."""
    if PARTIAL not in runs or not runs[PARTIAL].any():
        return []
    part = runs[runs[PARTIAL]]
    mark, item = ("\\" + MARK, "- ") if markdown else (MARK, "  ")
    lines = [
        f"{mark} not finished: figures over the steps its steps.csv holds so far (a finished run's are its summary)"
    ]
    if markdown:
        lines.append("")
    for _, r in part.head(limit).iterrows():
        lines.append(f"{item}{r['tags.mlflow.runName']} {r['run_id'][:8]}: {r[WHY]}")
    if limit is not None and len(part) > limit:
        lines.append(f"  … {len(part) - limit} more (--wide --out FILE.md lists every one)")
    return lines
