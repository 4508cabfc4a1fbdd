"""The search space of a study: ``max_norm`` log-uniform over a fixed range or one anchored on the
norm quantiles of a calibration window; one trial per dtype enqueued first."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from mlflow.exceptions import MlflowException
from optuna.trial import TrialState

from sweep.commands import python_command
from sweep.config.convert import child_config
from sweep.config.schema import Config, calibrated
from sweep.errors import UserError
from sweep.report.notes import ANCHOR_ROLE
from sweep.run.pipeline import RunHooks, RunSpec, run_training
from sweep.run.summary import QUANTILE_KEYS
from sweep.tracking.tracker import RunTracker, Store


def resolve_anchor(
    cfg: Config,
    study,
    store: Store,
    parent_run_id: str,
    announce: Callable[[str], None],
    artifacts: Callable | None = None,
) -> dict[str, float] | None:
    """Norm quantiles the max_norm range is anchored on: the study's, a calibrate run's, or a new window
    (a child run; ``artifacts`` is its report hook)."""
    spec = cfg.study.anchor
    if spec is None:
        return None
    stored = study.user_attrs.get("anchor")
    if stored and stored.get("spec") == spec:
        return {k: float(stored[k]) for k in QUANTILE_KEYS}
    if spec == "window":
        q, source = window_quantiles(cfg, study.study_name, store, parent_run_id, announce, artifacts)
    else:
        q, source = _run_quantiles(store.client, spec), spec
    anchor = {k: float(q[k]) for k in QUANTILE_KEYS}
    if not all(math.isfinite(v) and v > 0 for v in anchor.values()):
        raise UserError(f"study.anchor={spec!r}: its norm quantiles {anchor} are not all finite and > 0")
    study.set_user_attr("anchor", {**anchor, "spec": spec, "source_run_id": source})
    return anchor


def check_anchor_run(cfg: Config, stored: dict[str, Any], client) -> None:
    """``study.anchor=RUN_ID`` that the study (its user attributes ``stored``, ``{}`` for a study not created
    yet) has not stored: refuse a run it cannot anchor on before the sweep creates the study or opens its parent
    run (``resolve_anchor`` reads it again, under the study's lock)."""
    spec = cfg.study.anchor
    if spec in (None, "window") or (stored.get("anchor") or {}).get("spec") == spec:
        return
    _run_quantiles(client, spec)


def window_quantiles(
    cfg: Config, study_name: str, store: Store, parent_run_id: str, announce, artifacts
) -> tuple[dict[str, float], str]:
    """Run one calibration window (no clipping) as a child run: its quantiles and run id."""
    wcfg = child_config(cfg, steps=cfg.calibrate.window)
    wcfg.calibrate.every = 0
    wcfg = calibrated(wcfg)
    announce(f"anchor: calibration window of {wcfg.steps} steps ({cfg.amp.dtype}) …")
    spec = RunSpec(
        f"anchor-window-{cfg.amp.dtype}",
        parent_run_id=parent_run_id,
        tags={"sweep_role": ANCHOR_ROLE, "study": study_name},  # never the experiment's "Latest" answer
    )
    # the whole run is the window: no step after it, so no clipping ratio realised at τ (its report says —);
    # no clip_ratio metric either (the window's own, 0 unless calibrate.cap, is window_clip_ratio_at_tau's kin)
    try:
        result = run_training(wcfg, store, spec, RunHooks(artifacts=artifacts, announce=lambda s: None))
    except KeyboardInterrupt as e:  # the exit line names the window's run, not a trial
        e.anchor_window = True  # type: ignore[attr-defined]
        raise
    return result.windows[0].quantiles, result.run_id


def _run_quantiles(client, run_id: str) -> dict[str, float]:
    """``grad_norm_p50..p99`` of an earlier (calibrate) run."""
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise UserError(
            f"study.anchor={run_id!r}: no such run in the tracking store; pass the id of a "
            f"calibrate run ({python_command('sweep.report')} --wide lists them) or study.anchor=window"
        ) from None
    metrics = run.data.metrics
    if "grad_norm_p50" in metrics and "window_clip_ratio_at_tau" not in metrics:  # no window: all its steps
        kind = run.data.tags.get("run")
        raise UserError(
            f"study.anchor={run_id!r}: {run.info.run_name} is a {kind + ' ' if kind else ''}run without a "
            f"calibration window, so its "
            f"grad_norm quantiles are over all its steps, warm-up included; pass a calibrate run's id "
            f"({python_command('sweep.report')} --wide lists them) or study.anchor=window"
        )
    missing = [k for k in QUANTILE_KEYS if f"grad_norm_{k}" not in metrics]
    if missing:
        raise UserError(
            f"study.anchor={run_id!r}: the run has no grad_norm_{missing[0]} metric; pass a "
            f"calibrate run's id or study.anchor=window"
        )
    anchor = {k: float(metrics[f"grad_norm_{k}"]) for k in QUANTILE_KEYS}
    if not all(math.isfinite(v) and v > 0 for v in anchor.values()):
        raise UserError(f"study.anchor={run_id!r}: its norm quantiles {anchor} are not all finite and > 0")
    return anchor


def max_norm_range(cfg: Config, anchor: dict[str, float] | None) -> tuple[float, float]:
    s = cfg.study
    if anchor is None:
        return s.max_norm_low, s.max_norm_high
    return s.anchor_low * anchor["p50"], s.anchor_high * anchor["p99"]


def enqueue_dtypes(study, dtypes: list[str], anchor: dict[str, float] | None) -> None:
    """One trial per dtype first: at the anchor's p95 until that point has been evaluated, else with only
    the dtype fixed (the sampler draws max_norm). A dtype still queued (WAITING) from an interrupted
    invocation is not queued twice; an interrupted (FAIL) trial does not count as evaluated."""
    trials = study.get_trials(deepcopy=False)
    waiting = {t.system_attrs.get("fixed_params", {}).get("dtype") for t in trials if t.state == TrialState.WAITING}
    tried = {
        (t.params.get("dtype"), t.params.get("max_norm"))
        for t in trials
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    }
    for dtype in dtypes:
        if dtype in waiting:
            continue
        params: dict[str, Any] = {"dtype": dtype}
        if anchor is not None and not any(
            d == dtype and m is not None and math.isclose(m, anchor["p95"]) for d, m in tried
        ):
            params["max_norm"] = anchor["p95"]
        study.enqueue_trial(params)


def open_parent_run(cfg: Config, store: Store, name: str, role: str, **tags: str) -> RunTracker:
    """A study's parent MLflow run ``name``: tagged ``run=sweep``, ``sweep_role=role``, the task (model,
    data, device) and ``tags``; its children are the trials."""
    task = {"model": cfg.model.name, "data": cfg.data.name, "device": cfg.device}
    return RunTracker(
        store.client,
        store.experiment_id,
        name,
        flush_every=cfg.tracking.flush_every,
        tags={**store.tags, "run": "sweep", "sweep_role": role, **tags, **task},
    )
