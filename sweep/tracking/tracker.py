"""MLflow tracking: store resolution, one run's params/metrics/artifacts, batched per-step metrics.

Per-step metrics are buffered and sent with ``MlflowClient.log_batch`` (≈45 µs per value on
sqlite, vs ≈2.3 ms per ``log_metric`` call). Non-finite values are never sent (MLflow turns inf
into 1.8e308 and wrecks charts); the CSV keeps them. Passwords in URIs never reach logs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from functools import lru_cache
from math import isfinite
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sweep.errors import UserError
from sweep.secrets import redact, redact_text  # re-exported: callers import them from here
from sweep.tracking.outbox import MAX_BATCH, PENDING, Outbox  # MAX_BATCH re-exported
from sweep.tracking.store import DEFAULT_URI, anchored, open_client, sqlite_path, warn_far_artifacts
from sweep.tracking.ui import experiment_ui_tags

if TYPE_CHECKING:
    from sweep.config.schema import Config
    from sweep.distributed.launch import Launch

# Fail fast instead of MLflow's default minutes of HTTP retries against a dead server.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def own_run_lines() -> None:
    """For the app's commands, which print their own run line (the ``mlflow ui`` command or the server's run):
    MLflow's "View run … / View experiment …" lines for an ``mlflow server`` would repeat it, before it."""
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


def resolve_uri(uri: str | None) -> str:
    """Explicit ``tracking.uri`` > ``$MLFLOW_TRACKING_URI`` > the embedded sqlite store."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def ensure_experiment(client, name: str, uri: str, *, retag: bool = True) -> str:
    """Experiment id for ``name``; a new one on sqlite keeps artifacts beside the database. Either way it
    carries the tags that open the MLflow UI on its training runs (``sweep.tracking.ui``); ``retag=False``: an
    existing one keeps its own (a user's experiment, named to an integration), only a new one gets them."""
    exp = client.get_experiment_by_name(name)
    if exp is not None and exp.lifecycle_stage == "deleted":
        raise UserError(
            f"tracking.experiment={name!r} was deleted (experiment id {exp.experiment_id}); restore it "
            f"with `MLFLOW_TRACKING_URI={redact(uri)} mlflow experiments restore --experiment-id "
            f"{exp.experiment_id}` or pass tracking.experiment=ANOTHER_NAME"
        )
    db = sqlite_path(uri)
    if exp is not None:
        for key, value in experiment_ui_tags(exp.tags).items() if retag else ():
            client.set_experiment_tag(exp.experiment_id, key, value)
        if db is not None:
            warn_far_artifacts(name, exp.artifact_location, db)
        return exp.experiment_id
    location = None
    if db is not None:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        location = (db.parent.resolve() / "artifacts" / slug).as_uri()
    try:
        return client.create_experiment(name, artifact_location=location, tags=experiment_ui_tags({}))
    except Exception:  # created meanwhile by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


@lru_cache(maxsize=1)
def source_tags() -> dict[str, str]:
    """MLflow's standard run tags: ``mlflow.user``, ``mlflow.source.name``/``.type`` (MLflow's own context
    providers) and, when the app's code is a git checkout, ``mlflow.source.git.commit``/``.branch``/``.repoURL``
    of that checkout (credentials stripped by MLflow)."""
    from mlflow.tracking.context.registry import resolve_tags
    from mlflow.utils import git_utils
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_BRANCH, MLFLOW_GIT_COMMIT, MLFLOW_GIT_REPO_URL

    tags = {k: v for k, v in resolve_tags().items() if not k.startswith("mlflow.source.git.")}
    code = str(Path(__file__).resolve().parent)
    git = {
        MLFLOW_GIT_COMMIT: git_utils.get_git_commit(code),
        MLFLOW_GIT_BRANCH: git_utils.get_git_branch(code),
        MLFLOW_GIT_REPO_URL: git_utils.get_git_repo_url(code),
    }
    return tags | {k: v for k, v in git.items() if v}


def metric_batch(metrics: dict[str, float | None], step: int) -> list:
    """``Metric`` entities of one step, None and non-finite values dropped (the CSV keeps them)."""
    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    return [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None and isfinite(v)]


def log_metrics(
    client, run_id: str, metrics: dict[str, float | None], step: int = 0, tags: dict[str, str] | None = None
) -> None:
    """One ``log_batch`` of finite metrics (and tags) on any run, running or ended."""
    from mlflow.entities import RunTag

    batch = metric_batch(metrics, step)
    run_tags = [RunTag(k, redact_text(str(v))) for k, v in (tags or {}).items()]
    if batch or run_tags:
        client.log_batch(run_id, metrics=batch, tags=run_tags)


def param_text(value: Any) -> str:
    """A param value as MLflow keeps it: text, passwords redacted, at most 6000 characters."""
    return redact_text(str(value))[:6000]


@dataclass(frozen=True)
class Store:
    """Where runs go: an MLflow client on ``uri``, the experiment, and tags every run of this invocation gets."""

    client: Any
    experiment_id: str
    uri: str
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def open(cls, uri: str | None, experiment: str, overrides: list[str] | None = None, *, retag: bool = True) -> Store:
        """Resolve ``uri`` (see ``resolve_uri``), check it, create the experiment if needed (``retag``:
        ``ensure_experiment``'s)."""
        uri = resolve_uri(uri)
        if not experiment.strip():
            raise UserError(
                f"tracking.experiment={experiment!r} is empty; pass a name, e.g. tracking.experiment=clipamp"
            )
        client = open_client(uri)
        tags = {"overrides": redact_text(" ".join(overrides or [])), "tracking_uri": redact(uri)}
        return cls(client, ensure_experiment(client, experiment, uri, retag=retag), uri, tags)

    @classmethod
    def beside(cls, uri: str | None, experiment_id: str) -> Store:
        """``uri``'s store and an experiment that exists and that clipamp did not make (an active run's):
        its tags are left as they are (no UI tags: the user's experiment looks as it did)."""
        uri = resolve_uri(uri)
        return cls(open_client(uri), experiment_id, uri, {"overrides": "", "tracking_uri": redact(uri)})


class RunTracker:
    """One MLflow run: params, buffered per-step metrics, summary metrics and artifacts.

    ``artifact_dir`` is a local folder: the run's own artifact folder on a local store (files
    written there are in the run as they are written), else ``./mlruns/uploads/RUN_ID`` (beside the
    checkpoints), uploaded at ``end`` and then removed. On a remote store every send goes through
    an ``Outbox``: a server that stops answering does not stop the run (``sweep.tracking.outbox``).
    """

    def __init__(
        self,
        client,
        experiment_id: str,
        run_name: str,
        *,
        tags: dict[str, str] | None = None,
        parent_run_id: str | None = None,
        flush_every: int = 50,
    ) -> None:
        from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

        tags = {k: redact_text(str(v)) for k, v in (tags or {}).items()}
        if parent_run_id:
            tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        run = client.create_run(experiment_id, run_name=run_name, tags=tags)
        try:
            self._init_common(client, run, flush_every)
        except OSError as e:  # an unwritable artifact folder: the new run must not stay RUNNING
            client.set_terminated(run.info.run_id, status="FAILED")
            raise UserError(
                f"cannot write the run's artifacts in {e.filename} ({e.strerror}); make it writable "
                f"or pass tracking.uri=sqlite:///WRITABLE/DIR/mlflow.db"
            ) from None

    @classmethod
    def reopen(cls, client, run_id: str, *, flush_every: int = 50, upto: int | None = None) -> RunTracker:
        """Continue an existing run (resume): mark it RUNNING again, same artifacts. Every metric value
        the run already holds (its key and step, logged before it was stopped or killed) is never sent
        again: ``add_step`` of a step the run holds sends only what it lacks, so the history holds each
        step once whichever sends a kill cut short. On a remote store, what the run kept in
        ``pending.json`` when its server was away is sent with the rest (its values at steps up to
        ``upto``, the checkpoint's step: the resume trains the later ones again; and its tags)."""
        self = cls.__new__(cls)
        run = client.get_run(run_id)
        client.update_run(run_id, status="RUNNING")
        try:
            self._init_common(client, run, flush_every)
            if self._upload and not (self.artifact_dir / "steps.csv").exists():  # a remote store: continue the
                # steps.csv the run uploaded when it was stopped (a local one was never sent: it is newer)
                try:
                    client.download_artifacts(run_id, "steps.csv", str(self.artifact_dir))
                except Exception:  # none uploaded: the resume's row check refuses with one line
                    pass
            self.logged = {(k, m.step) for k in run.data.metrics for m in client.get_metric_history(run_id, k)}
            if self.outbox is not None and (self.artifact_dir / PENDING).exists():
                self.logged |= self.outbox.take_pending(self.artifact_dir, self.logged, upto)
        except BaseException:  # the store, the folder or a signal failed the reopen: the run stays resumable
            with contextlib.suppress(Exception):
                client.update_run(run_id, status=run.info.status)
            raise
        return self

    def _init_common(self, client, run, flush_every: int) -> None:
        from mlflow.utils.file_utils import local_file_uri_to_path

        self.client = client
        self.run_id, self.run_name = run.info.run_id, run.info.run_name
        self.experiment_id = run.info.experiment_id
        self.flush_every = flush_every
        self._buffer: list = []
        self._steps_buffered = 0
        self.logged: set[tuple[str, int]] = set()  # (key, step) of metric values the run holds already
        self.held_after: int | None = None  # per-step metrics after this step wait (``hold_after``)
        self.artifact_uri = uri = run.info.artifact_uri
        self.announce, self.reconnect_s = None, 30.0  # set by the pipeline: where to say it, how long to wait
        if uri.startswith("file:"):
            self.artifact_dir = Path(local_file_uri_to_path(uri))  # %20 → space, %C3%BC → ü
            self._upload, self.outbox = False, None
        else:
            self.artifact_dir = upload_dir(self.run_id)
            self._upload, self.outbox = True, Outbox(client, self.run_id)
        self.artifact_dir.mkdir(parents=True, exist_ok=True)
        self.ended = False

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, param_text(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.outbox is not None:
            return self.outbox.send(tags={k: redact_text(str(v)) for k, v in tags.items()})
        log_metrics(self.client, self.run_id, {}, tags=tags)

    def add_step(self, step: int, metrics: dict[str, float | None]) -> None:
        """Buffer one step's metrics (non-finite and None dropped, and any the run holds already, see
        ``reopen``); flush every ``flush_every`` steps."""
        batch = metric_batch(metrics, step)
        if self.logged:
            batch = [m for m in batch if (m.key, m.step) not in self.logged]
        self._buffer.extend(batch)
        self._steps_buffered += 1
        if self._steps_buffered >= self.flush_every:
            self.flush()

    def copy_metrics(self, metrics: list) -> None:
        """Send another run's metric values (MLflow ``Metric`` objects, in order) as they are: the run holds them."""
        self._buffer[:0] = metrics
        self.logged |= {(m.key, m.step) for m in metrics}
        self.flush()

    def hold_after(self, step: int | None) -> None:
        """Send the per-step metrics of steps up to ``step`` (the run's latest checkpoint) and keep later ones
        buffered until the next call; ``None`` sends every step. A resume trains the steps after its
        checkpoint again: had the store taken their first values, it would keep them (``reopen`` never sends
        a step twice) whatever the resume computes, e.g. under a raised ``steps=``'s schedule."""
        self.held_after = step
        self.flush()

    def flush(self) -> None:
        """Send the buffered per-step metrics, those after ``held_after`` excepted."""
        held = self.held_after
        send = self._buffer if held is None else [m for m in self._buffer if m.step <= held]
        if self.outbox is not None:
            self.outbox.send(send)
        else:
            for i in range(0, len(send), MAX_BATCH):
                self.client.log_batch(self.run_id, metrics=send[i : i + MAX_BATCH])
        self._buffer = [] if held is None else [m for m in self._buffer if m.step > held]
        self._steps_buffered = 0

    def log_metrics(self, metrics: dict[str, float | None], step: int = 0, *, summary: bool = False) -> None:
        """Metrics of one step (a closed window's figures, an eval, the summary; non-finite dropped), sent at
        once, but for a step after a held one (``hold_after``): those wait with the per-step metrics and share
        their fate (a resume computes them again). A value the run holds already (``reopen``) is never sent again.
        ``summary``: the run's summary, sent at once whatever the hold, for its end phase to read from the store
        (the experiment's description); a resume sends its own at its last step."""
        batch = [m for m in metric_batch(metrics, step) if (m.key, m.step) not in self.logged]
        if self.held_after is not None and step > self.held_after and not summary:
            self._buffer.extend(batch)
        elif self.outbox is not None:
            self.outbox.send(batch)
        elif batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def artifact_path(self, name: str) -> Path:
        """Where to write artifact ``name`` (it is part of the run once written, or at ``end``)."""
        path = self.artifact_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        """``with run:`` ends it by how the block ended (see ``ended_as``)."""
        self.end(ended_as(kind))

    def end(self, status: str = "FINISHED") -> None:
        """Flush, upload (remote stores) and close the run with ``status`` (FINISHED/FAILED/KILLED)."""
        if self.ended:
            return
        self.ended = True
        if status != "KILLED" or not self.held_after:  # not resumable, or no checkpoint: every step
            self.held_after = None
        else:  # KILLED with a checkpoint: the steps after it are the resume's to send (``hold_after``)
            self._buffer = [m for m in self._buffer if m.step <= self.held_after]
        if self.outbox is not None:  # a remote store: the rest, the artifacts and the end, if the server answers
            self.flush()
            try:
                sent = self.outbox.close(status, self.artifact_dir, self.reconnect_s)
            except Exception:  # the server refused something: the run must not stay RUNNING
                self.client.set_terminated(self.run_id, status="FAILED")
                raise
            if sent:
                shutil.rmtree(self.artifact_dir, ignore_errors=True)  # uploaded: the local copy goes
                if self.announce is not None:
                    self.announce(f"steps.csv: uploaded to {self.artifact_uri}/steps.csv (local copy removed)")
            return
        try:
            self.flush()
        finally:
            self.client.set_terminated(self.run_id, status=status)


def upload_dir(run_id: str) -> Path:
    """A run's local artifact folder on a remote store: uploaded at its end, or kept with ``pending.json``."""
    return (Path("mlruns") / "uploads" / run_id).resolve()


def fetch_artifact(client, run_id: str, path: str, dst: str) -> Path:
    """``client.download_artifacts(run_id, path, dst)`` without MLflow's progress bar (a line per file)."""
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    previous = os.environ.get(key)
    os.environ[key] = "false"
    try:
        return Path(client.download_artifacts(run_id, path, dst))
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


def ended_as(kind: type[BaseException] | None) -> str:
    """A run's status from how its block ended: FINISHED, KILLED (Ctrl-C, SIGTERM) or FAILED (an error)."""
    if kind is None:
        return "FINISHED"
    return "KILLED" if issubclass(kind, KeyboardInterrupt) else "FAILED"


class SilentTracker:
    """A ``RunTracker`` stand-in for ranks other than 0 under torchrun: the run's id, nothing logged."""

    def __init__(self, run_id: str, run_name: str) -> None:
        self.run_id, self.run_name = run_id, run_name

    def _nothing(self, *args: Any, **kwargs: Any) -> None:
        return None

    def __enter__(self) -> SilentTracker:
        return self

    log_params = set_tags = add_step = flush = hold_after = log_metrics = end = __exit__ = _nothing


def open_store(cfg: Config, overrides: list[str] | None, launch: Launch, base_dir: Path) -> Store:
    """Rank 0 opens (creates, migrates) the store; the other ranks wait, learn the experiment, never touch it."""
    opened: list[Store] = []

    def on_main() -> tuple[str, str, dict[str, str]]:
        uri = anchored(resolve_uri(cfg.tracking.uri), base_dir)
        opened.append(Store.open(uri, cfg.tracking.experiment, overrides))
        return opened[0].experiment_id, opened[0].uri, opened[0].tags

    experiment_id, uri, tags = launch.agree(on_main)
    return opened[0] if opened else Store(None, experiment_id, uri, tags)
