"""One tracked training run: open (or resume) the MLflow run, build the engine, loop, summarise.

``run_training`` serves every experiment: ``calibrate`` (windows, then train at the recommended
τ), ``train`` (the configured clip policy throughout), each sweep trial and each spike arm.
What differs between them is a ``RunSpec`` (what the run is) and ``RunHooks`` (what the caller
adds to it); presentation (report.md, plots) comes from the caller through ``hooks.artifacts``,
so this layer never imports ``sweep.report``.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from clipamp_engine import CalibratedClip, StepCSVWriter, StepLog
from clipamp_engine.calibration import CalibrationError, CalibrationSummary
from sweep.config.convert import flat_params
from sweep.config.schema import Config
from sweep.distributed.launch import Launch
from sweep.errors import UserError, one_line
from sweep.run.artifacts import logged_params, write_data_artifacts
from sweep.run.build import build_faulted_state
from sweep.run.calibration import calibration_metrics
from sweep.run.checkpoint import (
    checkpoint_path,
    find_resumable,
    load_checkpoint,
    load_resumable,
    lock_run,
    release_run,
    remove_checkpoint,
    restore_run_checkpoint,
    save_run_checkpoint,
)
from sweep.run.diskspace import SpaceReserve, disk_full, full_disk_error
from sweep.run.faults import FaultInjector
from sweep.run.loop import APP_COLUMNS, RunInterrupted, RunRecords, StopRequest, StopRun, run_steps
from sweep.run.nothing_trained import nothing_trained
from sweep.run.resume_csv import NoCSV, open_steps_csv, resumed_rows
from sweep.run.resume_length import check_resume_steps, record_resumed_length
from sweep.run.summary import summary_metrics, tau_tags, window_metrics
from sweep.tasks.build import Batch, Task, build_task, evaluate
from sweep.tracking.busy import store_locked
from sweep.tracking.tracker import RunTracker, SilentTracker, Store, source_tags


@dataclass
class RunResult:
    """What a run measured (the same figures it logged to MLflow)."""

    run_id: str
    csv_path: Path | None  # None on ranks other than 0
    metrics: dict[str, float]
    windows: list[CalibrationSummary] = field(default_factory=list)
    records: RunRecords = field(default_factory=RunRecords)
    status: str = "FINISHED"
    calibration: CalibratedClip | None = None  # a calibrate run's policy: placement, checks, drift
    earlier_lengths: list[dict] = field(default_factory=list)  # a resume's: resume_length.resumed_length_tags


@dataclass
class RunSpec:
    """What the run is: its MLflow name, its parent and extra tags."""

    name: str
    parent_run_id: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    task: Task | None = None  # a task built by the caller (e.g. with a wrapped loss); default: from cfg


@dataclass
class RunHooks:
    """What a caller adds to a run; every hook is optional."""

    batch: Callable[[int, Batch], Batch] | None = None  # may replace the batch of a step (spike)
    step: Callable[[StepLog], None] | None = None  # sees every record; may raise StopRun (pruning)
    artifacts: Callable[[Config, RunTracker, RunResult], None] | None = None  # reports, plots
    announce: Callable[[str], None] = print
    flush_after: Callable[[int], bool] | None = None  # steps whose records a batch hook reads (spike)


def run_training(
    cfg: Config, store: Store, spec: RunSpec, hooks: RunHooks | None = None, launch: Launch | None = None
) -> RunResult:
    """Train ``cfg`` for ``cfg.steps`` steps inside one MLflow run and return its figures.

    Every ``cfg.checkpoint_every`` steps, and on SIGINT/SIGTERM at the next step boundary, a
    checkpoint is written; the run then ends KILLED. ``cfg.resume`` (``true`` or a run id)
    continues such a run from its checkpoint, appending to the same ``steps.csv`` and MLflow run.
    The CSV keeps every completed step. Under torchrun (``launch``) every rank trains its share
    of each batch and rank 0 alone records. A signal in the end-of-run phase (eval, artifacts, plots)
    waits for it: the run ends FINISHED, then ``RunInterrupted(finished=True)`` (or, inside a sweep,
    the sweep stops before its next trial); a second signal cuts it short: KILLED, resumable as a kill in the loop.
    """
    hooks = hooks or RunHooks()
    launch = launch or Launch()
    torch.manual_seed(cfg.seed)
    task = spec.task or build_task(cfg.model, cfg.data, seed=cfg.seed, device=cfg.device)
    task = dataclasses.replace(task, model=launch.wrap(task.model, cfg.device))  # train_batches stay global
    state, faults = build_faulted_state(cfg, task.model, task.loss_fn)  # a refused option: before a run opens
    with StopRequest(launch.any) as stop:  # one signal-safe path: opening, the loop and the end-of-run phase
        tracker, ckpt, lock = open_run_on_ranks(cfg, store, spec, task, launch)
        reserve = SpaceReserve(checkpoint_path(store.uri, tracker.run_id).with_name("space.reserve") if lock else None)
        status = "KILLED" if ckpt is not None else "FAILED"  # a resume that cannot start leaves the run KILLED
        try:
            run = _ActiveRun.start(cfg, tracker, task, hooks, ckpt, store.uri, launch, state, faults)
            status = "FAILED"
            try:
                run.loop(stop)
            except KeyboardInterrupt as e:
                status = "KILLED"
                e.run_ended, e.checkpointed = status, run.checkpointed  # the CLI's line says what is left
                raise
            except StopRun as e:
                status = e.status
                raise
            except Exception as e:  # under torchrun: this rank's bug (FAILED), another rank's failure or death (KILLED)
                if isinstance(e, UserError) or not launch.distributed:
                    raise
                failure = launch.diagnose(e).kept(run.records.last_step, run.checkpointed)
                status = failure.status
                raise failure from None
            try:
                result = run.finish()  # a first signal here waits for it; a second one cuts it short
            except KeyboardInterrupt:
                status = "KILLED"
                raise run.cut_short(stop.signum or signal.SIGINT) from None
            nothing = nothing_trained(run.records.rows, cfg.run)
            if nothing is not None:
                status = "FAILED"
                tracker.set_tags({"failure_reason": str(nothing)})
                raise nothing
            status = "FINISHED"
        except Exception as e:  # a full disk or a store locked for LOCK_WAIT_S: KILLED if resumable
            full = disk_full(e)
            if full is None and not store_locked(e):
                raise
            status = "KILLED" if checkpoint_path(store.uri, tracker.run_id).exists() else "FAILED"
            if full is None:
                raise  # the CLI's one line (sweep.tracking.busy)
            raise full_disk_error(e, reserve, resumable=status == "KILLED") from None
        finally:
            reserve.release()
            try:
                tracker.end(status)
            finally:
                if lock is not None:
                    release_run(lock, finished=status == "FINISHED")
    if stop.signum is not None and not stop.pass_on():
        raise RunInterrupted(stop.signum, cfg.steps, finished=True)
    return result


def open_run(cfg: Config, store: Store, spec: RunSpec, task: Task) -> tuple[RunTracker, dict | None, Any]:
    """A new MLflow run (its tags and params logged), or the run ``cfg.resume`` names with its checkpoint;
    with the run's lock, held until the run ends."""
    flush = cfg.tracking.flush_every
    if cfg.resume:
        run_id = find_resumable(store.client, store.experiment_id, spec.name, store.uri, str(cfg.resume))
        lock = lock_run(store.uri, run_id)
        try:
            where = (store.client, store.experiment_id, spec.name, store.uri, run_id)
            run_id, ckpt = load_resumable(*where, logged_params(cfg), task.description)
            check_resume_steps(cfg, ckpt, run_id)  # a lower steps= only where the remaining steps train alike
            tracker = RunTracker.reopen(store.client, run_id, flush_every=flush, upto=ckpt["step"])
            record_resumed_length(tracker, store.client.get_run(run_id).data.tags, ckpt, cfg.steps)
            return tracker, ckpt, lock
        except BaseException:
            lock.release()
            raise
    tags = {
        **source_tags(),
        "run": cfg.run or "",
        "dtype": cfg.amp.dtype,
        "device": cfg.device,
        "model": cfg.model.name,
        "data": cfg.data.name,
        "clip": cfg.clip.mode,
        "task": task.description,
        **store.tags,
        **spec.tags,
    }
    tracker = RunTracker(
        store.client, store.experiment_id, spec.name, tags=tags, parent_run_id=spec.parent_run_id, flush_every=flush
    )
    lock = None
    try:
        lock = lock_run(store.uri, tracker.run_id)
        tracker.log_params(flat_params(cfg))
        if task.tokenizer is not None:  # model=hf: the run's data can be re-encoded exactly as it was
            task.tokenizer.save_pretrained(str(tracker.artifact_path("tokenizer")))
    except BaseException:
        tracker.end("FAILED")
        if lock is not None:
            lock.release()
        raise
    return tracker, None, lock


def open_run_on_ranks(
    cfg: Config, store: Store, spec: RunSpec, task: Task, launch: Launch
) -> tuple[RunTracker | SilentTracker, dict | None, Any | None]:
    """``open_run`` on rank 0 (which holds the run's lock); the other ranks get its run id (silently)
    and read the same checkpoint."""
    if not launch.distributed:
        return open_run(cfg, store, spec, task)
    opened: list[tuple[RunTracker, dict | None, Any]] = []

    def on_main() -> tuple[str, str, bool]:
        opened.append(open_run(cfg, store, spec, task))
        tracker, ckpt, _ = opened[0]
        return tracker.run_id, tracker.run_name, ckpt is not None

    run_id, name, resumed = launch.agree(on_main)
    if opened:
        return opened[0]
    ckpt = load_checkpoint(checkpoint_path(store.uri, run_id)) if resumed else None
    return SilentTracker(run_id, name), ckpt, None  # rank 0 holds the run's lock for the job


@dataclass
class _ActiveRun:
    """The parts of a run while it trains: engine, CSV, faults, records."""

    cfg: Config
    tracker: RunTracker
    task: Task
    hooks: RunHooks
    state: Any  # AmpTrainState
    faults: FaultInjector
    writer: StepCSVWriter
    records: RunRecords
    start_step: int
    ckpt_file: Path
    launch: Launch
    windows_seen: int = 0  # calibration windows already logged
    earlier_lengths: list[dict] = field(default_factory=list)  # the run's lengths before a resume changed it
    checkpointed: int | None = None  # the step of the run's latest checkpoint

    @classmethod
    def start(
        cls,
        cfg: Config,
        tracker: RunTracker | SilentTracker,
        task: Task,
        hooks: RunHooks,
        ckpt: dict | None,
        uri: str,
        launch: Launch,
        state: Any,
        faults: FaultInjector,
    ) -> _ActiveRun:
        """Restore the engine ``state`` from ``ckpt`` when resuming, and open the CSV (rank 0)."""
        csv_path = tracker.artifact_path("steps.csv") if launch.is_main else None
        hooks.announce(f"steps.csv: {csv_path}")
        tracker.announce, tracker.reconnect_s = hooks.announce, cfg.tracking.reconnect_s
        start = ckpt["step"] if ckpt else 0
        tracker.set_tags(
            {"pipeline": state.pipeline, "ranks": str(launch.world)}
        )  # update path (clipamp_engine.fused); ranks
        columns = APP_COLUMNS + state.forensics.columns + state.clip.columns
        ckpt_file = checkpoint_path(uri, tracker.run_id)
        run = cls(cfg, tracker, task, hooks, state, faults, NoCSV(), RunRecords(), start, ckpt_file, launch)
        if ckpt is not None:  # decided before anything is written: a refused resume leaves steps.csv as it was
            run.restore(ckpt, csv_path, columns)
        if csv_path is not None:
            run.writer = open_steps_csv(csv_path, columns, start if ckpt else None)
        return run

    def restore(self, ckpt: dict, csv_path: Path | None, columns: tuple[str, ...]) -> None:
        """Engine (calibration windows included) and RNG state from the checkpoint; the records so far
        (for the summary and plots, rank 0) from the CSV's rows, which must be steps 1..the checkpoint's;
        then the per-step metrics of those rows that the tracking store lacks (a kill can cut sends short)."""
        run_id, step = self.tracker.run_id, self.start_step
        self.earlier_lengths = ckpt.get("earlier_lengths", [])
        try:
            restore_run_checkpoint(self.ckpt_file, self.state, ckpt, self.launch)
        except UserError:
            raise
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise UserError(
                f"resume={run_id}: the checkpoint does not fit this model and config "
                f"({one_line(e, 160)}): start a new run (drop resume=)"
            ) from None
        if csv_path is not None:  # rank 0 keeps the records
            self.records.rows = resumed_rows(run_id, csv_path, columns, step)
            for i, row in enumerate(self.records.rows):
                self.tracker.add_step(row["step"], self.records.step_metrics(i))
            self.tracker.flush()
        self.windows_seen = len(self.windows)
        self.checkpointed = step
        self.hooks.announce(f"resumed run {self.tracker.run_id} at step {self.start_step}")

    @property
    def windows(self) -> list[CalibrationSummary]:
        """The calibration windows closed so far (``clip=calibrated``; none for other policies)."""
        return self.state.clip.summaries if isinstance(self.state.clip, CalibratedClip) else []

    @property
    def eval_dtype(self) -> torch.dtype | None:
        return self.state.autocast_dtype if self.cfg.amp.dtype != "fp32" else None

    def record(self, log: StepLog) -> None:
        """After each step: log a window that closed (the engine adopted its τ), periodic eval, the hook."""
        windows = self.windows
        if len(windows) > self.windows_seen and log.step >= windows[-1].end_step:  # at its last step's record
            self.windows_seen = len(windows)
            self.tracker.log_metrics(window_metrics(windows[-1], windows[0]), step=windows[-1].end_step)
        cfg = self.cfg
        if cfg.eval_every and log.step % cfg.eval_every == 0 and log.step != cfg.steps:
            self.tracker.log_metrics({"eval_loss": evaluate(self.task, dtype=self.eval_dtype)}, step=log.step)
        if self.hooks.step is not None:
            self.hooks.step(log)

    def flush_after(self, step: int) -> bool:
        """Eval steps (the eval must see that step's model) and the steps a batch hook reads."""
        every = self.cfg.eval_every
        return bool(every and step % every == 0) or bool(self.hooks.flush_after and self.hooks.flush_after(step))

    def batches(self) -> Iterator[Batch]:
        """This rank's share of the task's batches from the resumed step on (the same data order as an
        uninterrupted run). Faults and ``hooks.batch`` see the global batch, as in one process."""
        stream = self.task.train_batches
        for _ in range(self.start_step):
            next(stream)
        for i, batch in enumerate(stream, start=self.start_step + 1):
            batch = self.faults.batch(i, batch) if self.faults.active else batch
            yield self.launch.shard(self.hooks.batch(i, batch) if self.hooks.batch is not None else batch)

    def checkpoint(self, step: int) -> None:
        where = {"step": step, "run_id": self.tracker.run_id, "steps": self.cfg.steps}  # steps: the run's length
        if save_run_checkpoint(self.ckpt_file, self.state, self.launch, **where):
            self.checkpointed = step
            self.tracker.hold_after(step)  # the store holds the steps this checkpoint holds, no later one

    def loop(self, stop: StopRequest) -> None:
        cfg, clip = self.cfg, self.state.clip
        phase_of = clip.phase if isinstance(clip, CalibratedClip) else (lambda step: "train")
        self.tracker.hold_after(self.start_step if cfg.checkpoint_every else None)  # no step past a checkpoint sent
        with self.writer:
            try:
                run_steps(
                    self.state,
                    self.batches(),
                    range(self.start_step + 1, cfg.steps + 1),
                    writer=self.writer,
                    tracker=self.tracker,
                    records=self.records,
                    phase_of=phase_of,
                    on_record=self.record,
                    progress=cfg.progress and self.launch.is_main,
                    progress_every=cfg.progress_every,
                    label=self.tracker.run_name,
                    stop=stop,
                    checkpoint=self.checkpoint,
                    checkpoint_every=cfg.checkpoint_every,
                    flush_after=self.flush_after,
                )
            except CalibrationError as e:  # every step of a window was skipped
                raise UserError(f"{e}; lengthen calibrate.window, or check amp.dtype and the data") from None

    def finish(self) -> RunResult:
        """Summary metrics (+ the final eval), data artifacts, the caller's artifacts; drop the checkpoint."""
        cal = self.state.clip if isinstance(self.state.clip, CalibratedClip) else None
        eval_loss = evaluate(self.task, dtype=self.eval_dtype)  # on every rank: FSDP2 gathers in forward
        if not self.launch.is_main:
            return RunResult(self.tracker.run_id, None, {"eval_loss": eval_loss}, list(self.windows), self.records)
        metrics = summary_metrics(self.cfg, self.records, self.windows)
        if cal is not None:
            metrics.update(calibration_metrics(cal))
        metrics["eval_loss"] = eval_loss
        self.tracker.log_metrics(metrics, step=self.cfg.steps, summary=True)  # read back by the experiment's notes
        self.tracker.set_tags(tau_tags(self.records.rows))
        csv_path = self.tracker.artifact_path("steps.csv")
        result = RunResult(self.tracker.run_id, csv_path, metrics, list(self.windows), self.records, calibration=cal)
        result.earlier_lengths = self.earlier_lengths
        write_data_artifacts(self.cfg, self.tracker, result.metrics, result.windows, result.calibration)
        if self.hooks.artifacts is not None:
            self.hooks.artifacts(self.cfg, self.tracker, result)
        remove_checkpoint(self.ckpt_file)
        self.tracker.hold_after(None)  # no checkpoint left: nothing trains a step again, the store takes them all
        return result

    def cut_short(self, signum: int) -> RunInterrupted:
        """The end-of-run phase was cut short (the run ends KILLED): with the latest checkpoint still there, the
        store keeps no step after it (a resume trains those again); else every step."""
        e = RunInterrupted(signum, self.cfg.steps, finished=False)
        e.checkpointed = self.checkpointed if self.ckpt_file.exists() else None  # where resume=true continues
        if e.checkpointed is None:
            self.tracker.hold_after(None)
        return e
