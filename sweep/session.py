"""One tracked training run: task, engine, CSV, MLflow run, calibration windows, summary, artifacts.

``run_training`` serves every experiment: ``calibrate`` (windows, then train at the recommended
τ), ``train`` (the configured clip policy throughout) and each sweep trial.
"""

from __future__ import annotations

import json
import math
import subprocess
from types import SimpleNamespace
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from clipamp_engine import GlobalNormClip, NoClip, StepCSVWriter, StepLog
from clipamp_engine.calibration import REPORTED_QUANTILES, CalibrationSummary, NormCalibrator, quantiles

from .config import Config
from .checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from .errors import UserError
from .faults import FaultInjector
from .loop import APP_COLUMNS, RunRecords, StopRequest, StopRun, run_steps
from .tasks.build import Task, build_task, evaluate
from .tracking import RunTracker, redact_text, sqlite_path
from .training import build_state


@dataclass
class RunResult:
    """What a run measured (the same figures it logged to MLflow)."""

    run_id: str
    csv_path: Path
    metrics: dict[str, float]
    windows: list[CalibrationSummary] = field(default_factory=list)
    records: RunRecords = field(default_factory=RunRecords)
    status: str = "FINISHED"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def window_ranges(cfg: Config) -> list[range]:
    """Calibration windows as 1-based step ranges: the first at step 1, then every ``every`` steps."""
    c = cfg.calibrate
    starts = [1] + (list(range(1 + c.every, cfg.steps + 1, c.every)) if c.every else [])
    windows = [range(s, min(s + c.window, cfg.steps + 1)) for s in starts]
    return [w for w in windows if len(w) >= 2]  # a window cut short by the end of the run needs 2 steps


def _config_dict(cfg: Config) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


class WindowSchedule:
    """Calibration windows of one run: feed records in, get a summary as each window closes."""

    def __init__(self, cfg: Config, windows: list[range]) -> None:
        self.calibrators = {w.start: NormCalibrator(cfg.calibrate.quantile, cfg.calibrate.candidates) for w in windows}
        self.window_of = {s: w for w in windows for s in w}
        self.summaries: list[CalibrationSummary] = []

    def phase(self, step: int) -> str:
        return "calibrate" if step in self.window_of else "validate"

    def observe(self, log: Any) -> CalibrationSummary | None:
        w = self.window_of.get(log.step)
        if w is None:
            return None
        cal = self.calibrators[w.start]
        cal.add(log)
        if log.step != w[-1]:
            return None
        try:
            summary = cal.summary()
        except ValueError as e:  # every step of the window was skipped
            raise UserError(f"{e}; lengthen calibrate.window, or check amp.dtype and the data") from None
        self.summaries.append(summary)
        return summary


def checkpoint_path(uri: str, run_id: str) -> Path:
    """Local checkpoint of a run: beside a sqlite store, else under ./mlruns/checkpoints/."""
    db = sqlite_path(uri)
    root = db.parent / "checkpoints" if db is not None else Path("mlruns") / "checkpoints"
    return root / run_id / CHECKPOINT_NAME


def find_resumable(client, experiment_id: str, run_name: str, uri: str, resume: str) -> str:
    """The run id to resume: ``resume`` itself, or the latest run named ``run_name`` with a checkpoint."""
    if resume.lower() not in ("true", "last"):
        try:
            client.get_run(resume)
        except Exception:
            raise UserError(f"resume={resume!r} is not a run id in this tracking store; "
                            f"use resume=true for the latest run named {run_name!r}") from None
        return resume
    runs = client.search_runs([experiment_id], filter_string=f"attributes.run_name = '{run_name}'",
                              order_by=["attributes.start_time DESC"], max_results=50)
    for run in runs:
        if checkpoint_path(uri, run.info.run_id).exists():
            return run.info.run_id
    raise UserError(f"resume=true: no run named {run_name!r} with a checkpoint in experiment "
                    f"{experiment_id}; start a new run (drop resume=) or pass resume=RUN_ID")


def run_training(
    cfg: Config,
    client,
    experiment_id: str,
    *,
    run_name: str,
    calibrate: bool,
    parent_run_id: str | None = None,
    tags: dict[str, str] | None = None,
    batch_hook: Callable[[int, Any], Any] | None = None,
    on_step: Callable[[StepLog], None] | None = None,
    task: Task | None = None,
    announce: Callable[[str], None] = print,
    uri: str | None = None,
) -> RunResult:
    """Train ``cfg`` for ``cfg.steps`` steps inside one MLflow run and return its figures.

    ``batch_hook(step, batch) -> batch`` may replace a batch (spikes); ``cfg.faults`` injects
    faults; ``on_step(log)`` sees every record (sweep pruning). Every ``cfg.checkpoint_every``
    steps, and on SIGINT/SIGTERM at the next step boundary, a checkpoint is written; the run then
    ends KILLED. ``cfg.resume`` (``true`` or a run id) continues such a run from its checkpoint,
    appending to the same ``steps.csv`` and MLflow run. The CSV keeps every completed step.
    """
    uri = uri or client.tracking_uri
    torch.manual_seed(cfg.seed)
    task = task or build_task(cfg.model, cfg.data, seed=cfg.seed, device=cfg.device)
    resume_id = find_resumable(client, experiment_id, run_name, uri, str(cfg.resume)) if cfg.resume else None
    ckpt = None
    if resume_id is not None:
        path = checkpoint_path(uri, resume_id)
        if not path.exists():
            raise UserError(f"resume={resume_id}: no checkpoint at {path}; the run cannot be resumed")
        ckpt = load_checkpoint(path)
        if ckpt["step"] >= cfg.steps:
            raise UserError(f"resume={resume_id}: the checkpoint is at step {ckpt['step']} >= steps={cfg.steps}; "
                            f"raise steps= to train further")
        tracker = RunTracker.reopen(client, resume_id, flush_every=cfg.tracking.flush_every)
    else:
        all_tags = {"run": cfg.run or "", "dtype": cfg.amp.dtype, "device": cfg.device, "model": cfg.model.name,
                    "data": cfg.data.name, "clip": cfg.clip.mode, "git_commit": git_commit(),
                    "task": task.description}
        all_tags.update(tags or {})
        tracker = RunTracker(client, experiment_id, run_name, tags=all_tags, parent_run_id=parent_run_id,
                             flush_every=cfg.tracking.flush_every)
    status = "FAILED"
    ckpt_file = checkpoint_path(uri, tracker.run_id)
    try:
        if ckpt is None:
            tracker.log_params(flatten(_config_dict(cfg)))
        csv_path = tracker.artifact_path("steps.csv")
        announce(f"steps.csv: {csv_path}")
        start = ckpt["step"] if ckpt else 0
        schedule = WindowSchedule(cfg, window_ranges(cfg) if calibrate else [])
        first = None  # the configured policy, built with the optimizer
        if schedule.window_of:
            first = GlobalNormClip(cfg.calibrate.cap) if cfg.calibrate.cap else NoClip()
        faults = FaultInjector(cfg.faults, task.model, task.loss_fn)
        state = build_state(cfg, task.model, faults.loss_fn if faults.active else task.loss_fn, first)
        tracker.set_tags({"pipeline": state.pipeline})  # fused or default update path (clipamp_engine.fused)
        columns = APP_COLUMNS + state.forensics.columns + state.clip.columns
        writer = StepCSVWriter(csv_path, columns, truncate_after=start if ckpt else None)
        records = RunRecords()
        eval_dtype = state.autocast_dtype if cfg.amp.dtype != "fp32" else None
        if ckpt is not None:
            state.load_state_dict(ckpt["engine"])
            torch.set_rng_state(ckpt["rng"])
            records.rows = read_rows(csv_path)
            for row in records.rows:
                summary = schedule.observe(SimpleNamespace(**row))
                if summary is not None:
                    state.clip = GlobalNormClip(summary.recommended_max_norm)
            announce(f"resumed run {tracker.run_id} at step {start}")

        def record(log: StepLog) -> None:
            summary = schedule.observe(log)
            if summary is not None:
                state.clip = GlobalNormClip(summary.recommended_max_norm)
                tracker.log_metrics(_window_metrics(summary, schedule.summaries[0]), step=log.step)
            if cfg.eval_every and log.step % cfg.eval_every == 0 and log.step != cfg.steps:
                tracker.log_metrics({"eval_loss": evaluate(task, dtype=eval_dtype)}, step=log.step)
            if on_step is not None:
                on_step(log)

        def hooked(step: int, batch: Any) -> Any:
            batch = faults.batch(step, batch) if faults.active else batch
            return batch_hook(step, batch) if batch_hook is not None else batch

        stream = task.train_batches
        for _ in range(start):  # the same data order as an uninterrupted run
            next(stream)
        batches = (hooked(i, b) for i, b in enumerate(stream, start=start + 1))

        def checkpoint(step: int) -> None:
            save_checkpoint(ckpt_file, state, step=step, run_id=tracker.run_id)

        with writer, StopRequest() as stop:
            try:
                run_steps(state, batches, range(start + 1, cfg.steps + 1), writer=writer, tracker=tracker,
                          records=records, phase_of=schedule.phase if calibrate else (lambda step: "train"),
                          on_record=record, progress=cfg.progress, label=run_name, stop=stop,
                          checkpoint=checkpoint, checkpoint_every=cfg.checkpoint_every)
            except KeyboardInterrupt:
                status = "KILLED"
                raise
            except StopRun as e:
                status = e.status
                raise
        metrics = summary_metrics(cfg, records, schedule.summaries, calibrate)
        metrics["eval_loss"] = evaluate(task, dtype=eval_dtype)
        tracker.log_metrics(metrics, step=cfg.steps)
        result = RunResult(tracker.run_id, csv_path, metrics, schedule.summaries, records)
        write_artifacts(cfg, tracker, result)
        status = "FINISHED"
        ckpt_file.unlink(missing_ok=True)
        return result
    finally:
        tracker.end(status)


def read_rows(csv_path: Path) -> list[dict[str, Any]]:
    """The rows of a steps CSV with their types back (None for empty cells)."""
    import csv

    def value(v: str) -> Any:
        if v == "":
            return None
        if v in ("True", "False"):
            return v == "True"
        try:
            return int(v)
        except ValueError:
            pass
        try:
            return float(v)
        except ValueError:
            return v

    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]
    for row in rows:
        row["skip_reason"] = row["skip_reason"] or ""
        row["lr"] = float(row["lr"])
        for k in ("grad_l2_pre_clip", "grad_l2_post_clip", "loss", "scaler_scale"):
            row[k] = float(row[k]) if row[k] is not None else math.nan
    return rows


def _window_metrics(summary: CalibrationSummary, first: CalibrationSummary) -> dict[str, float]:
    out = {f"window_{k}": v for k, v in summary.quantiles.items()}
    out["window_recommended_max_norm"] = summary.recommended_max_norm
    out["window_drift"] = summary.recommended_max_norm / first.recommended_max_norm
    return out


def summary_metrics(cfg: Config, records: RunRecords, windows: list[CalibrationSummary],
                    calibrate: bool) -> dict[str, float]:
    """Quantiles over finite pre-clip norms (of the first window, or of the whole run), ratios, loss."""
    if windows:
        q, tau = windows[0].quantiles, windows[0].recommended_max_norm
        clip_ratio = records.clip_ratio("validate")
    else:
        norms = [r["grad_l2_pre_clip"] for r in records.taken() if math.isfinite(r["grad_l2_pre_clip"])]
        values = quantiles(norms, list(REPORTED_QUANTILES) + [cfg.calibrate.quantile])
        q = {f"p{x * 100:g}": v for x, v in zip(REPORTED_QUANTILES, values)}
        q["max"] = max(norms) if norms else math.nan
        tau = values[-1]
        clip_ratio = records.clip_ratio()
    metrics = {f"grad_norm_{k}": v for k, v in q.items()}
    metrics.update(recommended_max_norm=tau, clip_ratio=clip_ratio, skip_ratio=records.skip_ratio(),
                   final_loss=records.final_loss(), steps_skipped=float(sum(r["skipped"] for r in records.rows)))
    if windows:
        metrics["window_clip_ratio_at_tau"] = windows[0].candidate_clip_ratios[tau]
        metrics["drift"] = windows[-1].recommended_max_norm / tau
    return metrics


def write_artifacts(cfg: Config, tracker: RunTracker, result: RunResult) -> None:
    """config.yaml, quantiles.json, report.md and plots into the run's artifacts."""
    from .plots import plot_run
    from .report import run_report_markdown

    tracker.artifact_path("config.yaml").write_text(redact_text(OmegaConf.to_yaml(OmegaConf.structured(cfg))))
    payload = {"metrics": result.metrics, "windows": [w.as_dict() for w in result.windows]}
    tracker.artifact_path("quantiles.json").write_text(json.dumps(payload, indent=2, default=float))
    tracker.artifact_path("report.md").write_text(run_report_markdown(cfg, result))
    if cfg.tracking.plots and result.records.rows:
        q = {k[len("grad_norm_"):]: v for k, v in result.metrics.items() if k.startswith("grad_norm_")}
        plot_run(result.records.rows, tracker.artifact_path("plots/x").parent, quantiles=q,
                 tau=result.metrics.get("recommended_max_norm"), title=f"({cfg.model.name}, {cfg.amp.dtype})")
