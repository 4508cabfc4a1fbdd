"""Reports: one run's markdown + terminal tables, and a table across runs read from MLflow.

    python -m sweep.report [--tracking-uri URI] [--experiment NAME] [--out report.csv]

reads every run of the experiment into pandas and prints, per run: task, dtype, clip mode,
quantiles, recommended τ, clipping and skip ratios, losses — the table to pick a threshold from.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from .errors import UserError, fail

if TYPE_CHECKING:
    from .config import Config
    from .session import RunResult

SUMMARY_COLUMNS = {
    "tags.mlflow.runName": "run", "tags.run": "experiment", "tags.model": "model", "tags.data": "data",
    "tags.dtype": "dtype", "tags.clip": "clip", "metrics.grad_norm_p50": "p50", "metrics.grad_norm_p90": "p90",
    "metrics.grad_norm_p95": "p95", "metrics.grad_norm_p99": "p99",
    "metrics.recommended_max_norm": "recommended_max_norm", "metrics.clip_ratio": "clip_ratio",
    "metrics.skip_ratio": "skip_ratio", "metrics.final_loss": "final_loss", "metrics.eval_loss": "eval_loss",
}


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "—" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def ui_command(uri: str, experiment_id: str | None = None) -> str:
    """The command that opens the store in the MLflow UI, bound to loopback only."""
    cmd = f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"
    if uri.startswith(("http://", "https://")):
        cmd = f"open {uri}"
    where = f"  → http://127.0.0.1:5000/#/experiments/{experiment_id}/runs" if experiment_id else ""
    return cmd + where


def run_report_markdown(cfg: "Config", result: "RunResult") -> str:
    """The human report of one run: quantiles, candidate thresholds, recommendation, ratios."""
    m = result.metrics
    lines = [f"# clipamp {cfg.run}: {cfg.model.name} on {cfg.data.name}, {cfg.amp.dtype}", "",
             f"- steps: {cfg.steps}, seed {cfg.seed}, clip: {cfg.clip.mode}",
             f"- skipped steps: {int(m.get('steps_skipped', 0))} (skip ratio {_fmt(m['skip_ratio'])})",
             f"- final training loss (last 10 steps): {_fmt(m['final_loss'])}, eval loss: {_fmt(m.get('eval_loss', math.nan))}",
             ""]
    if result.windows:
        w = result.windows[0]
        lines += [f"## Calibration window: steps {w.start_step}–{w.end_step} "
                  f"({w.n_finite} finite norms, {w.n_skipped} skipped)", "",
                  "| quantile | ‖g‖ | ‖g‖·√N_tok |", "|---|---|---|"]
        for k, v in w.quantiles.items():
            lines.append(f"| {k} | {_fmt(v)} | {_fmt(w.token_quantiles.get(k, math.nan))} |")
        lines += ["", "| threshold τ | clipping ratio in the window |", "|---|---|"]
        for t, r in w.candidate_clip_ratios.items():
            mark = " ← recommended" if t == w.recommended_max_norm else ""
            lines.append(f"| {t:.4g} | {r:.1%}{mark} |")
        lines += ["", f"**Recommended `clip.max_norm={w.recommended_max_norm:.4g}`** "
                      f"(τ = Quantile_{w.quantile:g} of the window's finite pre-clip norms).", "",
                  f"Clipping ratio realised after the window at that τ: {_fmt(m['clip_ratio'])}.", ""]
        if len(result.windows) > 1:
            lines += ["## Drift across windows", "", "| window | p50 | p95 | τ | τ / first τ |", "|---|---|---|---|---|"]
            for x in result.windows:
                lines.append(f"| {x.start_step}–{x.end_step} | {_fmt(x.quantiles['p50'])} | {_fmt(x.quantiles['p95'])} "
                             f"| {_fmt(x.recommended_max_norm)} | {x.recommended_max_norm / w.recommended_max_norm:.2f} |")
            lines.append("")
    else:
        lines += ["## Norm quantiles over the run", ""]
        lines += [f"- {k[len('grad_norm_'):]}: {_fmt(v)}" for k, v in m.items() if k.startswith("grad_norm_")]
        lines += [f"- clipping ratio: {_fmt(m['clip_ratio'])}", ""]
    findings = _diagnosis(result)
    if findings:
        lines += ["## Norm-pattern diagnosis", "", findings, ""]
    return "\n".join(lines)


def _diagnosis(result: "RunResult") -> str:
    try:
        from clipamp_engine.diagnosis import diagnose, format_findings
    except ImportError:
        return ""
    return format_findings(diagnose(result.records.rows))


def print_run_summary(result: "RunResult", *, uri: str, experiment_id: str, console: Console | None = None) -> None:
    """Terminal: quantiles, candidate thresholds and their clipping ratios, the pick, the UI command."""
    console = console or Console()
    m = result.metrics
    if result.windows:
        w = result.windows[0]
        t = Table(title=f"Calibration window, steps {w.start_step}–{w.end_step} ({w.n_finite} finite, {w.n_skipped} skipped)")
        for col in ("quantile", "‖g‖", "‖g‖·√N_tok"):
            t.add_column(col, justify="right")
        for k, v in w.quantiles.items():
            t.add_row(k, _fmt(v), _fmt(w.token_quantiles.get(k, math.nan)))
        console.print(t)
        c = Table(title="Candidate thresholds")
        c.add_column("τ", justify="right")
        c.add_column("clipping ratio in window", justify="right")
        for tau, r in w.candidate_clip_ratios.items():
            c.add_row(_fmt(tau) + (" ←" if tau == w.recommended_max_norm else ""), f"{r:.1%}")
        console.print(c)
        console.print(f"[bold green]Recommended clip.max_norm={w.recommended_max_norm:.4g}[/] "
                      f"(Quantile_{w.quantile:g}); clipping ratio realised after the window: {_fmt(m['clip_ratio'])}")
    console.print(f"final loss {_fmt(m['final_loss'])}, eval loss {_fmt(m.get('eval_loss', math.nan))}, "
                  f"skip ratio {_fmt(m['skip_ratio'])}")
    findings = _diagnosis(result)
    if findings:
        console.print(findings)
    console.print(f"MLflow run {result.run_id}: {ui_command(uri, experiment_id)}")


def runs_table(client, experiment_name: str):
    """Every run of ``experiment_name`` as a pandas DataFrame with the summary columns."""
    import pandas as pd

    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        raise UserError(f"experiment {experiment_name!r} not found in the tracking store; run "
                        f"`python -m sweep +experiment=calibrate` first or pass --experiment NAME")
    rows, token = [], None
    while True:
        page = client.search_runs([exp.experiment_id], max_results=1000, page_token=token,
                                  order_by=["attributes.start_time ASC"])
        for run in page:
            row = {"run_id": run.info.run_id[:8], "status": run.info.status}
            for key, name in SUMMARY_COLUMNS.items():
                kind, _, field = key.partition(".")
                source = run.data.tags if kind == "tags" else run.data.metrics
                row[name] = source.get(field, math.nan if kind == "metrics" else "")
            rows.append(row)
        token = page.token
        if not token:
            break
    return pd.DataFrame(rows, columns=["run_id", *SUMMARY_COLUMNS.values(), "status"])


def to_markdown(df) -> str:
    head = "| " + " | ".join(df.columns) + " |"
    sep = "|" + "---|" * len(df.columns)
    body = ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, sep, *body]) + "\n"


def main(argv: list[str] | None = None) -> int:
    from .tracking import open_client, resolve_uri

    ap = argparse.ArgumentParser(prog="python -m sweep.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlruns/mlflow.db")
    ap.add_argument("--experiment", default="clipamp")
    ap.add_argument("--out", default=None, help="also save the table as CSV (or .md for markdown)")
    args = ap.parse_args(argv)
    try:
        uri = resolve_uri(args.tracking_uri)
        df = runs_table(open_client(uri), args.experiment)
    except UserError as e:
        fail(str(e))
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.4g}".format):
        print(df.to_string(index=False) if not df.empty else "no runs yet")
    if args.out:
        if args.out.endswith(".md"):
            with open(args.out, "w") as f:
                f.write(to_markdown(df))
        else:
            df.to_csv(args.out, index=False)
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
