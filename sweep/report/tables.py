"""Reports: one run's markdown + terminal tables, and a table across runs read from MLflow.

    python -m sweep.report [--tracking-uri URI] [--experiment NAME] [--out report.csv]

reads every run of the experiment into pandas and prints, per run: task, dtype, clip mode,
quantiles, recommended τ, clipping and skip ratios, losses — the table to pick a threshold from;
then, per sweep study (``+experiment=sweep``), its trials and the configuration the pick rule chooses.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from sweep.errors import UserError, fail

if TYPE_CHECKING:
    from sweep.config.schema import Config
    from sweep.run.pipeline import RunResult

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


def _pct(v: float) -> str:
    return "—" if v is None or math.isnan(v) else f"{v:.1%}"


def ui_command(uri: str, experiment_id: str | None = None) -> str:
    """How to see the runs in the MLflow UI: a loopback-only ``mlflow ui``, or the server's page."""
    page = f"#/experiments/{experiment_id}/runs" if experiment_id else "#/experiments"
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')}/{page}"
    return (f"mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"
            f"  → http://127.0.0.1:5000/{page}")


def run_report_markdown(cfg: "Config", result: "RunResult") -> str:
    """The human report of one run: quantiles, candidate thresholds, recommendation, ratios."""
    m = result.metrics
    lines = [f"# clipamp {cfg.run}: {cfg.model.name} on {cfg.data.name}, {cfg.amp.dtype}", "",
             f"- steps: {cfg.steps}, seed {cfg.seed}, clip: {cfg.clip.mode}",
             f"- skipped steps: {int(m.get('steps_skipped', 0))} (skip ratio {_pct(m['skip_ratio'])})",
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
                  f"Clipping ratio realised after the window at that τ: {_pct(m['clip_ratio'])}.", ""]
        if len(result.windows) > 1:
            lines += ["## Drift across windows", "", "| window | p50 | p95 | τ | τ / first τ |", "|---|---|---|---|---|"]
            for x in result.windows:
                lines.append(f"| {x.start_step}–{x.end_step} | {_fmt(x.quantiles['p50'])} | {_fmt(x.quantiles['p95'])} "
                             f"| {_fmt(x.recommended_max_norm)} | {x.recommended_max_norm / w.recommended_max_norm:.2f} |")
            lines.append("")
    else:
        lines += ["## Norm quantiles over the run", ""]
        lines += [f"- {k[len('grad_norm_'):]}: {_fmt(v)}" for k, v in m.items() if k.startswith("grad_norm_")]
        lines += [f"- clipping ratio: {_pct(m['clip_ratio'])}", ""]
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
                      f"(Quantile_{w.quantile:g}); clipping ratio realised after the window: {_pct(m['clip_ratio'])}")
    console.print(f"final loss {_fmt(m['final_loss'])}, eval loss {_fmt(m.get('eval_loss', math.nan))}, "
                  f"skip ratio {_pct(m['skip_ratio'])}")
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


# ---------------------------------------------------------------- sweeps (Optuna studies)

SWEEP_COLUMNS = ("trial", "state", "dtype", "max_norm", "eval_loss", "clip_ratio", "skip_ratio", "final_loss",
                 "steps_run", "in_band", "pareto", "run_id")
_OUTCOME_STATE = {"complete": "COMPLETE", "pruned": "PRUNED"}


def sweep_markdown(study_name: str, df, pick, *, band: tuple[float, float], mode: str = "",
                   heading: str = "##") -> str:
    """One study as markdown: the pick and its rule, then the trials table (Pareto / in-band marked)."""
    cols = [c for c in SWEEP_COLUMNS if c in df.columns]
    shown = df[cols].copy()
    if "run_id" in shown:
        shown["run_id"] = shown["run_id"].astype(str).str[:8]
    states = df["state"].value_counts().to_dict() if len(df) else {}
    lines = [f"{heading} Study `{study_name}`" + (f" ({mode})" if mode else ""), "",
             f"- trials: {len(df)} (" + ", ".join(f"{v} {k.lower()}" for k, v in states.items()) + ")",
             f"- target clipping band: [{band[0]:g}, {band[1]:g}]"]
    if pick is not None:
        lines += [f"- **pick: trial {pick.trial}: `amp.dtype={pick.dtype} clip.max_norm={pick.max_norm:.4g}`** "
                  f"(eval loss {_fmt(pick.eval_loss)}, clipping ratio {pick.clip_ratio:.1%})",
                  f"- rule `{pick.rule}`: {pick.reason}"]
    else:
        lines.append("- pick: none (no completed trial yet)")
    lines += ["", to_markdown(shown) if len(shown) else "no trials", ""]
    return "\n".join(lines)


_SHORT = {"trial": "#", "state": "state", "dtype": "dtype", "max_norm": "τ", "eval_loss": "eval",
          "clip_ratio": "clip", "skip_ratio": "skip", "final_loss": "train", "steps_run": "steps"}


_STATE = {"COMPLETE": "done", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running", "WAITING": "queued"}


def _sweep_table(df, pick, title: str) -> Table:
    """Compact terminal table; ``marks``: P = on the Pareto front, B = clipping ratio in the band, ★ = pick."""
    t = Table(title=title, caption="eval: eval loss; train: mean training loss, last 10 steps; "
                                   "marks: P Pareto front, B clipping ratio in the band, ★ pick")
    cols = [c for c in _SHORT if c in df.columns]
    for c in cols:
        t.add_column(_SHORT[c], justify="left" if c in ("state", "dtype") else "right")
    t.add_column("marks")
    for _, row in df.iterrows():
        cells = []
        for c in cols:
            v = row[c]
            if c in ("clip_ratio", "skip_ratio") and isinstance(v, float) and not math.isnan(v):
                cells.append(f"{v:.1%}")
            elif c == "state":
                cells.append(_STATE.get(str(v), str(v).lower()))
            else:
                cells.append(_fmt(v))
        picked = pick is not None and int(row["trial"]) == pick.trial
        marks = ("P" if row.get("pareto", False) else "") + ("B" if row.get("in_band", False) else "") \
            + ("★" if picked else "")
        t.add_row(*cells, marks, style="bold green" if picked else None)
    return t


def print_sweep_summary(result, *, uri: str, experiment_id: str, console: Console | None = None) -> None:
    """Terminal: the study's trials, the pick and its rule, pruning accounting, the UI command."""
    console = console or Console()
    console.print(_sweep_table(result.trials, result.pick, f"Study {result.study_name} ({result.mode})"))
    p = result.pick
    if p is not None:
        console.print(f"[bold green]Pick: trial {p.trial}: amp.dtype={p.dtype} clip.max_norm={p.max_norm:.4g}[/] "
                      f"(eval loss {_fmt(p.eval_loss)}, clipping ratio {p.clip_ratio:.1%}); rule {p.rule}: {p.reason}")
    else:
        console.print("no completed trial: no pick")
    console.print(f"this invocation: {result.trials_run} trials ({result.pruned} pruned, {result.failed} failed) in "
                  f"{result.wall_s:.0f} s; trial-steps run {result.steps_run} of {result.steps_budget} unpruned "
                  f"(saved {result.steps_saved}, ≈{result.seconds_saved_est:.0f} s; pruning checks "
                  f"{result.prune_overhead_s:.2f} s)")
    console.print(f"Optuna study {result.study_name!r} in {result.storage}; MLflow parent run "
                  f"{result.parent_run_id}: {ui_command(uri, experiment_id)}")


def _search_all(client, experiment_id: str, filter_string: str) -> list:
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=filter_string, max_results=1000,
                                  page_token=token, order_by=["attributes.start_time ASC"])
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def sweeps_tables(client, experiment_name: str) -> list[tuple[str, Any, Any, tuple[float, float], str]]:
    """Per study found in MLflow: (name, trials DataFrame, pick, band, mode), from its trial child runs.

    The band and mode come from the study's latest parent run; the pick is ``sweep.study.pick_trial``
    over the trials recorded so far (every invocation, every worker).
    """
    import pandas as pd

    from sweep.experiments.study.sweep import flag_table, pick_trial

    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        return []
    parents = {r.data.tags.get("study"): r for r in _search_all(client, exp.experiment_id, "tags.sweep_role = 'parent'")}
    trials: dict[str, list] = {}
    for r in _search_all(client, exp.experiment_id, "tags.sweep_role = 'trial'"):
        t, m = r.data.tags, r.data.metrics
        outcome = t.get("outcome", "")
        state = "RUNNING" if r.info.status == "RUNNING" else _OUTCOME_STATE.get(outcome, "FAIL")
        trials.setdefault(t.get("study", "?"), []).append({
            "trial": int(t.get("trial", -1)), "state": state, "dtype": t.get("dtype", ""),
            "max_norm": float(r.data.params.get("clip.max_norm", t.get("max_norm", "nan"))), "eval_loss": m.get("eval_loss", math.nan),
            "clip_ratio": m.get("clip_ratio", math.nan), "skip_ratio": m.get("skip_ratio", math.nan),
            "final_loss": m.get("final_loss", math.nan), "steps_run": int(m.get("steps_run", 0) or 0),
            "run_id": r.info.run_id})
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
    from sweep.run.tracking import open_client, resolve_uri

    ap = argparse.ArgumentParser(prog="python -m sweep.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlruns/mlflow.db")
    ap.add_argument("--experiment", default="clipamp")
    ap.add_argument("--out", default=None, help="also save the table as CSV (or .md for markdown)")
    args = ap.parse_args(argv)
    try:
        uri = resolve_uri(args.tracking_uri)
        client = open_client(uri)
        df = runs_table(client, args.experiment)
        sweeps = sweeps_tables(client, args.experiment)
    except UserError as e:
        fail(str(e))
    import pandas as pd

    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.4g}".format):
        print(df.to_string(index=False) if not df.empty else "no runs yet")
    console = Console(soft_wrap=True)
    for name, sdf, pick, band, mode in sweeps:
        console.print(_sweep_table(sdf, pick, f"Study {name}" + (f" ({mode})" if mode else "")))
        console.print(f"band [{band[0]:g}, {band[1]:g}]; " + (
            f"[bold green]pick: trial {pick.trial}: amp.dtype={pick.dtype} clip.max_norm={pick.max_norm:.4g}[/] "
            f"({pick.rule}: {pick.reason})" if pick else "no completed trial: no pick"))
    if args.out:
        if args.out.endswith(".md"):
            with open(args.out, "w") as f:
                f.write(to_markdown(df))
                for name, sdf, pick, band, mode in sweeps:
                    f.write("\n" + sweep_markdown(name, sdf, pick, band=band, mode=mode))
        else:
            df.to_csv(args.out, index=False)
            if sweeps:
                stem = args.out[:-4] if args.out.endswith(".csv") else args.out
                pd.concat([sdf.assign(study=name) for name, sdf, *_ in sweeps]).to_csv(f"{stem}.sweeps.csv", index=False)
                print(f"saved {stem}.sweeps.csv")
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
