"""``+experiment=sweep``: an Optuna 5 study of ``clip.max_norm`` × ``amp.dtype``, tracked in MLflow.

One invocation = one MLflow parent run and ``study.n_trials`` trials, each one ``run_training``
(a nested child run with its params, batched per-step metrics, ``steps.csv`` and summary metrics).
The study lives in an Optuna RDB storage (``sqlite:///<tracking dir>/optuna.db`` by default,
``study.storage=postgresql://…`` for shared workers) under a name derived from the task, so the
same command resumes the study and adds trials.

Modes (``study=pareto`` | ``study=constrained``):

- ``pareto``: two objectives, minimise (eval loss, clipping ratio); the parent run holds the Pareto
  front. Multi-objective studies cannot prune.
- ``constrained``: one objective, eval loss; ``trial.set_constraint`` keeps the clipping ratio in
  ``[target_clip_low, target_clip_high]`` (TPE/NSGA-II read the constraints); the mean training loss
  is reported every ``report_every`` steps and a ``MedianPruner`` stops trials that fall behind.

Every invocation first enqueues one trial per dtype in ``study.dtypes`` (only the dtype is fixed;
the sampler draws ``max_norm``, or it is the anchor's p95 the first time), so both dtypes are
evaluated whatever the sampler. Trials train from the same seed (same init, same batches): they
differ only by ``max_norm`` and dtype. The sampler is seeded with ``cfg.seed + trials already in
the study``: a fresh study is reproducible and a resumed one does not replay its first draws.

Accounting: an invocation counts the optimizer steps its trials really ran (``on_step`` calls)
against ``n_trials × steps`` (the same trials unpruned), and the time spent in ``trial.report`` /
``should_prune``; the parent logs ``trial_steps_run/_budget/_saved``, ``pruned_share``,
``prune_overhead_s``. A pruned trial's child run ends KILLED with tag ``pruned=true`` and its clip/skip
ratios and final loss over the steps it ran; a failing trial is FAIL in Optuna, its child FAILED with
tag ``error``, and the sweep goes on; a user mistake or Ctrl-C stops the sweep.

The pick (``pick_trial``), in both modes:

1. among COMPLETE trials with a finite eval loss whose clipping ratio lies in the target band
   ``[target_clip_low, target_clip_high]``: the lowest eval loss (ties: lower clipping ratio, then
   the earlier trial) — rule ``in-band-min-loss``;
2. if none lies in the band: the trial whose clipping ratio is nearest to the band (ties: lower
   eval loss) — rule ``nearest-band``;
3. no COMPLETE trial: no pick (rule ``none``). Pruned and failed trials are never picked.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna

from clipamp_engine import DTYPES

from sweep.errors import UserError
from sweep.run.loop import RunRecords, StopRequest, StopRun
from sweep.run.pipeline import flatten, run_training
from sweep.run.tracking import RunTracker, redact, redact_text, sqlite_path


# Optuna 5 marks heartbeats experimental and warns when they are used outside Study.optimize; our
# ask/tell loop records them itself (see _run_trial).
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


class Pruned(optuna.TrialPruned, StopRun):
    """A pruned trial: Optuna's signal, and its child run ends KILLED."""

if TYPE_CHECKING:
    import pandas as pd
    from rich.console import Console

    from sweep.config.schema import Config

MODES = ("pareto", "constrained")
SAMPLERS = ("tpe", "random", "nsga2")
PRUNERS = ("median", "none")
STORAGE_SCHEMES = ("sqlite", "postgresql", "mysql")
QUANTILE_KEYS = ("p50", "p90", "p95", "p99")
TABLE_COLUMNS = ("trial", "state", "dtype", "max_norm", "eval_loss", "clip_ratio", "skip_ratio", "final_loss",
                 "steps_run", "wall_s", "in_band", "pareto", "run_id", "parent_run_id")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Pick:
    """The chosen configuration and the rule that chose it."""

    trial: int
    dtype: str
    max_norm: float
    eval_loss: float
    clip_ratio: float
    rule: str  # in-band-min-loss | nearest-band
    reason: str

    def override(self) -> str:
        return f"amp.dtype={self.dtype} clip.max_norm={self.max_norm:.4g}"


@dataclass
class SweepResult:
    """What one invocation did, and the study as it stands after it."""

    study_name: str
    storage: str  # redacted
    mode: str
    parent_run_id: str
    trials: "pd.DataFrame"  # every trial of the study (earlier invocations too), TABLE_COLUMNS
    pick: Pick | None
    trials_run: int  # this invocation
    pruned: int  # this invocation
    failed: int  # this invocation
    steps_run: int  # optimizer steps the trials of this invocation actually ran
    steps_budget: int  # trials_run × steps: what the same trials would have run unpruned
    seconds_saved_est: float  # Σ over pruned trials of (steps not run) × (their own s/step)
    prune_overhead_s: float  # time in trial.report / trial.should_prune
    wall_s: float
    anchor: dict[str, float] | None = None
    band: tuple[float, float] = (0.0, 1.0)

    @property
    def steps_saved(self) -> int:
        return self.steps_budget - self.steps_run

    @property
    def pruned_share(self) -> float:
        return self.pruned / self.trials_run if self.trials_run else 0.0


@dataclass
class _Counters:
    """This invocation's accounting: optimizer steps the trials ran, pruned/failed trials, pruning cost."""

    steps_run: int = 0
    pruned: int = 0
    failed: int = 0
    seconds_saved: float = 0.0
    prune_overhead: float = 0.0


# ---------------------------------------------------------------- config, storage, names

def validate_study(cfg: "Config") -> None:
    """Semantic checks of ``cfg.study``; ``UserError`` naming value, allowed set and fix."""
    s = cfg.study
    if s.mode not in MODES:
        raise UserError(f"study.mode={s.mode!r} is not one of {', '.join(MODES)}: pass study=pareto or study=constrained")
    if s.sampler not in SAMPLERS:
        raise UserError(f"study.sampler={s.sampler!r} is not one of {', '.join(SAMPLERS)}")
    if s.pruner not in PRUNERS:
        raise UserError(f"study.pruner={s.pruner!r} is not one of {', '.join(PRUNERS)}")
    if not s.dtypes or len(set(s.dtypes)) != len(s.dtypes) or any(d not in DTYPES for d in s.dtypes):
        raise UserError(f"study.dtypes={list(s.dtypes)} must be distinct values of {', '.join(DTYPES)}, "
                        f"e.g. study.dtypes=[fp16,bf16]")
    if s.n_trials < len(s.dtypes):
        raise UserError(f"study.n_trials={s.n_trials} must be >= {len(s.dtypes)} (one trial per dtype in "
                        f"study.dtypes={list(s.dtypes)} comes first in every sweep)")
    if not 0 < s.max_norm_low < s.max_norm_high:
        raise UserError(f"study.max_norm_low={s.max_norm_low} and study.max_norm_high={s.max_norm_high} "
                        f"must satisfy 0 < low < high")
    if not 0 < s.anchor_low < s.anchor_high:
        raise UserError(f"study.anchor_low={s.anchor_low} and study.anchor_high={s.anchor_high} "
                        f"must satisfy 0 < low < high")
    if s.anchor is not None and s.anchor != "window" and not _RUN_ID.match(s.anchor):
        raise UserError(f"study.anchor={s.anchor!r} is not 'window' or an MLflow run id (32 hex digits): pass "
                        f"study.anchor=window, the id of a calibrate run, or null for the max_norm_low/high range")
    if not 0.0 <= s.target_clip_low <= s.target_clip_high <= 1.0:
        raise UserError(f"study.target_clip_low={s.target_clip_low}, study.target_clip_high={s.target_clip_high} "
                        f"must satisfy 0 <= low <= high <= 1")
    if not 0.0 <= s.prune_warmup < 1.0:
        raise UserError(f"study.prune_warmup={s.prune_warmup} must be in [0, 1)")
    if s.report_every < 1:
        raise UserError(f"study.report_every={s.report_every} must be >= 1")
    if s.threads < 0:
        raise UserError(f"study.threads={s.threads} must be >= 0 (0: torch's default)")
    if s.startup_trials < 0:
        raise UserError(f"study.startup_trials={s.startup_trials} must be >= 0")
    if cfg.clip.mode != "norm":
        raise UserError(f"clip={cfg.clip.mode}: the sweep tunes the global-norm threshold clip.max_norm; "
                        f"pass clip=norm")


def default_storage(tracking_uri: str) -> str:
    """``sqlite:///X/optuna.db`` beside a ``sqlite:///X/mlflow.db`` tracking store, else ``mlruns/``."""
    db = sqlite_path(tracking_uri)
    folder = db.parent.as_posix() if db is not None else "mlruns"
    return f"sqlite:///{folder}/optuna.db"


def open_storage(url: str, *, heartbeat_interval: int = 10, grace_period: int = 60):
    """An Optuna ``RDBStorage`` on ``url``; malformed, unsupported or unreachable → one-line ``UserError``."""
    import optuna
    from sqlalchemy.engine import make_url

    shown = redact_text(redact(url))
    fix = ("pass study.storage=sqlite:///mlruns/optuna.db or postgresql://USER@HOST:PORT/DB "
           "(password in $PGPASSWORD or ~/.pgpass)")
    try:
        parsed = make_url(url)
        scheme = parsed.get_backend_name()
        _ = parsed.port  # a non-numeric port fails here
    except Exception as e:
        raise UserError(f"study.storage={shown!r} is not a database URL ({redact_text(type(e).__name__)}): {fix}") from None
    if scheme not in STORAGE_SCHEMES:
        raise UserError(f"study.storage={shown!r}: scheme {scheme!r} is not one of {', '.join(STORAGE_SCHEMES)}: {fix}")
    if scheme == "sqlite":
        if not parsed.database:
            raise UserError(f"study.storage={shown!r} names no database file: {fix}")
        try:
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"study.storage={shown!r}: cannot create {Path(parsed.database).parent}/ "
                            f"({e.strerror}): {fix}") from None
    if parsed.drivername == "postgresql" and not _importable("psycopg") and _importable("psycopg2"):
        # SQLAlchemy >= 2.1 maps a bare postgresql:// to psycopg 3; use the psycopg2 we ship
        url = parsed.set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)
    try:
        return optuna.storages.RDBStorage(
            url, engine_kwargs={"pool_pre_ping": True} if scheme != "sqlite" else None,
            heartbeat_interval=heartbeat_interval, grace_period=grace_period,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1))
    except Exception as e:
        reason = redact_text(" ".join(str(e).split()))[:200]
        raise UserError(f"study.storage={shown!r} cannot be opened ({type(e).__name__}: {reason}): {fix}") from None


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _changed(node: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of a config dataclass that differ from its schema defaults (so a field added to the
    schema later, with a default, does not rename existing studies)."""
    values, defaults = dataclasses.asdict(node), dataclasses.asdict(type(node)())
    return {k: v for k, v in values.items() if k not in drop and v != defaults.get(k)}


def _task_key(cfg: "Config") -> dict[str, Any]:
    """What makes two trials comparable: task, budget, seed and search space (not n_trials, storage)."""
    s = cfg.study
    space = {"mode": s.mode, "dtypes": list(s.dtypes), "low": s.max_norm_low, "high": s.max_norm_high,
             "anchor": s.anchor, "anchor_low": s.anchor_low, "anchor_high": s.anchor_high}
    if s.mode == "constrained":
        space["band"] = [s.target_clip_low, s.target_clip_high]
    if s.anchor == "window":
        space["window"] = [cfg.calibrate.window, cfg.calibrate.cap, cfg.amp.dtype]
    key = {"steps": cfg.steps, "seed": cfg.seed, "accumulation_steps": cfg.accumulation_steps,
           "device": cfg.device, "space": space}
    for name in ("model", "data", "optim", "amp", "clip", "faults", "forensics"):
        node = getattr(cfg, name, None)
        if dataclasses.is_dataclass(node):
            changed = _changed(node, drop=("dtype", "max_norm"))
            if changed:
                key[name] = changed
    return key


def study_name(cfg: "Config") -> str:
    """``study.name`` or ``<model>-<data>-<mode>-<steps>steps-<hash of task and search space>``."""
    if cfg.study.name:
        return cfg.study.name
    key = json.dumps(_task_key(cfg), sort_keys=True, default=str)
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return f"{cfg.model.name}-{cfg.data.name}-{cfg.study.mode}-{cfg.steps}steps-{digest}"


def _sampler(cfg: "Config", seed: int):
    import optuna

    s = cfg.study
    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if s.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, s.n_trials // 2))
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.startup_trials, multivariate=True)


def _pruner(cfg: "Config"):
    import optuna

    s = cfg.study
    if s.mode != "constrained" or s.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=len(s.dtypes), n_min_trials=len(s.dtypes),
                                       n_warmup_steps=int(s.prune_warmup * cfg.steps), interval_steps=1)


def load_study(cfg: "Config", storage, name: str):
    """Create or resume (``load_if_exists``) the study; its sampler seeded from ``cfg.seed``."""
    import optuna

    directions = ["minimize", "minimize"] if cfg.study.mode == "pareto" else ["minimize"]
    existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    prior = existing[name].n_trials if name in existing else 0
    if name in existing and len(existing[name].directions) != len(directions):
        raise UserError(f"study.name={name!r} exists with {len(existing[name].directions)} objective(s), "
                        f"but study.mode={cfg.study.mode} needs {len(directions)}: pass another study.name")
    return optuna.create_study(storage=storage, study_name=name, directions=directions, load_if_exists=True,
                               sampler=_sampler(cfg, cfg.seed + prior), pruner=_pruner(cfg))


# ---------------------------------------------------------------- the search space

def resolve_anchor(cfg: "Config", study, client, experiment_id: str, parent_run_id: str, tags: dict,
                   announce) -> dict[str, float] | None:
    """Norm quantiles the max_norm range is anchored on: the study's, a calibrate run's, or a new window."""
    spec = cfg.study.anchor
    if spec is None:
        return None
    stored = study.user_attrs.get("anchor")
    if stored and stored.get("spec") == spec:
        return {k: float(stored[k]) for k in QUANTILE_KEYS}
    if spec == "window":
        wcfg = _quiet_copy(cfg)
        wcfg.steps, wcfg.calibrate.every = cfg.calibrate.window, 0
        announce(f"anchor: calibration window of {wcfg.steps} steps ({cfg.amp.dtype}) …")
        result = run_training(wcfg, client, experiment_id, run_name=f"anchor-window-{cfg.amp.dtype}",
                              calibrate=True, parent_run_id=parent_run_id, announce=lambda s: None,
                              tags={**tags, "sweep_role": "anchor", "study": study.study_name})
        q, source = result.windows[0].quantiles, result.run_id
        if "clip_ratio" not in result.metrics or not math.isfinite(result.metrics["clip_ratio"]):
            # the whole run is the window: its clipping ratio is that of the window (0 unless calibrate.cap)
            client.log_metric(result.run_id, "clip_ratio", result.records.clip_ratio(), step=wcfg.steps)
    else:
        from mlflow.exceptions import MlflowException

        try:
            metrics = client.get_run(spec).data.metrics
        except MlflowException:
            raise UserError(f"study.anchor={spec!r}: no such run in the tracking store; pass the id of a "
                            f"calibrate run (python -m sweep.report lists them) or study.anchor=window") from None
        missing = [k for k in QUANTILE_KEYS if f"grad_norm_{k}" not in metrics]
        if missing:
            raise UserError(f"study.anchor={spec!r}: the run has no grad_norm_{missing[0]} metric; pass a "
                            f"calibrate run's id or study.anchor=window")
        q, source = {k: metrics[f"grad_norm_{k}"] for k in QUANTILE_KEYS}, spec
    anchor = {k: float(q[k]) for k in QUANTILE_KEYS}
    if not all(math.isfinite(v) and v > 0 for v in anchor.values()):
        raise UserError(f"study.anchor={spec!r}: its norm quantiles {anchor} are not all finite and > 0")
    study.set_user_attr("anchor", {**anchor, "spec": spec, "source_run_id": source})
    return anchor


def max_norm_range(cfg: "Config", anchor: dict[str, float] | None) -> tuple[float, float]:
    s = cfg.study
    if anchor is None:
        return s.max_norm_low, s.max_norm_high
    return s.anchor_low * anchor["p50"], s.anchor_high * anchor["p99"]


def enqueue_dtypes(study, dtypes: list[str], anchor: dict[str, float] | None) -> None:
    """One trial per dtype first: at the anchor's p95 until that point has been evaluated, else with only
    the dtype fixed (the sampler draws max_norm). A dtype still queued (WAITING) from an interrupted
    invocation is not queued twice; an interrupted (FAIL) trial does not count as evaluated."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    waiting = {t.system_attrs.get("fixed_params", {}).get("dtype") for t in trials if t.state == TrialState.WAITING}
    tried = {(t.params.get("dtype"), t.params.get("max_norm")) for t in trials
             if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)}
    for dtype in dtypes:
        if dtype in waiting:
            continue
        params: dict[str, Any] = {"dtype": dtype}
        if anchor is not None and not any(d == dtype and m is not None and math.isclose(m, anchor["p95"])
                                          for d, m in tried):
            params["max_norm"] = anchor["p95"]
        study.enqueue_trial(params)


# ---------------------------------------------------------------- tables and the pick

def pareto_mask(losses: list[float], ratios: list[float]) -> list[bool]:
    """True where no other point is at least as good on both objectives and better on one."""
    pts = list(zip(losses, ratios))
    return [not any(l2 <= l1 and r2 <= r1 and (l2 < l1 or r2 < r1) for l2, r2 in pts) for l1, r1 in pts]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def trials_table(study, band: tuple[float, float]) -> "pd.DataFrame":
    """Every trial of ``study`` (user attrs hold the figures) with ``in_band`` and ``pareto`` flags."""
    import pandas as pd

    rows = []
    for t in study.get_trials(deepcopy=False):
        ua = t.user_attrs
        row = {"trial": t.number, "state": t.state.name, "dtype": t.params.get("dtype", ""),
               "max_norm": t.params.get("max_norm", math.nan)}
        for k in ("eval_loss", "clip_ratio", "skip_ratio", "final_loss", "wall_s"):
            v = ua.get(k)
            row[k] = float(v) if _finite(v) else math.nan
        row["steps_run"] = int(ua.get("steps_run", 0))
        row["run_id"] = ua.get("run_id", "")
        row["parent_run_id"] = ua.get("parent_run_id", "")
        rows.append(row)
    df = pd.DataFrame(rows, columns=[c for c in TABLE_COLUMNS if c not in ("in_band", "pareto")])
    return flag_table(df, band)


def flag_table(df: "pd.DataFrame", band: tuple[float, float]) -> "pd.DataFrame":
    """Add ``in_band`` (COMPLETE, clip ratio in band) and ``pareto`` (non-dominated COMPLETE) columns."""
    df = df.copy()
    done = _completed(df)
    df["in_band"] = False
    df.loc[done.index, "in_band"] = (done["clip_ratio"] >= band[0]) & (done["clip_ratio"] <= band[1])
    df["pareto"] = False
    if len(done):
        df.loc[done.index, "pareto"] = pareto_mask(done["eval_loss"].tolist(), done["clip_ratio"].tolist())
    return df[[c for c in TABLE_COLUMNS if c in df.columns]]


def _completed(df: "pd.DataFrame") -> "pd.DataFrame":
    import numpy as np

    ok = (df["state"] == "COMPLETE") & np.isfinite(df["eval_loss"].astype(float)) \
        & np.isfinite(df["clip_ratio"].astype(float))
    return df[ok]


def pick_trial(df: "pd.DataFrame", band: tuple[float, float]) -> Pick | None:
    """The configuration to use (rules in the module docstring); ``df`` needs trial, state, dtype,
    max_norm, eval_loss, clip_ratio."""
    low, high = band
    done = _completed(df)
    if done.empty:
        return None
    ratio = done["clip_ratio"].astype(float)
    in_band = done[(ratio >= low) & (ratio <= high)]
    if len(in_band):
        best = in_band.sort_values(["eval_loss", "clip_ratio", "trial"]).iloc[0]
        rule = "in-band-min-loss"
        reason = (f"lowest eval loss among the {len(in_band)} of {len(done)} completed trials whose clipping "
                  f"ratio is in [{low:g}, {high:g}]")
    else:
        dist = (low - ratio).clip(lower=0) + (ratio - high).clip(lower=0)
        best = done.assign(_dist=dist).sort_values(["_dist", "eval_loss", "trial"]).iloc[0]
        rule = "nearest-band"
        reason = (f"none of the {len(done)} completed trials clips within [{low:g}, {high:g}]; "
                  f"the one whose clipping ratio is nearest to the band (ties: lower eval loss)")
    return Pick(int(best["trial"]), str(best["dtype"]), float(best["max_norm"]), float(best["eval_loss"]),
                float(best["clip_ratio"]), rule, reason)


# ---------------------------------------------------------------- one trial

def _quiet_copy(cfg: "Config") -> "Config":
    """A copy for one child run: no step bar (the sweep has its own), no periodic checkpoints, no resume."""
    c = copy.deepcopy(cfg)
    c.progress = False
    if hasattr(c, "checkpoint_every"):
        c.checkpoint_every = 0
    if hasattr(c, "resume"):
        c.resume = None
    return c


def trial_config(cfg: "Config", dtype: str, max_norm: float) -> "Config":
    c = _quiet_copy(cfg)
    c.amp.dtype, c.clip.max_norm = dtype, float(max_norm)
    return c


def _child_run_id(client, experiment_id: str, parent_run_id: str, number: int) -> str | None:
    runs = client.search_runs([experiment_id], max_results=1, filter_string=(
        f"tags.`mlflow.parentRunId` = '{parent_run_id}' and tags.trial = '{number}'"))
    return runs[0].info.run_id if runs else None


def _partial_metrics(records: RunRecords) -> dict[str, float]:
    """clip/skip ratios and final loss over the steps a stopped trial did run."""
    return {"clip_ratio": records.clip_ratio(), "skip_ratio": records.skip_ratio(),
            "final_loss": records.final_loss(), "steps_run": float(len(records.rows))}


def _run_trial(cfg, study, trial, *, storage, client, experiment_id, parent, tags, lo, hi, counters, ui) -> None:
    """Suggest, train (one child run), tell Optuna. Pruned → PRUNED/KILLED, exception → FAIL/FAILED."""
    import optuna
    from optuna.trial import TrialState

    s = cfg.study
    dtype = trial.suggest_categorical("dtype", list(s.dtypes))
    max_norm = trial.suggest_float("max_norm", lo, hi, log=True)
    n = trial.number
    tcfg = trial_config(cfg, dtype, max_norm)
    prunable = s.mode == "constrained" and s.pruner != "none"
    logs = RunRecords()  # the steps this trial ran, also when it is stopped early
    window: list[float] = []
    ui.start_trial(n, dtype, max_norm, cfg.steps)
    t0 = time.perf_counter()

    def constrain(clip_ratio: float) -> None:
        if s.mode == "constrained" and math.isfinite(clip_ratio):
            trial.set_constraint("clip_ratio_low", s.target_clip_low - clip_ratio)
            trial.set_constraint("clip_ratio_high", clip_ratio - s.target_clip_high)

    beat = [time.monotonic()]
    storage.record_heartbeat(trial._trial_id)  # ask/tell has no heartbeat thread: beat from the loop

    def on_step(log) -> None:
        if time.monotonic() - beat[0] >= s.heartbeat_interval:  # this worker is alive
            storage.record_heartbeat(trial._trial_id)
            beat[0] = time.monotonic()
        logs.rows.append(log.row())
        counters.steps_run += 1
        ui.step(log.step)
        if not prunable:
            return
        if math.isfinite(log.loss):
            window.append(float(log.loss))
        if log.step % s.report_every == 0 and window:
            t = time.perf_counter()
            trial.report(sum(window) / len(window), log.step)
            window.clear()
            prune = trial.should_prune()
            counters.prune_overhead += time.perf_counter() - t
            if prune:
                raise Pruned(f"trial {n} pruned at step {log.step}")

    common = {"trial": n, "dtype": dtype, "max_norm": max_norm, "parent_run_id": parent.run_id, "seed": cfg.seed}
    for k, v in common.items():
        trial.set_user_attr(k, v)
    child_tags = {**tags, "sweep_role": "trial", "study": study.study_name, "trial": str(n),
                  "max_norm": f"{max_norm:.6g}", "sweep_parent": parent.run_id}
    try:
        result = run_training(tcfg, client, experiment_id, run_name=f"trial-{n}-{dtype}-{max_norm:.3g}",
                              calibrate=False, parent_run_id=parent.run_id, tags=child_tags, on_step=on_step,
                              announce=lambda line: None)
    except optuna.TrialPruned:
        wall = time.perf_counter() - t0
        part = _partial_metrics(logs)
        constrain(part["clip_ratio"])
        run_id = _child_run_id(client, experiment_id, parent.run_id, n)
        _set_attrs(trial, {**part, "wall_s": wall, "run_id": run_id or ""})
        if run_id:
            _mark_child(client, run_id, "KILLED", {"pruned": "true", "outcome": "pruned",
                                                  "pruned_at_step": str(len(logs.rows))}, part)
        study.tell(trial, state=TrialState.PRUNED)
        counters.pruned += 1
        counters.seconds_saved += (cfg.steps - len(logs.rows)) * wall / max(1, len(logs.rows))
        ui.end_trial(n, "PRUNED", f"pruned at step {len(logs.rows)}, train loss {part['final_loss']:.4g}")
        return
    except (KeyboardInterrupt, UserError):
        study.tell(trial, state=TrialState.FAIL)
        raise
    except Exception as e:
        reason = redact_text(f"{type(e).__name__}: {' '.join(str(e).split())}")[:500]
        part = _partial_metrics(logs)
        run_id = _child_run_id(client, experiment_id, parent.run_id, n)
        if run_id is None:  # failed before run_training opened its run: record one anyway
            tracker = RunTracker(client, experiment_id, f"trial-{n}-{dtype}-{max_norm:.3g}",
                                 tags=child_tags, parent_run_id=parent.run_id)
            tracker.end("FAILED")
            run_id = tracker.run_id
        _set_attrs(trial, {**part, "wall_s": time.perf_counter() - t0, "run_id": run_id, "error": reason})
        _mark_child(client, run_id, "FAILED", {"outcome": "failed", "error": reason}, part)
        study.tell(trial, state=TrialState.FAIL)
        counters.failed += 1
        ui.end_trial(n, "FAIL", reason)
        return
    m = result.metrics
    wall = time.perf_counter() - t0
    values = {"eval_loss": m.get("eval_loss", math.nan), "clip_ratio": m.get("clip_ratio", math.nan),
              "skip_ratio": m.get("skip_ratio", math.nan), "final_loss": m.get("final_loss", math.nan),
              "steps_run": float(len(logs.rows)), "wall_s": wall}
    _set_attrs(trial, {**values, "run_id": result.run_id})
    client.set_tag(result.run_id, "outcome", "complete")
    client.log_metric(result.run_id, "steps_run", float(len(logs.rows)), step=cfg.steps)
    if not (math.isfinite(values["eval_loss"]) and math.isfinite(values["clip_ratio"])):
        reason = f"non-finite eval loss ({values['eval_loss']}) or clipping ratio ({values['clip_ratio']})"
        trial.set_user_attr("error", reason)
        _mark_child(client, result.run_id, "FAILED", {"outcome": "failed", "error": reason}, {})
        study.tell(trial, state=TrialState.FAIL)
        counters.failed += 1
        ui.end_trial(n, "FAIL", reason)
        return
    constrain(values["clip_ratio"])
    study.tell(trial, [values["eval_loss"], values["clip_ratio"]] if s.mode == "pareto" else values["eval_loss"])
    ui.end_trial(n, "COMPLETE", f"eval {values['eval_loss']:.4g}  clip {values['clip_ratio']:.1%}  "
                                f"skip {values['skip_ratio']:.1%}  ({wall:.1f} s)")


def recover_stale_trials(study, client, experiment_id: str, say) -> list[int]:
    """FAIL the trials of workers that died mid-trial (no heartbeat within the grace period).

    Optuna's ``fail_stale_trials`` marks them FAIL and its ``RetryFailedTrialCallback`` enqueues
    their parameters once, so the next ``ask`` re-runs them; their child runs end KILLED.
    """
    import optuna

    before = {t.number for t in study.get_trials(deepcopy=False) if t.state.name == "RUNNING"}
    optuna.storages.fail_stale_trials(study)
    stale = sorted(t.number for t in study.get_trials(deepcopy=False)
                   if t.number in before and t.state.name == "FAIL")
    for n in stale:
        runs = client.search_runs([experiment_id], filter_string=(
            f"tags.study = '{study.study_name}' and tags.trial = '{n}' and attributes.status = 'RUNNING'"))
        for run in runs:
            client.set_tag(run.info.run_id, "outcome", "worker died")
            client.set_terminated(run.info.run_id, status="KILLED")
    if stale:
        say(f"trials {stale} lost their worker: marked FAIL, their runs KILLED, their parameters re-enqueued")
    return stale


def _set_attrs(trial, values: dict[str, Any]) -> None:
    for k, v in values.items():
        trial.set_user_attr(k, v if not isinstance(v, float) or math.isfinite(v) else None)


def _mark_child(client, run_id: str, status: str, tags: dict[str, str], metrics: dict[str, float]) -> None:
    from mlflow.entities import Metric, RunTag

    ts = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, v, ts, 0) for k, v in metrics.items() if math.isfinite(v)],
                     tags=[RunTag(k, v) for k, v in tags.items()])
    client.set_terminated(run_id, status=status)


# ---------------------------------------------------------------- progress

class _Progress:
    """rich display: trials done / running / pruned / failed and the current pick; a step bar."""

    def __init__(self, console, enabled: bool, total: int, best) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console, self.best = console, best
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=console,
                                 disable=not enabled, transient=False)
        self.trials = self.progress.add_task("trials", total=total, info="")
        self.steps = None
        self.done = self.pruned = self.failed = 0

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def _info(self, running: int) -> str:
        return (f"done {self.done} · running {running} · pruned {self.pruned} · failed {self.failed} · "
                f"best {self.best()}")

    def start_trial(self, n: int, dtype: str, max_norm: float, steps: int) -> None:
        label = f"trial {n} {dtype} τ={max_norm:.3g}"
        if self.steps is None:
            self.steps = self.progress.add_task(label, total=steps, info="")
        self.progress.reset(self.steps, total=steps, description=label, info="")
        self.progress.update(self.trials, info=self._info(1))

    def step(self, step: int) -> None:
        self.progress.update(self.steps, completed=step)

    def end_trial(self, n: int, state: str, info: str) -> None:
        self.done += 1
        self.pruned += state == "PRUNED"
        self.failed += state == "FAIL"
        self.progress.update(self.trials, advance=1, info=self._info(0))
        self.progress.console.print(f"trial {n:>3} {state:<8} {info}")


# ---------------------------------------------------------------- the parent run's artifacts

def plot_sweep(df: "pd.DataFrame", pick: Pick | None, path: Path, *, band: tuple[float, float],
               anchor: dict[str, float] | None = None, title: str = "") -> Path:
    """Eval loss vs clipping ratio (Pareto front, band, pick) and vs max_norm, coloured by dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = _completed(df)
    colours = {"bf16": "tab:blue", "fp16": "tab:orange", "fp32": "tab:green"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.axvspan(band[0], band[1], color="green", alpha=0.08, label=f"target band [{band[0]:g}, {band[1]:g}]")
    for dtype, g in done.groupby("dtype"):
        c = colours.get(dtype, "gray")
        a.scatter(g["clip_ratio"], g["eval_loss"], color=c, label=dtype, s=36, zorder=3)
        b.scatter(g["max_norm"], g["eval_loss"], color=c, label=dtype, s=36, zorder=3)
        for _, r in g.iterrows():
            a.annotate(str(int(r["trial"])), (r["clip_ratio"], r["eval_loss"]), fontsize=7,
                       xytext=(3, 3), textcoords="offset points")
    front = done[done["pareto"]].sort_values("clip_ratio") if "pareto" in done else done.iloc[:0]
    if len(front):
        a.step(front["clip_ratio"], front["eval_loss"], where="post", color="black", lw=0.8, ls="--",
               label="Pareto front", zorder=2)
    if pick is not None:
        for ax, x in ((a, pick.clip_ratio), (b, pick.max_norm)):
            ax.scatter([x], [pick.eval_loss], marker="*", s=260, facecolor="none", edgecolor="red", lw=1.5,
                       zorder=4, label=f"pick: trial {pick.trial}")
    for k, v in (anchor or {}).items():
        b.axvline(v, ls=":", lw=0.8, color="gray")
        b.annotate(k, (v, b.get_ylim()[1]), fontsize=7, color="gray", rotation=90, va="top")
    a.set_xlabel("clipping ratio (share of taken steps clipped)")
    a.set_ylabel("eval loss")
    b.set_xscale("log")
    b.set_xlabel("max_norm τ")
    b.set_ylabel("eval loss")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    other = df[df["state"] != "COMPLETE"]["state"].value_counts().to_dict()
    fig.suptitle(f"{title}  ({len(done)} complete" + "".join(f", {v} {k.lower()}" for k, v in other.items())
                 + ")", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _write_parent_artifacts(tracker: RunTracker, result: SweepResult, cfg: "Config") -> None:
    from sweep.report.tables import sweep_markdown

    df = result.trials
    df.to_csv(tracker.artifact_path("trials.csv"), index=False)
    tracker.artifact_path("trials.md").write_text(sweep_markdown(result.study_name, df, result.pick,
                                                                 band=result.band, mode=result.mode))
    df[df["pareto"]].to_csv(tracker.artifact_path("pareto.csv"), index=False)
    df[df["in_band"]].to_csv(tracker.artifact_path("feasible.csv"), index=False)
    pick = dataclasses.asdict(result.pick) if result.pick else None
    tracker.artifact_path("pick.json").write_text(json.dumps(
        {"study": result.study_name, "storage": result.storage, "mode": result.mode, "band": list(result.band),
         "pick": pick, "override": result.pick.override() if result.pick else None,
         "rule_doc": __doc__.split("The pick (``pick_trial``), in both modes:")[1].strip(),
         "this_invocation": {"trials": result.trials_run, "pruned": result.pruned, "failed": result.failed,
                             "trial_steps_run": result.steps_run, "trial_steps_budget": result.steps_budget,
                             "trial_steps_saved": result.steps_saved,
                             "seconds_saved_est": result.seconds_saved_est,
                             "prune_overhead_s": result.prune_overhead_s, "wall_s": result.wall_s},
         "anchor": result.anchor}, indent=2, default=float))
    plot_sweep(df, result.pick, tracker.artifact_path("plots/loss_vs_clip_ratio.png"), band=result.band,
               anchor=result.anchor, title=f"{result.study_name} ({result.mode})")


def _log_parent_summary(tracker: RunTracker, result: SweepResult) -> None:
    df = result.trials
    states = df["state"].value_counts().to_dict()
    metrics = {"trials_total": float(len(df)), "trials_complete": float(states.get("COMPLETE", 0)),
               "trials_pruned": float(states.get("PRUNED", 0)), "trials_failed": float(states.get("FAIL", 0)),
               "trials_run": float(result.trials_run), "pruned_share": result.pruned_share,
               "trial_steps_run": float(result.steps_run), "trial_steps_budget": float(result.steps_budget),
               "trial_steps_saved": float(result.steps_saved), "seconds_saved_est": result.seconds_saved_est,
               "prune_overhead_s": result.prune_overhead_s, "wall_s": result.wall_s,
               "pareto_size": float(df["pareto"].sum()), "in_band_size": float(df["in_band"].sum())}
    tags = {"pick_rule": result.pick.rule if result.pick else "none"}
    if result.pick:
        p = result.pick
        metrics.update(pick_max_norm=p.max_norm, pick_eval_loss=p.eval_loss, pick_clip_ratio=p.clip_ratio,
                       pick_trial=float(p.trial))
        tags.update(pick_dtype=p.dtype, pick_max_norm=f"{p.max_norm:.6g}", pick_trial=str(p.trial),
                    pick_override=p.override())
        tracker.log_params({"pick_dtype": p.dtype, "pick_max_norm": f"{p.max_norm:.6g}",
                            "pick_trial": p.trial, "pick_rule": p.rule})
    tracker.log_metrics(metrics, step=len(df))
    tracker.set_tags(tags)


# ---------------------------------------------------------------- the sweep

def run_sweep(cfg: "Config", client, experiment_id: str, *, uri: str, tags: dict[str, str],
              console: "Console | None" = None) -> SweepResult:
    """Create or resume the study, run ``study.n_trials`` trials (child runs), log the parent, pick."""
    import optuna
    import torch
    from omegaconf import OmegaConf
    from rich.console import Console

    from sweep.report.tables import print_sweep_summary

    console = console or Console()
    validate_study(cfg)
    s = cfg.study
    storage_url = s.storage or default_storage(uri)
    storage = open_storage(storage_url, heartbeat_interval=s.heartbeat_interval, grace_period=s.grace_period)
    shown_storage = redact_text(redact(storage_url))
    name = study_name(cfg)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = load_study(cfg, storage, name)
    recover_stale_trials(study, client, experiment_id, console.print)
    prior = len(study.trials)
    band = (s.target_clip_low, s.target_clip_high)
    tags = {k: redact_text(str(v)) for k, v in tags.items()}
    console.print(f"study {name!r} in {shown_storage}: {prior} trials so far; adding {s.n_trials} "
                  f"({s.mode}, {s.sampler}, dtypes {', '.join(s.dtypes)})")
    parent = RunTracker(client, experiment_id, f"sweep-{name}", parent_run_id=None,
                        flush_every=cfg.tracking.flush_every,
                        tags={**tags, "run": "sweep", "sweep_role": "parent", "study": name, "study_mode": s.mode,
                              "optuna_storage": shown_storage, "model": cfg.model.name, "data": cfg.data.name,
                              "device": cfg.device})
    status = "FAILED"
    counters = _Counters()
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    try:
        if s.threads:
            torch.set_num_threads(s.threads)
        parent.log_params({**flatten(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)),
                           "study_name": name, "optuna_storage": shown_storage, "trials_before": prior})
        with StopRequest() as stop:  # SIGINT/SIGTERM between trials: stop before the next one
            try:
                anchor = resolve_anchor(cfg, study, client, experiment_id, parent.run_id, tags, console.print)
                lo, hi = max_norm_range(cfg, anchor)
                study.set_user_attr("task", _task_key(cfg))
                enqueue_dtypes(study, list(s.dtypes), anchor)

                def best() -> str:
                    p = pick_trial(trials_table(study, band), band)
                    return f"#{p.trial} {p.dtype} τ={p.max_norm:.3g} loss {p.eval_loss:.4g}" if p else "—"

                with _Progress(console, cfg.progress, s.n_trials, best) as ui:
                    for _ in range(s.n_trials):
                        if stop.signum is not None:
                            raise KeyboardInterrupt(f"signal {stop.signum}")
                        trial = study.ask()
                        _run_trial(cfg, study, trial, storage=storage, client=client, experiment_id=experiment_id, parent=parent,
                                   tags=tags, lo=lo, hi=hi, counters=counters, ui=ui)
            except KeyboardInterrupt:
                status = "KILLED"
                raise
        table = trials_table(study, band)
        result = SweepResult(
            study_name=name, storage=shown_storage, mode=s.mode, parent_run_id=parent.run_id, trials=table,
            pick=pick_trial(table, band), trials_run=s.n_trials, pruned=counters.pruned, failed=counters.failed,
            steps_run=counters.steps_run, steps_budget=s.n_trials * cfg.steps,
            seconds_saved_est=counters.seconds_saved, prune_overhead_s=counters.prune_overhead,
            wall_s=time.perf_counter() - t0, anchor=anchor, band=band)
        _write_parent_artifacts(parent, result, cfg)
        _log_parent_summary(parent, result)
        status = "FINISHED"
    finally:
        torch.set_num_threads(threads)
        parent.end(status)
    print_sweep_summary(result, uri=redact(uri), experiment_id=experiment_id, console=console)
    return result
