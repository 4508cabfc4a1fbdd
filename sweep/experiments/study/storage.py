"""Where a study lives and what it is called: Optuna RDB storage, the study's name, sampler and pruner."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote

import optuna

from sweep.config.schema import Config
from sweep.errors import UserError
from sweep.experiments.study.compat import refuse_another_task
from sweep.experiments.study.pruning import constrained_pruner
from sweep.tracking.tracker import redact, redact_text, sqlite_path

STORAGE_SCHEMES = ("sqlite", "postgresql", "mysql")


def default_storage(tracking_uri: str) -> str:
    """``sqlite:///X/optuna.db`` beside a ``sqlite:///X/mlflow.db`` tracking store, else ``mlruns/`` (the
    path percent-encoded: SQLAlchemy decodes it, and a folder named ``a?b`` is no query)."""
    db = sqlite_path(tracking_uri)
    folder = db.parent.as_posix() if db is not None else "mlruns"
    return f"sqlite:///{quote(folder, safe='/')}/optuna.db"


def open_storage(url: str, *, heartbeat_interval: int = 10, grace_period: int = 60, tracking_uri: str | None = None):
    """An Optuna ``RDBStorage`` on ``url``; malformed, unsupported or unreachable → one-line ``UserError``,
    as is the tracking store ``tracking_uri`` or any MLflow store (Optuna would add its tables to it)."""
    from sqlalchemy.engine import make_url

    shown = redact_text(redact(url))
    fix = (
        "pass study.storage=sqlite:///mlruns/optuna.db or postgresql://USER@HOST:PORT/DB "
        "(password in $PGPASSWORD or ~/.pgpass)"
    )
    try:
        parsed = make_url(url)
        scheme = parsed.get_backend_name()
        _ = parsed.port  # a non-numeric port fails here
    except Exception as e:
        raise UserError(
            f"study.storage={shown!r} is not a database URL ({redact_text(type(e).__name__)}): {fix}"
        ) from None
    if scheme not in STORAGE_SCHEMES:
        raise UserError(f"study.storage={shown!r}: scheme {scheme!r} is not one of {', '.join(STORAGE_SCHEMES)}: {fix}")
    if scheme == "sqlite":
        if not parsed.database:
            raise UserError(f"study.storage={shown!r} names no database file: {fix}")
        try:
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(
                f"study.storage={shown!r}: cannot create {Path(parsed.database).parent}/ ({e.strerror}): {fix}"
            ) from None
    _refuse_tracking_store(shown, parsed, tracking_uri, fix)
    if parsed.drivername == "postgresql" and not _importable("psycopg") and _importable("psycopg2"):
        # SQLAlchemy >= 2.1 maps a bare postgresql:// to psycopg 3; use the psycopg2 we ship
        url = parsed.set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)
    try:
        storage = optuna.storages.RDBStorage(
            url,
            engine_kwargs={"pool_pre_ping": True} if scheme != "sqlite" else {"connect_args": {"timeout": 60}},
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1),
        )
    except Exception as e:
        raise UserError(f"study.storage={shown!r} cannot be opened ({driver_reason(e)}): {fix}") from None
    if scheme == "sqlite":
        serialize_sqlite(storage.engine)
    return storage


def driver_reason(exc: BaseException, limit: int = 400) -> str:
    """``Type: message`` of the driver's own exception behind a SQLAlchemy one (``exc.orig``), on one line,
    without SQLAlchemy's "(Background on this error at: URL)" link, passwords redacted, cut at a word."""
    said = getattr(exc, "orig", None) or exc
    text = re.sub(r"\s*\(Background on this error at: [^)]*\)", "", " ".join(str(said).split()))
    text = redact_text(text)
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " …"
    return f"{type(said).__name__}: {text}" if text else type(said).__name__


def serialize_sqlite(engine) -> None:
    """Make every transaction on a sqlite ``engine`` a real one that takes the write lock first.

    Python's sqlite3 driver begins a transaction only before a write, so the read half of Optuna's
    compare-and-set of a trial's state runs outside any transaction (and ``SELECT … FOR UPDATE`` is a
    no-op on sqlite). Workers on one study can then both read an enqueued trial as WAITING, both set
    it RUNNING in ``Study.ask`` and run it twice, and the second one's ``tell`` fails with
    ``UpdateFinishedTrialError``. SQLAlchemy's recipe for pysqlite transactions: the driver begins
    nothing, the engine emits ``BEGIN IMMEDIATE``, so the workers' transactions run one after another
    (each waits up to the connection's 60 s timeout for the lock).
    """
    from sqlalchemy import event

    @event.listens_for(engine, "connect")
    def _driver_begins_nothing(dbapi_connection, _record) -> None:
        dbapi_connection.isolation_level = None

    @event.listens_for(engine, "begin")
    def _begin_with_the_write_lock(connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    engine.dispose()  # the connections Optuna opened to create its tables predate the listeners


def _refuse_tracking_store(shown: str, parsed, tracking_uri: str | None, fix: str) -> None:
    """Before Optuna touches it: ``UserError`` if the storage is the tracking store or an MLflow store."""
    from sqlalchemy.engine import make_url

    from sweep.tracking.store import mlflow_tables

    db = Path(parsed.database) if parsed.get_backend_name() == "sqlite" and parsed.database else None
    tracking_db = sqlite_path(tracking_uri) if tracking_uri else None
    if db is not None:
        same = tracking_db is not None and db.resolve() == tracking_db.resolve()
        mlflow_store = db.is_file() and mlflow_tables(db)
    else:
        same = tracking_uri is not None and tracking_db is None and make_url(tracking_uri) == parsed
        mlflow_store = False
    if same or mlflow_store:
        what = "the tracking store (tracking.uri)" if same else "an MLflow tracking store"
        raise UserError(f"study.storage={shown!r} is {what}: Optuna would add its tables to it; {fix}")


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _changed(node: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of a config dataclass that differ from its schema defaults (so a field added to the
    schema later, with a default, does not rename existing studies)."""
    values, defaults = dataclasses.asdict(node), dataclasses.asdict(type(node)())
    return {k: v for k, v in values.items() if k not in drop and v != defaults.get(k)}


def task_key(cfg: Config) -> dict[str, Any]:
    """What makes two trials comparable: task, budget, seed and search space (not n_trials, storage)."""
    s = cfg.study
    space = {
        "mode": s.mode,
        "dtypes": list(s.dtypes),
        "low": s.max_norm_low,
        "high": s.max_norm_high,
        "anchor": s.anchor,
        "anchor_low": s.anchor_low,
        "anchor_high": s.anchor_high,
    }
    if s.mode == "constrained":
        space["band"] = list(s.target_clip)
    if s.anchor == "window":
        space["window"] = [cfg.calibrate.window, cfg.calibrate.cap, cfg.amp.dtype]
    key = {
        "steps": cfg.steps,
        "seed": cfg.seed,
        "accumulation_steps": cfg.accumulation_steps,
        "device": cfg.device,
        "space": space,
    }
    for name in ("model", "data", "optim", "amp", "clip", "faults", "forensics"):
        changed = _changed(getattr(cfg, name), drop=("dtype", "max_norm"))
        if changed:
            key[name] = changed
    return key


def study_name(cfg: Config) -> str:
    """``study.name`` or ``<model>-<data>-<mode>-<steps>steps-<hash of task and search space>``."""
    if cfg.study.name:
        return cfg.study.name
    key = json.dumps(task_key(cfg), sort_keys=True, default=str)
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return f"{cfg.model.name}-{cfg.data.name}-{cfg.study.mode}-{cfg.steps}steps-{digest}"


def make_sampler(cfg: Config, seed: int):
    s = cfg.study
    if s.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if s.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, s.n_trials // 2))
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.startup_trials, multivariate=True)


def make_pruner(cfg: Config):
    """``study=constrained``: the clipping-band rule over a median pruner (``pruning``); else no pruning."""
    s = cfg.study
    if s.mode != "constrained" or s.pruner == "none":
        return optuna.pruners.NopPruner()
    return constrained_pruner(
        s.pruner,
        cfg.steps,
        len(s.dtypes),
        s.target_clip,
        warmup=s.prune_warmup,
        report_every=s.report_every,
        below_after=s.prune_below_after,
    )


def stored_attrs(storage, name: str) -> dict[str, Any]:
    """The user attributes of the study ``name`` in ``storage`` (``{}`` when it does not exist), creating nothing."""
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        if summary.study_name == name:
            return dict(summary.user_attrs)
    return {}


def load_study(cfg: Config, storage, name: str):
    """Create or resume (``load_if_exists``) the study; its sampler seeded from ``cfg.seed``."""
    directions = ["minimize", "minimize"] if cfg.study.mode == "pareto" else ["minimize"]
    existing = {s.study_name: s for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    prior = existing[name].n_trials if name in existing else 0
    if name in existing and len(existing[name].directions) != len(directions):
        raise UserError(
            f"study.name={name!r} exists with {len(existing[name].directions)} objective(s), "
            f"but study.mode={cfg.study.mode} needs {len(directions)}: pass another study.name"
        )
    study = optuna.create_study(
        storage=storage,
        study_name=name,
        directions=directions,
        load_if_exists=True,
        sampler=make_sampler(cfg, cfg.seed + prior),
        pruner=make_pruner(cfg),
    )
    # Optuna refuses a categorical whose choices changed, inside the trial (a FAIL per retry): say it first
    stored = next(
        (t.distributions["dtype"] for t in study.get_trials(deepcopy=False) if "dtype" in t.distributions), None
    )
    if stored is not None and list(stored.choices) != list(cfg.study.dtypes):
        dtypes = ",".join(map(str, stored.choices))
        raise UserError(
            f"study.name={name!r} was run with study.dtypes=[{dtypes}], not {list(cfg.study.dtypes)}: pass "
            f"study.dtypes=[{dtypes}] to add trials to it, or another study.name"
        )
    refuse_another_task(study, task_key(cfg), named=bool(cfg.study.name))
    return study


def storage_unreachable(exc: BaseException | None) -> BaseException | None:
    """The study's database did not answer (refused, dropped, locked): SQLAlchemy's ``OperationalError`` /
    ``InterfaceError`` found in the chain (Optuna wraps it in a ``StorageInternalError``), else None."""
    from sqlalchemy.exc import InterfaceError, OperationalError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (OperationalError, InterfaceError)):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class StorageLost(UserError):
    """The study's database stopped answering: the sweep stops (exit 1) with one line, not a traceback."""

    status = 1

    def __init__(self, storage: str, exc: BaseException) -> None:
        found = storage_unreachable(exc)
        said = getattr(found, "orig", None) or found or exc  # the driver's own words, first line
        self.storage = storage
        self.reason = redact_text(" ".join((str(said).strip().splitlines() or [type(said).__name__])[0].split()))[:200]
        super().__init__(str(self))

    def __str__(self) -> str:
        return (
            f"the Optuna storage {self.storage} stopped answering ({self.reason}), so the sweep stops: its "
            "parent run (and a trial it was training) ended FAILED; once the database answers, re-run the same "
            "command: it marks a trial this worker left RUNNING in the study FAIL and runs its parameters again"
        )
