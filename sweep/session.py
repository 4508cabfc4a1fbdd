"""One tracked training run: task, engine, CSV, MLflow run, calibration windows, summary, artifacts.

``run_training`` serves every experiment: ``calibrate`` (windows, then train at the recommended
τ), ``train`` (the configured clip policy throughout) and each sweep trial.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from clipamp_engine import GlobalNormClip, NoClip, StepCSVWriter, StepLog
from clipamp_engine.calibration import REPORTED_QUANTILES, CalibrationSummary, NormCalibrator, quantiles

from .config import Config
from .loop import APP_COLUMNS, RunRecords, run_steps, sigterm_as_interrupt
from .tasks.build import Task, build_task, evaluate
from .tracking import RunTracker, redact_text
from .training import build_clip_policy, build_state


@dataclass
class RunResult:
    """What a run measured (the same figures it logged to MLflow)."""

    run_id: str
    csv_path: Path
    metrics: dict[str, float]
    windows: list[CalibrationSummary] = field(default_factory=list)
    records: RunRecords = field(default_factory=RunRecords)
    status: str = "FINISHED"

    @property
    def recommended_max_norm(self) -> float | None:
        return self.windows[0].recommended_max_norm if self.windows else self.metrics.get("recommended_max_norm")


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
    return [range(s, min(s + c.window, cfg.steps + 1)) for s in starts if s + 1 < min(s + c.window, cfg.steps + 1)]


def _config_dict(cfg: Config) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


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
) -> RunResult:
    """Train ``cfg`` for ``cfg.steps`` steps inside one MLflow run and return its figures.

    ``batch_hook(step, batch) -> batch`` may replace a batch (fault injection, spikes);
    ``on_step(log)`` sees every record (sweep pruning). The run ends FINISHED, FAILED, or
    KILLED (Ctrl-C / SIGTERM); the CSV keeps every completed step in every case.
    """
    torch.manual_seed(cfg.seed)
    task = task or build_task(cfg.model, cfg.data, seed=cfg.seed, device=cfg.device)
    all_tags = {"run": cfg.run or "", "dtype": cfg.amp.dtype, "device": cfg.device, "model": cfg.model.name,
                "data": cfg.data.name, "clip": cfg.clip.mode, "git_commit": git_commit(), "task": task.description}
    all_tags.update(tags or {})
    tracker = RunTracker(client, experiment_id, run_name, tags=all_tags, parent_run_id=parent_run_id,
                         flush_every=cfg.tracking.flush_every)
    status = "FAILED"
    try:
        tracker.log_params(flatten(_config_dict(cfg)))
        csv_path = tracker.artifact_path("steps.csv")
        announce(f"steps.csv: {csv_path}")
        writer = StepCSVWriter(csv_path, APP_COLUMNS)
        windows = window_ranges(cfg) if calibrate else []
        if windows:
            first = GlobalNormClip(cfg.calibrate.cap) if cfg.calibrate.cap else NoClip()
        else:
            first = build_clip_policy(cfg.clip.mode, cfg.clip.options, cfg.clip.max_norm, task.model)
        state = build_state(cfg, task.model, task.loss_fn, first)
        records = RunRecords()
        summaries: list[CalibrationSummary] = []
        calibrators = {w.start: NormCalibrator(cfg.calibrate.quantile, cfg.calibrate.candidates) for w in windows}
        window_of = {s: w for w in windows for s in w}

        def phase_of(step: int) -> str:
            return ("calibrate" if step in window_of else "validate") if calibrate else "train"

        def record(log: StepLog) -> None:
            w = window_of.get(log.step)
            if w is not None:
                cal = calibrators[w.start]
                cal.add(log)
                if log.step == w[-1]:
                    summary = cal.summary()
                    summaries.append(summary)
                    state.clip = GlobalNormClip(summary.recommended_max_norm)
                    tracker.log_metrics(_window_metrics(summary, summaries[0]), step=log.step)
            if on_step is not None:
                on_step(log)

        batches = task.train_batches
        if batch_hook is not None:
            batches = (batch_hook(i, b) for i, b in enumerate(task.train_batches, start=1))
        with writer, sigterm_as_interrupt():
            try:
                run_steps(state, batches, range(1, cfg.steps + 1), writer=writer, tracker=tracker,
                          records=records, phase_of=phase_of, on_record=record, progress=cfg.progress,
                          label=run_name)
            except KeyboardInterrupt:
                status = "KILLED"
                raise
        metrics = summary_metrics(cfg, records, summaries, calibrate)
        metrics["eval_loss"] = evaluate(task, dtype=state.autocast_dtype if cfg.amp.dtype != "fp32" else None)
        tracker.log_metrics(metrics, step=cfg.steps)
        result = RunResult(tracker.run_id, csv_path, metrics, summaries, records)
        write_artifacts(cfg, tracker, result)
        status = "FINISHED"
        return result
    finally:
        tracker.end(status)


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
