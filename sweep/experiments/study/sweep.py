"""``run_sweep``: the sweep's entry point: open or resume the study, run its trials, log the parent."""

from __future__ import annotations

import dataclasses
import signal
import time
import warnings
from contextlib import contextmanager

import optuna
import pandas as pd
import torch
from rich.console import Console

from sweep.commands import python_command
from sweep.config.convert import flat_params
from sweep.config.schema import Config
from sweep.errors import UserError
from sweep.experiments.study.progress import TrialProgress
from sweep.experiments.study.space import (
    check_anchor_run,
    enqueue_dtypes,
    max_norm_range,
    open_parent_run,
    resolve_anchor,
)
from sweep.experiments.study.storage import (
    StorageLost,
    default_storage,
    load_study,
    make_sampler,
    open_storage,
    storage_unreachable,
    stored_attrs,
    study_name,
    task_key,
)
from sweep.experiments.study.trial import TrialContext, run_trial
from sweep.experiments.study.workers import hold_worker, recover_dead_workers, study_lock
from sweep.pick import PICK_RULES, pick_trial
from sweep.report.run import write_run_report
from sweep.report.sweep import print_sweep_summary, write_sweep_report
from sweep.results.study import SweepResult, trials_table
from sweep.run.artifacts import json_text
from sweep.run.checkpoint import release_run
from sweep.run.liveness import DIED, trial_state
from sweep.run.loop import StopRequest
from sweep.tracking.tracker import RunTracker, Store, redact, redact_text


@contextmanager
def optuna_quiet():
    """Optuna 5 marks heartbeats experimental and warns when they are used outside ``Study.optimize``;
    our ask/tell loop records them itself (``trial._Watch``). Silenced here only, not process-wide."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        yield


def run_sweep(cfg: Config, store: Store, console: Console | None = None) -> SweepResult:
    """Create or resume the study, run ``study.n_trials`` trials (child runs), log the parent, pick.

    SIGINT/SIGTERM anywhere in it is taken at the next phase boundary (``honour``: never inside a study
    write), a second one at once: the parent run ends KILLED and the CLI exits 130 with one line."""
    console = console or Console()
    if cfg.study.mode == "entangle":  # the LR check: a grid, not an Optuna search
        from sweep.experiments.study.entangle import run_entangle

        return run_entangle(cfg, store, console)
    with StopRequest() as stop:
        with optuna_quiet():
            try:
                result = _sweep(cfg, store, console, stop)
            except Exception as e:  # the study's database went away mid-sweep: one line, exit 1
                if storage_unreachable(e) is None or isinstance(e, UserError):
                    raise
                raise StorageLost(redact_text(redact(cfg.study.storage or default_storage(store.uri))), e) from None
        with trials_finished(cfg.study.n_trials, "FINISHED"):  # the parent ended: a signal cuts only the summary
            print_sweep_summary(result, uri=redact(store.uri), experiment_id=store.experiment_id, console=console)
            line = unfinished_line(result.trials["state"])
            if line is not None:
                console.print(line)
            honour(stop)
    return result


def honour(stop: StopRequest) -> None:
    """The sweep's phase boundary: a signal it deferred ends it here (``KeyboardInterrupt``, ``at_boundary``:
    no trial's run was training, so the CLI's line names only the parent run)."""
    if stop.signum is not None:
        e = KeyboardInterrupt(signal.Signals(stop.signum).name)
        e.at_boundary = True  # type: ignore[attr-defined]
        raise e


@contextmanager
def trials_finished(n: int, parent: str):
    """Every trial of this invocation ended: an interruption now cut only the report; it tells the CLI
    (``sweep_ended``: how the parent run ended) so its line does not ask to resume the study."""
    try:
        yield
    except KeyboardInterrupt as e:
        e.sweep_ended, e.trials = parent, n
        raise


def unfinished_line(states: pd.Series) -> str | None:
    """What the pick leaves out, or None: trials RUNNING (in other workers), DIED (RUNNING in the study,
    but their worker of this host is dead: the next invocation recovers them) and WAITING (queued, e.g.
    re-enqueued from a dead worker: no worker holds them, the next invocation takes them first)."""
    running, waiting = int((states == "RUNNING").sum()), int((states == "WAITING").sum())
    died = int((states == DIED).sum())
    if not running and not waiting and not died:
        return None
    parts = [f"{running} running in other workers"] if running else []
    if died:
        parts.append(
            f"{died} whose worker died, which the next run of this command recovers (marked FAIL, "
            f"{'its' if died == 1 else 'their'} parameters run again)"
        )
    if waiting:
        parts.append(f"{waiting} queued, which the next run of this command takes first")
    return (
        f"the pick covers the trials finished so far: {' and '.join(parts)}; once they end, "
        f"`{python_command('sweep.report')}` gives the study's pick"
    )


def mark_died(table: pd.DataFrame, client, own_parent: str) -> pd.DataFrame:
    """The RUNNING trials whose worker (another of this host) is provably dead, its lock free, as DIED."""
    tags: dict[str, dict | None] = {}
    for i in table.index[table["state"] == "RUNNING"]:
        parent = table.at[i, "parent_run_id"]
        if not parent or parent == own_parent:
            continue
        if parent not in tags:
            try:
                tags[parent] = client.get_run(parent).data.tags
            except Exception:  # not in this store, or the store is away: this host cannot tell
                tags[parent] = None
        table.at[i, "state"] = trial_state("RUNNING", tags[parent])
    return table


def _sweep(cfg: Config, store: Store, console: Console, stop: StopRequest) -> SweepResult:
    s = cfg.study
    storage_url = s.storage or default_storage(store.uri)
    storage = open_storage(
        storage_url, heartbeat_interval=s.heartbeat_interval, grace_period=s.grace_period, tracking_uri=store.uri
    )
    shown_storage = redact_text(redact(storage_url))
    name = study_name(cfg)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # a run it cannot anchor on: refused before the study is created and before a run opens
    check_anchor_run(cfg, stored_attrs(storage, name), store.client)
    study = load_study(cfg, storage, name)
    parent = open_parent_run(
        cfg, store, f"sweep-{name}", "parent", study=name, study_mode=s.mode, optuna_storage=shown_storage
    )
    with parent:  # ends it if taking the lock fails; otherwise _sweep_as_worker ends it, before the lock goes
        worker = hold_worker(store, parent)
        try:
            return _sweep_as_worker(cfg, store, console, study, storage, storage_url, parent, stop)
        finally:
            release_run(worker, finished=True)


def _sweep_as_worker(
    cfg: Config, store: Store, console: Console, study, storage, storage_url: str, parent: RunTracker, stop: StopRequest
) -> SweepResult:
    s, name = cfg.study, study.study_name
    shown_storage = redact_text(redact(storage_url))
    threads, t0 = torch.get_num_threads(), time.perf_counter()
    try:
        with parent:  # FINISHED, KILLED by Ctrl-C / SIGTERM (as the trial that was training), else FAILED
            honour(stop)  # a signal while the study and the parent run opened
            if s.threads:
                torch.set_num_threads(s.threads)
            # one worker at a time: recovery, anchor, queue, seed
            with study_lock(storage_url, name, console.print, waiting=lambda: honour(stop)):
                prior = len(study.get_trials(deepcopy=False))
                recover_dead_workers(study, store, console.print)
                console.print(
                    f"study {name!r} in {shown_storage}: {prior} trials so far; adding {s.n_trials} "
                    f"({s.mode}, {s.sampler}, dtypes {', '.join(s.dtypes)})"
                )
                swept = {"clip.max_norm": "swept: see the trials", "amp.dtype": f"swept: {', '.join(s.dtypes)}"}
                info = {"study_name": name, "optuna_storage": shown_storage, "trials_before": prior}
                parent.log_params({**flat_params(cfg), **swept, **info})  # not the base config's τ and dtype
                honour(stop)
                anchor = _set_up(cfg, study, store, parent, console, prior, stop)
            ctx = _run_trials(cfg, study, storage, store, parent, console, anchor, stop)
            with trials_finished(s.n_trials, "KILLED"):  # the parent is still open: a signal now ends it KILLED
                honour(stop)  # one passed on by the last trial's end-of-run phase
                result = _result(cfg, study, store, parent, ctx, anchor, shown_storage, t0)
                write_parent_artifacts(parent, result)
                write_sweep_report(parent, result)
                log_parent_summary(parent, result)
                honour(stop)
            return result
    finally:
        torch.set_num_threads(threads)


def _result(
    cfg: Config,
    study,
    store: Store,
    parent: RunTracker,
    ctx: TrialContext,
    anchor: dict[str, float] | None,
    shown: str,
    t0: float,
) -> SweepResult:
    """This invocation's ``SweepResult``: the study's trials table and pick, and this worker's accounting."""
    s = cfg.study
    band = tuple(s.target_clip)
    table = mark_died(trials_table(study, band), store.client, parent.run_id)
    c = ctx.counters
    return SweepResult(
        study_name=study.study_name,
        storage=shown,
        mode=s.mode,
        parent_run_id=parent.run_id,
        trials=table,
        pick=pick_trial(table, band),
        trials_run=s.n_trials,
        pruned=c.pruned,
        failed=c.failed,
        steps_run=c.steps_run,
        steps_budget=s.n_trials * cfg.steps,
        seconds_saved_est=c.seconds_saved,
        prune_overhead_s=c.prune_overhead,
        wall_s=time.perf_counter() - t0,
        anchor=anchor,
        band=band,
    )


def _set_up(
    cfg: Config, study, store: Store, parent: RunTracker, console: Console, prior: int, stop: StopRequest
) -> dict[str, float] | None:
    """Under the study lock: the anchor (one window for the study), the dtype trials enqueued first,
    the sampler seeded with ``cfg.seed`` + the trials the study held before this worker."""
    anchor = resolve_anchor(cfg, study, store, parent.run_id, console.print, artifacts=write_run_report)
    honour(stop)  # the window's run hands a signal from its end-of-run phase up to ``stop``
    study.set_user_attr("task", task_key(cfg))
    enqueue_dtypes(study, list(cfg.study.dtypes), anchor)
    study.sampler = make_sampler(cfg, cfg.seed + prior)
    return anchor


def _run_trials(
    cfg: Config,
    study,
    storage,
    store: Store,
    parent: RunTracker,
    console: Console,
    anchor: dict[str, float] | None,
    stop: StopRequest,
) -> TrialContext:
    """``study.n_trials`` trials; SIGINT/SIGTERM between trials stops before the next one."""
    s = cfg.study
    band = tuple(s.target_clip)

    def best() -> str:
        p = pick_trial(trials_table(study, band), band)
        return f"#{p.trial} {p.dtype} τ={p.max_norm:.3g} loss {p.eval_loss:.4g}" if p else "—"

    lo, hi = max_norm_range(cfg, anchor)
    with TrialProgress(console, cfg.progress, s.n_trials, best, every=cfg.progress_every) as ui:
        ctx = TrialContext(cfg, study, storage, store, parent.run_id, lo, hi, ui, artifacts=write_run_report)
        for _ in range(s.n_trials):
            honour(stop)
            run_trial(ctx, study.ask())
    return ctx


def write_parent_artifacts(tracker: RunTracker, result: SweepResult) -> None:
    """The study's data: trials.csv, pareto.csv, feasible.csv and pick.json (with the rule it applied)."""
    df = result.trials
    df.to_csv(tracker.artifact_path("trials.csv"), index=False)
    df[df["pareto"]].to_csv(tracker.artifact_path("pareto.csv"), index=False)
    df[df["in_band"]].to_csv(tracker.artifact_path("feasible.csv"), index=False)
    pick = dataclasses.asdict(result.pick) if result.pick else None
    tracker.artifact_path("pick.json").write_text(
        json_text(
            {
                "study": result.study_name,
                "storage": result.storage,
                "mode": result.mode,
                "band": list(result.band),
                "pick": pick,
                "override": result.pick.override() if result.pick else None,
                "rule_doc": PICK_RULES,
                "this_invocation": {
                    "trials": result.trials_run,
                    "pruned": result.pruned,
                    "failed": result.failed,
                    "trial_steps_run": result.steps_run,
                    "trial_steps_budget": result.steps_budget,
                    "trial_steps_saved": result.steps_saved,
                    "seconds_saved_est": result.seconds_saved_est,
                    "prune_overhead_s": result.prune_overhead_s,
                    "wall_s": result.wall_s,
                },
                "anchor": result.anchor,
            },
        )
    )


def log_parent_summary(tracker: RunTracker, result: SweepResult) -> None:
    """The parent run's metrics (trial counts, accounting, front and band sizes) and the pick as params/tags."""
    df = result.trials
    states = df["state"].value_counts().to_dict()
    metrics = {
        "trials_total": float(len(df)),
        "trials_complete": float(states.get("COMPLETE", 0)),
        "trials_pruned": float(states.get("PRUNED", 0)),
        "trials_failed": float(states.get("FAIL", 0)),
        "trials_killed": float(states.get("KILLED", 0)),  # FAIL in Optuna: a signal stopped them
        "trials_run": float(result.trials_run),
        "pruned_share": result.pruned_share,
        "trial_steps_run": float(result.steps_run),
        "trial_steps_budget": float(result.steps_budget),
        "trial_steps_saved": float(result.steps_saved),
        "seconds_saved_est": result.seconds_saved_est,
        "prune_overhead_s": result.prune_overhead_s,
        "wall_s": result.wall_s,
        "pareto_size": float(df["pareto"].sum()),
        "in_band_size": float(df["in_band"].sum()),
    }
    tags = {"pick_rule": result.pick.rule if result.pick else "none"}
    if result.pick:
        p = result.pick
        metrics.update(
            pick_max_norm=p.max_norm,
            pick_eval_loss=p.eval_loss,
            pick_clip_ratio=p.clip_ratio,
            pick_trial=float(p.trial),
        )
        tags.update(
            pick_dtype=p.dtype, pick_max_norm=f"{p.max_norm:.6g}", pick_trial=str(p.trial), pick_override=p.override()
        )
        tracker.log_params(
            {"pick_dtype": p.dtype, "pick_max_norm": f"{p.max_norm:.6g}", "pick_trial": p.trial, "pick_rule": p.rule}
        )
    tracker.log_metrics(metrics, step=len(df))
    tracker.set_tags(tags)
