"""What a run sends to a tracking server that may stop answering: the run trains on, nothing is lost.

On a remote store (``mlflow server``) a run's metrics and tags go through an ``Outbox``. When the
server stops answering (connection refused or reset, time-outs, 5xx), what could not be sent is
kept in order and the run trains on (``steps.csv`` is local and holds every step); one line says so.
Sends are retried with a back-off (5 s doubling to 60 s) and not between, so a dead server costs
no time per step; when it answers again the kept metrics go first, and one line says so. At the end
the outbox waits up to ``tracking.reconnect_s`` for the server to take the rest, the artifacts and
the run's end; if it is still away, ``pending.json`` (metrics, tags, final status) stays with the
artifacts in the run's local folder and one line names the command that sends them when it is back
(``python -m sweep.resend DIR``, ``sweep.resend``); a ``resume=true`` of the run sends them too.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from sweep.commands import python_command
from sweep.secrets import redact, redact_text

PENDING = "pending.json"
MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call
MAX_TAGS = 100  # and of tags


def unreachable(exc: BaseException) -> bool:
    """The server did not answer (or answered 5xx): worth keeping the data and trying again later."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout)):
        return True
    text = str(exc)
    return isinstance(exc, MlflowException) and (
        exc.error_code == "TEMPORARILY_UNAVAILABLE"
        or "failed with exception" in text
        or "Max retries exceeded" in text
        or "failed with error code 5" in text
    )


def away_reason(exc: BaseException) -> str:
    """Why a send failed, in a few words: the socket's error (``connection refused``), a time-out with the
    limit it hit, the HTTP status; else the start of the message, cut between words."""
    text = redact_text(" ".join(str(exc).split()))
    if errno := re.search(r"\[Errno -?\d+\] ([^\"')]+)", text):
        return errno.group(1).strip().lower()
    if "timed out" in text.lower():
        return f"no answer within MLFLOW_HTTP_REQUEST_TIMEOUT={os.environ.get('MLFLOW_HTTP_REQUEST_TIMEOUT')} s"
    if code := re.search(r"error code (5\d\d)", text):
        return f"HTTP {code.group(1)}"
    return text if len(text) <= 120 else text[:120].rsplit(" ", 1)[0] + " …"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Outbox:
    """One run's sends to a remote store, kept while the server is away."""

    def __init__(self, client, run_id: str, say=_say) -> None:
        self.client, self.run_id, self.say = client, run_id, say
        self.metrics: list = []  # mlflow.entities.Metric not yet sent, in order
        self.tags: dict[str, str] = {}
        self.away_since: float | None = None
        self.next_try, self.backoff = 0.0, 5.0
        self.replaces: Path | None = None  # a pending.json whose contents are queued: removed once sent

    def take_pending(self, folder: Path, logged: set[tuple[str, int]], upto: int | None) -> set[tuple[str, int]]:
        """Queue what an earlier end of this run kept in ``folder/pending.json`` (its tags, and its metric
        values at steps up to ``upto`` that the run lacks; not its status: the run goes on); the file
        goes once they are sent. The (key, step) of the values queued."""
        data, metrics = _pending(folder)
        kept = [m for m in metrics if (upto is None or m.step <= upto) and (m.key, m.step) not in logged]
        self.metrics[:0] = kept
        self.tags = {**data["tags"], **self.tags}
        self.replaces = folder / PENDING
        return {(m.key, m.step) for m in kept}

    def send(self, metrics: list | None = None, tags: dict[str, str] | None = None) -> None:
        """Queue, then send everything queued unless the server is away and the next try is not due."""
        self.metrics.extend(metrics or [])
        self.tags.update(tags or {})
        if self.away_since is not None and time.monotonic() < self.next_try:
            return
        try:
            kept = len(self.metrics)
            if self._push():
                self._back(kept)
        except Exception as e:
            if not unreachable(e):
                raise
            self._away(e)

    def _push(self) -> bool:
        """Send what is queued; whether the server took anything (nothing queued: it was not asked)."""
        from mlflow.entities import RunTag

        asked = bool(self.metrics or self.tags)
        while self.metrics:
            self.client.log_batch(self.run_id, metrics=self.metrics[:MAX_BATCH])
            del self.metrics[:MAX_BATCH]
        while self.tags:
            chunk = dict(list(self.tags.items())[:MAX_TAGS])
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in chunk.items()])
            for k in chunk:
                del self.tags[k]
        if self.replaces is not None:
            self.replaces.unlink(missing_ok=True)
            self.replaces = None
        return asked

    def _back(self, kept: int) -> None:
        """The server took a send: if it was away, one line says it answers again."""
        if self.away_since is not None:
            self.say(
                f"the tracking server answers again after {time.monotonic() - self.away_since:.0f} s: "
                f"{kept} kept metric values sent"
            )
            self.away_since, self.backoff = None, 5.0

    def _away(self, exc: BaseException) -> None:
        if self.away_since is None:
            self.away_since = time.monotonic()
            server = redact(self.client.tracking_uri)
            self.say(
                f"warning: the tracking server {server} stopped answering ({away_reason(exc)}); training goes on: "
                "steps.csv keeps every step, metrics are kept and sent when it answers"
            )
        self.next_try = time.monotonic() + self.backoff
        self.backoff = min(60.0, self.backoff * 2)

    def close(self, status: str, folder: Path, wait_s: float) -> bool:
        """Send the rest, the artifacts in ``folder`` and the run's end, waiting up to ``wait_s`` for the
        server; False (and ``folder/pending.json`` plus one line naming the command) if it stayed away.
        A second signal during the wait keeps the same, then is raised."""
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    kept = len(self.metrics)
                    self._push()
                    upload(self.client, self.run_id, folder)
                    self.client.set_terminated(self.run_id, status=status)
                    self._back(kept)
                    return True
                except Exception as e:
                    if not unreachable(e):
                        raise
                    if self.away_since is None:
                        self._away(e)
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
        except KeyboardInterrupt:
            self._keep(status, folder, "a second signal stopped the wait for the tracking server")
            raise
        self._keep(status, folder, "the tracking server did not answer by the end of the run")
        return False

    def _keep(self, status: str, folder: Path, why: str) -> None:
        write_pending(folder, self.run_id, status, self.metrics, self.tags, self.client.tracking_uri)
        self.replaces = None  # the new file holds what the old one did
        self.say(
            f"warning: {why}: {len(self.metrics)} metric values, the artifacts and the run's end ({status}) are "
            f"kept in {folder}; once it is back, send them with `{python_command('sweep.resend')} {folder}` "
            "(the run shows RUNNING there until then)"
        )


def upload(client, run_id: str, folder: Path) -> None:
    """The run's artifacts: every file and folder in ``folder`` but ``pending.json``."""
    for path in sorted(folder.iterdir()):
        if path.is_dir():
            client.log_artifacts(run_id, str(path), artifact_path=path.name)
        elif path.name != PENDING:
            client.log_artifact(run_id, str(path))


def write_pending(
    folder: Path, run_id: str, status: str, metrics: list, tags: dict[str, str], uri: str | None = None
) -> None:
    """What the server did not take, for ``sweep.resend``: the run, its final status, metrics, tags."""
    data: dict[str, Any] = {
        "run_id": run_id,
        "status": status,
        "tracking_uri": uri,
        "tags": tags,
        "metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics],
    }
    (folder / PENDING).write_text(json.dumps(data))


def amend_pending(folder: Path, status: str, tags: dict[str, str]) -> bool:
    """Change the end and add ``tags`` to what ``folder/pending.json`` keeps; False if there is none."""
    path = folder / PENDING
    if not path.is_file():
        return False
    data = json.loads(path.read_text())
    data["status"], data["tags"] = status, {**data["tags"], **tags}
    path.write_text(json.dumps(data))
    return True


def read_pending(folder: Path, client, say=_say) -> tuple[Outbox, str]:
    """An outbox holding what ``folder/pending.json`` kept, and the run's final status."""
    data, box_metrics = _pending(folder)
    box = Outbox(client, data["run_id"], say)
    box.metrics = box_metrics
    box.tags = dict(data["tags"])
    return box, data["status"]


def _pending(folder: Path) -> tuple[dict[str, Any], list]:
    """``folder/pending.json`` as written by ``write_pending``, and its metric values as MLflow ``Metric``s."""
    from mlflow.entities import Metric

    data = json.loads((folder / PENDING).read_text())
    return data, [Metric(*m) for m in data["metrics"]]
