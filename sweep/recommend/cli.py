"""``python -m sweep.recommend PATH… [--norm NAME] [--lr NAME] [--window W] [--quantile Q] [--start auto|N] …``.

A ``max_grad_norm`` from the logs a run already wrote, without training again: each PATH (a
``trainer_state.json`` or checkpoint folder, a TensorBoard event file or folder, a CSV, an MLflow run)
gives a norm series, which the engine's ``CalibratedClip`` replays exactly as a ``clip=calibrated``
run would have seen it (``sweep.recommend.replay``); the report is the runner's, after the notes on
what the series can and cannot tell (``sweep.recommend.series``). ``--track`` also records each
recommendation as an MLflow run. Bad input (a missing file, no norm, a post-clip series, fewer
norms than a window) is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from rich.console import Console

from clipamp_engine.diagnosis import diagnose
from sweep.errors import UserError, fail, for_commands
from sweep.recommend.readers import read_series
from sweep.recommend.replay import (
    RUN_SETTINGS,
    Options,
    as_flag,
    diagnosis_rows,
    early_stop,
    lone_norm_window,
    on_grid,
    replay,
)
from sweep.recommend.report import Recommendation, caveats, outcome_notes, print_report
from sweep.recommend.series import NormSeries, post_clip_reason, with_gaps_skipped

DESCRIPTION = (
    "A max_grad_norm from logged gradient norms (Trainer state, TensorBoard, CSV, MLflow run): the calibrate "
    "run's window placement, quantiles with intervals, candidates, band check, drift and diagnosis."
)


RUN = "runs:/ID, or a CSV beside its run's config.yaml: the run's own calibrate.* where it has one"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sweep.recommend", description=DESCRIPTION)
    ap.add_argument("paths", nargs="+", metavar="PATH", help="trainer_state.json or its folder, events, CSV, runs:/ID")
    ap.add_argument(
        "--norm",
        default=None,
        help="tag / column / metric of the pre-clip norm "
        "(default: the first of grad_l2_pre_clip, grad_norm, train/grad_norm, grad_2.0_norm_total, "
        "one */grad_norm)",
    )
    ap.add_argument(
        "--lr",
        default=None,
        help="tag / column / metric of the learning rate (default: the first of lr, learning_rate, "
        "train/learning_rate, one */learning_rate, else Lightning's one lr-<Optimizer>, its /pg1 if several groups)",
    )
    ap.add_argument(
        "--step-column",
        default=None,
        help="CSV: the step column (default: the first of step, global_step, Step, iteration, iter, one */global_step; "
        "else the row number)",
    )
    ap.add_argument("--max-grad-norm", type=float, default=None, help="the τ the run clipped at, if the log lacks it")
    o = Options()  # the defaults: +experiment=calibrate's (RECOMMENDED); for runs:/ID the run's own calibrate.*
    ap.add_argument("--window", type=int, help=f"steps per calibration window (default {o.window}; {RUN})")
    ap.add_argument(
        "--quantile", help=f"q of τ = Quantile_q, or 'band' (default: aim at the middle of --target-clip; {RUN})"
    )
    ap.add_argument("--start", help=f"'auto' (after warm-up, the default) or N steps before the window ({RUN})")
    ap.add_argument("--every", type=int, help=f"steps between window starts (default 0: one window; {RUN})")
    ap.add_argument("--validate", type=int, help=f"held-out steps after a window (default 0: all; {RUN})")
    ap.add_argument("--target-clip", type=float, nargs=2, metavar=("LOW", "HIGH"), help=f"default 0.01 0.05 ({RUN})")
    ap.add_argument("--candidates", type=float, nargs="*", metavar="TAU", help=f"default 0.5 1 2 5, none alone ({RUN})")
    ap.add_argument("--confidence", type=float, help=f"level of the quantile intervals (default {o.confidence}; {RUN})")
    ap.add_argument("--track", action="store_true", help="also log each recommendation as an MLflow run")
    ap.add_argument("--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlruns/mlflow.db")
    ap.add_argument("--experiment", default="clipamp", help="the MLflow experiment for --track")
    return ap


def options_from(args: argparse.Namespace) -> Options:
    """``Options`` from the command line, ``Options()``'s where an option is not passed; a malformed
    ``--quantile`` or ``--start`` is a ``UserError``."""
    given = {name: getattr(args, name) for name in RUN_SETTINGS if getattr(args, name) is not None}
    if "quantile" in given:
        try:
            given["quantile"] = None if given["quantile"] == "band" else float(given["quantile"])
        except ValueError:
            raise UserError(f"--quantile {args.quantile}: pass a number in (0, 1), e.g. 0.95, or 'band'") from None
    if given.get("start", "auto") != "auto":
        try:
            given["start"] = int(given["start"])
        except ValueError:
            raise UserError(f"--start {args.start}: pass 'auto' or a number of steps >= 0, e.g. --start 200") from None
    for name in ("target_clip", "candidates"):
        if name in given:
            given[name] = tuple(given[name])
    return dataclasses.replace(Options(), **given)


def run_options(options: Options, series: NormSeries, args: argparse.Namespace) -> tuple[Options, list[str]]:
    """``options`` with the run's own calibration settings (its ``calibrate.*`` params) where an option was not
    passed, and a note listing them and where they were read: an MLflow run of the app or a trainer integration,
    or an app run's steps.csv beside its config.yaml, gets the advice it printed."""
    read = series.settings
    if not read:
        return options, []
    used = {k: v for k, v in read.items() if getattr(args, k) is None}
    passed = [as_flag(k, getattr(options, k)) for k in read if k not in used and getattr(options, k) != read[k]]
    note = (
        f"calibration settings read from {series.settings_from}: "
        f"{' '.join(as_flag(k, v) for k, v in used.items()) or 'none used'}"
        + (f" (passed here instead: {' '.join(passed)})" if passed else "")
        + "; an option passed here overrides them"
    )
    return dataclasses.replace(options, **used), [note]


def whose(message: str, series: NormSeries, args: argparse.Namespace) -> str:
    """``message`` (an option refused) with each option it names that the run's own settings gave, not the
    command line, said to be the run's and where it was read: the user did not pass it, and passes it to
    override it."""
    flags = [f"--{k.replace('_', '-')}" for k in series.settings or {} if getattr(args, k) is None]
    named = [flag for flag in flags if f"{flag} " in message]
    if not named:
        return message
    return (
        f"{message} ({', '.join(named)}: the run's, read from {series.settings_from}; pass "
        f"{'it' if len(named) == 1 else 'them'} here to override)"
    )


def replay_options(replayed: NormSeries, grid: Options, series: NormSeries, args: argparse.Namespace):
    """``replay(replayed, grid)``; an option it refuses that the run gave is said to be the run's (``whose``)."""
    try:
        return replay(replayed, grid)
    except UserError as e:
        raise UserError(whose(str(e), series, args)) from None


def recommend(path: str, options: Options, args: argparse.Namespace) -> Recommendation:
    """Read ``path``, refuse what cannot calibrate, replay it through ``CalibratedClip``, diagnose it."""
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        raise UserError(f"--max-grad-norm {args.max_grad_norm:g}: pass the τ > 0 the run clipped at, e.g. 1.0")
    series = read_series(path, norm=args.norm, lr=args.lr, step=args.step_column, tracking_uri=args.tracking_uri)
    if args.max_grad_norm is not None:
        tau = np.full(len(series.steps), float(args.max_grad_norm))
        series.max_norm = (
            tau if series.max_norm is None else np.where(np.isfinite(series.max_norm), series.max_norm, tau)
        )
    values = series.norms[series.taken]
    if len(values) and values.min() < 0:
        raise UserError(
            f"{series.source}: {series.name} holds negative values (down to {values.min():.4g}), which no norm "
            f"does: pass --norm NAME of the gradient norm"
        )
    if len(values) and values.max() == 0:
        raise UserError(
            f"{series.source}: every finite {series.name} is 0: the run's gradients were zero (a detached loss "
            f"or frozen parameters?), so there is nothing to calibrate; check the run, or pass --norm NAME"
        )
    reason = post_clip_reason(series)
    if reason:
        raise UserError(f"{series.source}: {reason}")
    options, settings = run_options(options, series, args)
    grid, moved = on_grid(options, series)
    moved = settings + moved
    n, taken = series.interval, int(series.taken.sum())
    if taken < (2 if series.settings else max(2, grid.window // n)):  # the run's own: a first window cut short
        every = f" (one every {n} steps)" if n > 1 else ""
        left = len(series.steps) - taken
        default = (
            " (--window's default: the log carries no run setting)" if not (series.settings or args.window) else ""
        )
        counted = f"{taken} finite norm{'' if taken == 1 else 's'}" + (
            f" ({left} more non-finite or skipped)" if left else ""
        )
        raise UserError(
            f"{series.source}: {counted} over steps {series.steps[0]}–{series.steps[-1]}{every}, fewer "
            f"than one {grid.window}-step window holds ({grid.window // n}){default}: lower --window or read a "
            "longer log"
        )
    replayed, gaps = with_gaps_skipped(series)
    clip = replay_options(replayed, grid, series, args)
    moved += lone_norm_window(clip, replayed.steps)
    if series.settings and not clip.summaries:  # the run's own settings: its first window, as its end left it
        moved += early_stop(clip, series)
    if not clip.summaries:
        start = clip.placement.start if clip.placement else "?"
        first = int(series.steps[0])
        if clip.placement and start + grid.window - 1 < first:
            raise UserError(
                f"{series.source}: the {grid.window}-step window (steps {start}–{start + grid.window - 1}) ends "
                f"before the log's first step {first}: pass --start {first - 1} or more (steps before the window)"
            )
        raise UserError(
            f"{series.source}: no calibration window closed by step {series.steps[-1]} (the {grid.window}-step window "
            f"starts at step {start}; its last step is past the log or not logged): lower --window or pass --start N"
        )
    if gaps:
        moved.append(
            f"{gaps} step(s) of the logging grid hold no value: counted as skipped, as a run counts a refused step"
        )
    notes = caveats(series, grid) + moved + outcome_notes(clip, grid)
    # a grid step with no value is a refused step in clipamp's MLflow runs, which store no non-finite norm; in
    # another log (a CSV, TensorBoard, a Trainer state) it is a step not logged, nothing to diagnose
    refused = series.rows is None and series.name == "grad_l2_pre_clip"
    rows = diagnosis_rows(replayed if refused else series)
    return Recommendation(series, grid, clip, diagnose(rows), notes)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        options = options_from(args)
        found = [recommend(p, options, args) for p in args.paths]
        store = None
        if args.track:
            from sweep.recommend.track import open_store

            store = open_store(args.tracking_uri, args.experiment)
    except UserError as e:
        fail(for_commands(str(e)))
    console = Console(soft_wrap=True)
    for i, rec in enumerate(found):
        if i:
            console.print()
        print_report(rec, console)
    if store is not None:
        from sweep.recommend.track import log_recommendation

        for rec in found:
            run_id = log_recommendation(*store, rec)
            console.print(f"MLflow run {run_id} in experiment {args.experiment!r}", markup=False, highlight=False)
    return 0
