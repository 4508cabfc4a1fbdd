"""One trial of a study: suggest (dtype, max_norm), train it as a child run, tell Optuna how it ended.

Pruned → PRUNED in Optuna, its child run KILLED with tags ``pruned=true`` and ``pruned_by`` (the
reason) and its ratios over the steps it ran; an exception → FAIL / FAILED with tag ``error`` (the
sweep goes on); a user mistake or Ctrl-C → FAIL, and the sweep stops.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from sweep.commands import python_command
from sweep.config.convert import child_config
from sweep.config.schema import Config
from sweep.errors import UserError, clip_words
from sweep.experiments.study.progress import TrialProgress
from sweep.experiments.study.pruning import CLIP_COUNTS, BandPruner, band_verdict, seconds_saved
from sweep.experiments.study.storage import StorageLost, storage_unreachable
from sweep.experiments.study.trial_launch import run_job
from sweep.results.study import KILLED_OUTCOME
from sweep.run.loop import RunRecords, StopRun
from sweep.run.pipeline import RunHooks, RunResult, RunSpec, run_training
from sweep.run.summary import tau_tags
from sweep.tracking.busy import locked_reason
from sweep.tracking.outbox import PENDING, amend_pending, unreachable
from sweep.tracking.tracker import RunTracker, Store, log_metrics, redact, redact_text, upload_dir


class Pruned(optuna.TrialPruned, StopRun):
    """A pruned trial: Optuna's signal, and its child run ends KILLED."""


@dataclass
class Counters:
    """This invocation's accounting: optimizer steps the trials ran, pruned/failed trials, pruning cost."""

    steps_run: int = 0
    pruned: int = 0
    failed: int = 0
    seconds_saved: float = 0.0
    prune_overhead: float = 0.0


@dataclass
class TrialContext:
    """What every trial of one invocation shares."""

    cfg: Config
    study: Any  # optuna.Study
    storage: Any  # optuna.storages.RDBStorage (heartbeats)
    store: Store
    parent_run_id: str
    lo: float  # max_norm range
    hi: float
    ui: TrialProgress
    artifacts: Callable | None = None  # the child runs' report hook (RunHooks.artifacts)
    counters: Counters = field(default_factory=Counters)


def trial_config(cfg: Config, dtype: str, max_norm: float) -> Config:
    c = child_config(cfg)
    c.amp.dtype, c.clip.max_norm = dtype, float(max_norm)
    return c


class _Watch:
    """Sees every step of a trial: heartbeats, the records so far, the pruning reports."""

    def __init__(self, ctx: TrialContext, trial) -> None:
        s = ctx.cfg.study
        self.ctx, self.trial, self.s = ctx, trial, s
        self.prunable = s.mode == "constrained" and s.pruner != "none"
        self.records = RunRecords()  # the steps this trial ran, also when it is stopped early
        self.window: list[float] = []
        self.taken = self.clipped = 0
        pruner = ctx.study.pruner
        self.band = pruner if self.prunable and isinstance(pruner, BandPruner) else None
        self.beat, self.below_kept = time.monotonic(), False
        self.starts: list[float] = []  # when its first two steps started (the training loop's own time)
        self.stopped: float | None = None  # when the pruner stopped it
        ctx.storage.record_heartbeat(trial._trial_id)  # ask/tell has no heartbeat thread: beat from the loop

    def on_batch(self, step: int, batch):
        if len(self.starts) < 2:
            self.starts.append(time.perf_counter())
        return batch

    def on_step(self, log) -> None:
        ctx, s = self.ctx, self.s
        if time.monotonic() - self.beat >= s.heartbeat_interval:  # this worker is alive
            ctx.storage.record_heartbeat(self.trial._trial_id)
            self.beat = time.monotonic()
        self.records.rows.append(log.row())
        ctx.counters.steps_run += 1
        ctx.ui.step(log.step)
        if not self.prunable:
            return
        if not log.skipped:
            self.taken += 1
            self.clipped += bool(log.clipped)
        if math.isfinite(log.loss):
            self.window.append(float(log.loss))
        if log.step >= ctx.cfg.steps:  # the last step: pruning saves nothing and would lose the finished trial
            return
        t = time.perf_counter()
        verdict = self.band and band_verdict(
            log.step, self.taken, self.clipped, ctx.cfg.steps, self.band.band, self.band.below_after
        )
        if verdict == "below" and self.below_kept and log.step % s.report_every:
            verdict = None  # kept below the band (no feasible trial yet): asked again at report steps only
        if verdict:  # the clipping ratio can no longer end in the band: tell the pruner the counts, ask it
            self.trial.set_user_attr(CLIP_COUNTS, [log.step, self.taken, self.clipped])
            self.ask(log.step, t, f"clipping ratio {self.clipped}/{self.taken}: ends {verdict} the band")
            self.below_kept = True  # not pruned: only a below-band verdict is ever kept
        elif log.step % s.report_every == 0 and self.window:
            self.trial.report(sum(self.window) / len(self.window), log.step)
            self.window.clear()
            self.ask(log.step, t, "training loss")

    def ask(self, step: int, t0: float, reason: str) -> None:
        """``trial.should_prune()``; True raises ``Pruned`` (its reason kept in user attr ``pruned_by``)."""
        prune = self.trial.should_prune()
        self.ctx.counters.prune_overhead += time.perf_counter() - t0
        if prune:
            self.stopped = time.perf_counter()
            self.trial.set_user_attr("pruned_by", reason)
            raise Pruned(f"trial {self.trial.number} pruned at step {step}: {reason}")

    def constrain(self, clip_ratio: float) -> None:
        """Constrained mode: the clipping ratio must lie in the target band (``trial.set_constraint``)."""
        if self.s.mode == "constrained" and math.isfinite(clip_ratio):
            self.trial.set_constraint("clip_ratio_low", self.s.target_clip[0] - clip_ratio)
            self.trial.set_constraint("clip_ratio_high", clip_ratio - self.s.target_clip[1])

    def ran_on(self, late: list) -> None:
        """The records of steps that ran after the pruning decision (deferred records: up to a flush)."""
        self.records.rows += [log.row() for log in late]
        self.ctx.counters.steps_run += len(late)

    def partial_metrics(self) -> dict[str, float]:
        """clip/skip ratios and final loss over the steps a stopped trial did run."""
        r = self.records
        return {
            "clip_ratio": r.clip_ratio(),
            "skip_ratio": r.skip_ratio(),
            "final_loss": r.final_loss(),
            "steps_run": float(len(r.rows)),
        }


class TrackingServerLost(UserError):
    """The tracking server stopped answering the trial's bookkeeping: the sweep stops (exit 1) with one line.

    It names the trial marked FAIL and the folders whose ``pending.json`` keeps what the server did not
    take, found when the line is printed: after the parent run's own end-of-run wait has kept its part."""

    status = 1

    def __init__(self, uri: str, reason: str, number: int, folders: list[Path]) -> None:
        super().__init__(reason)
        self.uri, self.reason, self.number, self.folders = uri, reason, number, folders

    def __str__(self) -> str:
        head = (
            f"the tracking server {self.uri} stopped answering ({self.reason}), so the sweep stops; trial "
            f"{self.number} is marked FAIL in the study"
        )
        kept = [str(f) for f in dict.fromkeys(self.folders) if (f / PENDING).is_file()]
        if not kept:
            return f"{head}; once the server answers, re-run the same command to go on with the study"
        sends = " and ".join(f"`{python_command('sweep.resend')} {f}`" for f in kept)
        return (
            f"{head}; what the server did not take is kept locally ({PENDING} with each run's artifacts) in "
            f"{', '.join(kept)}: once it answers, send it with {sends}, then re-run the same command to go on "
            "with the study"
        )


def run_trial(ctx: TrialContext, trial) -> None:
    """Suggest, train (one child run), tell Optuna. Pruned → PRUNED/KILLED, exception → FAIL/FAILED; a
    tracking server that stops answering the bookkeeping → FAIL, and the sweep stops (``TrackingServerLost``)."""
    heard: list[str] = []  # what the trial's run announces: its steps.csv path first
    try:
        _run_trial(ctx, trial, heard.append)
    except Exception as e:
        if storage_unreachable(e) is not None:  # the study's database went away: run_sweep says so in one line
            _storage_lost(ctx, trial, e)
        if not unreachable(e):
            raise
        raise _server_lost(ctx, trial, e, heard) from None


def _storage_lost(ctx: TrialContext, trial, e: Exception) -> None:
    """The trial's run ends FAILED (it may have ended FINISHED before the study's write failed): the study
    cannot take its result, and the same command re-runs its parameters once the database answers."""
    with contextlib.suppress(Exception):  # a tracking server away too: sweep.report shows what it holds
        run_id = child_run_id(ctx.store, ctx.parent_run_id, trial.number)
        if run_id:
            error = f"the Optuna storage stopped answering: {StorageLost('', e).reason}"
            end_child(ctx.store, run_id, "FAILED", {"outcome": "failed", "error": error}, {})


def _server_lost(ctx: TrialContext, trial, e: Exception, heard: list[str]) -> TrackingServerLost:
    """FAIL the trial (where the study's storage answers), its kept run ending FAILED too once re-sent."""
    reason = clip_words(redact_text(str(e)), 160)
    folders = [Path(line.split(": ", 1)[1]).parent for line in heard[:1] if line.startswith("steps.csv: ")]
    error = f"the tracking server stopped answering: {reason}"
    for folder in folders:
        amend_pending(folder, "FAILED", {"outcome": "failed", "error": error})
    with contextlib.suppress(Exception):  # a storage that is away too: its heartbeat rule fails the trial later
        trial.set_user_attr("error", error)
        ctx.study.tell(trial, state=TrialState.FAIL)
        ctx.counters.failed += 1
        ctx.ui.end_trial(trial.number, "FAIL", error)
    return TrackingServerLost(redact(ctx.store.uri), reason, trial.number, [*folders, upload_dir(ctx.parent_run_id)])


def _run_trial(ctx: TrialContext, trial, announce: Callable[[str], None]) -> None:
    cfg = ctx.cfg
    trial.set_user_attr("parent_run_id", ctx.parent_run_id)  # first: names the worker that runs it (workers.py)
    try:
        dtype = trial.suggest_categorical("dtype", list(cfg.study.dtypes))
        max_norm = trial.suggest_float("max_norm", ctx.lo, ctx.hi, log=True)
    except BaseException:  # never leave the trial RUNNING (nothing else would end it)
        ctx.study.tell(trial, state=TrialState.FAIL)
        raise
    n = trial.number
    ctx.ui.start_trial(n, dtype, max_norm, cfg.steps)
    t0 = time.perf_counter()
    watch = _Watch(ctx, trial)
    for k, v in {"trial": n, "dtype": dtype, "max_norm": max_norm, "seed": cfg.seed}.items():
        trial.set_user_attr(k, v)
    spec = RunSpec(
        f"trial-{n}-{dtype}-{max_norm:.3g}",
        parent_run_id=ctx.parent_run_id,
        tags={
            "sweep_role": "trial",
            "study": ctx.study.study_name,
            "trial": str(n),
            "max_norm": f"{max_norm:.6g}",
            "sweep_parent": ctx.parent_run_id,
        },
    )
    hooks = RunHooks(step=watch.on_step, batch=watch.on_batch, artifacts=ctx.artifacts, announce=announce)
    try:
        result = _train(ctx, trial, trial_config(cfg, dtype, max_norm), spec, hooks, watch)
    except optuna.TrialPruned as e:
        watch.ran_on(getattr(e, "late", []))
        _tell_pruned(ctx, trial, watch, time.perf_counter() - t0)
    except (KeyboardInterrupt, UserError) as e:
        if isinstance(e, KeyboardInterrupt):
            _mark_killed(ctx, trial, watch, time.perf_counter() - t0)
        ctx.study.tell(trial, state=TrialState.FAIL)
        raise
    except Exception as e:
        _tell_failed(ctx, trial, watch, spec, time.perf_counter() - t0, e)
    else:
        _tell_complete(ctx, trial, watch, result, time.perf_counter() - t0)


def _train(ctx: TrialContext, trial, cfg: Config, spec: RunSpec, hooks: RunHooks, watch: _Watch) -> RunResult:
    """The trial's child run: in this process, or as a torchrun job (``study.nproc_per_trial`` > 1) whose
    logged metrics and steps.csv rows are the trial's."""
    s = ctx.cfg.study
    if s.nproc_per_trial == 1:
        return run_training(cfg, ctx.store, spec, hooks)
    result = run_job(
        cfg,
        spec,
        ctx.store,
        s.nproc_per_trial,
        lambda: ctx.storage.record_heartbeat(trial._trial_id),
        s.heartbeat_interval,
    )
    watch.records.rows = result.records.rows
    ctx.counters.steps_run += len(result.records.rows)
    return result


def _tell_pruned(ctx: TrialContext, trial, watch: _Watch, wall: float) -> None:
    part, ran = watch.partial_metrics(), len(watch.records.rows)
    by = str(trial.user_attrs.get("pruned_by", "pruner"))
    watch.constrain(part["clip_ratio"])
    run_id = child_run_id(ctx.store, ctx.parent_run_id, trial.number)
    set_attrs(trial, {**part, "wall_s": wall, "run_id": run_id or ""})
    if run_id:
        end_child(
            ctx.store,
            run_id,
            "KILLED",
            {"pruned": "true", "outcome": "pruned", "pruned_at_step": str(ran), "pruned_by": by}
            | tau_tags(watch.records.rows),  # what finish() sets for a run that ends
            part,
        )
    ctx.study.tell(trial, state=TrialState.PRUNED)
    ctx.counters.pruned += 1
    ctx.counters.seconds_saved += seconds_saved(ctx.cfg.steps - ran, ran, watch.starts, watch.stopped)
    ctx.ui.end_trial(trial.number, "PRUNED", f"pruned at step {ran} ({by}), train loss {part['final_loss']:.4g}")


def _mark_killed(ctx: TrialContext, trial, watch: _Watch, wall: float) -> None:
    """A signal stopped the trial (its run ended KILLED): FAIL in Optuna, with what its run holds (run id, the
    steps it ran, partial figures) and ``outcome=killed``, so the sweep's table says KILLED as sweep.report does;
    its run gets the same figures and its τ tags."""
    try:
        run_id = child_run_id(ctx.store, ctx.parent_run_id, trial.number) or ""
    except Exception:  # the store is away: the run id stays unknown here, sweep.report finds the run
        run_id = ""
    part = watch.partial_metrics()
    set_attrs(trial, {**part, "wall_s": wall, "run_id": run_id, "outcome": KILLED_OUTCOME})
    if run_id and watch.records.rows:  # its run says the same figures, and its τ, as a pruned or failed one
        with contextlib.suppress(Exception):
            log_metrics(ctx.store.client, run_id, part, step=0, tags=tau_tags(watch.records.rows))


def _tell_failed(ctx: TrialContext, trial, watch: _Watch, spec: RunSpec, wall: float, e: Exception) -> None:
    reason = locked_reason(e) or redact_text(f"{type(e).__name__}: {' '.join(str(e).split())}")[:500]
    part = watch.partial_metrics()
    run_id = child_run_id(ctx.store, ctx.parent_run_id, trial.number)
    if run_id is None:  # failed before run_training opened its run: record one anyway
        tracker = RunTracker(
            ctx.store.client,
            ctx.store.experiment_id,
            spec.name,
            tags={**ctx.store.tags, **spec.tags},
            parent_run_id=ctx.parent_run_id,
        )
        tracker.end("FAILED")
        run_id = tracker.run_id
    set_attrs(trial, {**part, "wall_s": wall, "run_id": run_id, "error": reason})
    taus = tau_tags(watch.records.rows) if watch.records.rows else {}
    end_child(ctx.store, run_id, "FAILED", {"outcome": "failed", "error": reason} | taus, part)
    ctx.study.tell(trial, state=TrialState.FAIL)
    ctx.counters.failed += 1
    ctx.ui.end_trial(trial.number, "FAIL", reason)


def _tell_complete(ctx: TrialContext, trial, watch: _Watch, result: RunResult, wall: float) -> None:
    m, client, ran = result.metrics, ctx.store.client, float(len(watch.records.rows))
    values = {
        "eval_loss": m.get("eval_loss", math.nan),
        "clip_ratio": m.get("clip_ratio", math.nan),
        "skip_ratio": m.get("skip_ratio", math.nan),
        "final_loss": m.get("final_loss", math.nan),
        "steps_run": ran,
        "wall_s": wall,
    }
    set_attrs(trial, {**values, "run_id": result.run_id})
    client.set_tag(result.run_id, "outcome", "complete")
    client.log_metric(result.run_id, "steps_run", ran, step=ctx.cfg.steps)
    if not (math.isfinite(values["eval_loss"]) and math.isfinite(values["clip_ratio"])):
        reason = f"non-finite eval loss ({values['eval_loss']}) or clipping ratio ({values['clip_ratio']})"
        trial.set_user_attr("error", reason)
        end_child(ctx.store, result.run_id, "FAILED", {"outcome": "failed", "error": reason}, {})
        ctx.study.tell(trial, state=TrialState.FAIL)
        ctx.counters.failed += 1
        ctx.ui.end_trial(trial.number, "FAIL", reason)
        return
    watch.constrain(values["clip_ratio"])
    pareto = ctx.cfg.study.mode == "pareto"
    ctx.study.tell(trial, [values["eval_loss"], values["clip_ratio"]] if pareto else values["eval_loss"])
    ctx.ui.end_trial(
        trial.number,
        "COMPLETE",
        f"eval {values['eval_loss']:.4g}  clip {values['clip_ratio']:.1%}  "
        f"skip {values['skip_ratio']:.1%}  ({wall:.1f} s)",
    )


def child_run_id(store: Store, parent_run_id: str, number: int) -> str | None:
    runs = store.client.search_runs(
        [store.experiment_id],
        max_results=1,
        filter_string=(f"tags.`mlflow.parentRunId` = '{parent_run_id}' and tags.trial = '{number}'"),
    )
    return runs[0].info.run_id if runs else None


def set_attrs(trial, values: dict[str, Any]) -> None:
    for k, v in values.items():
        trial.set_user_attr(k, v if not isinstance(v, float) or math.isfinite(v) else None)


def end_child(store: Store, run_id: str, status: str, tags: dict[str, str], metrics: dict[str, float]) -> None:
    """Close a trial's child run that ``run_training`` did not finish: its tags, metrics and status."""
    log_metrics(store.client, run_id, metrics, step=0, tags=tags)
    store.client.set_terminated(run_id, status=status)
