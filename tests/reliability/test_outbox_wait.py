"""The end-of-run wait for a tracking server that is away: a second Ctrl-C during it keeps what the
server did not take in ``pending.json`` (as the wait's own end does), then stops."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from sweep.tracking import outbox as O

DEAD = "http://127.0.0.1:9"  # nothing listens: connection refused at once


@pytest.mark.parametrize("second_signal", [False, True])
def test_what_the_server_did_not_take_is_kept_whichever_ends_the_wait(tmp_path, monkeypatch, second_signal):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    said: list[str] = []
    box = O.Outbox(MlflowClient(DEAD), "run0", say=said.append)
    metrics = [Metric("loss", 2.0 - 0.1 * s, 1000 + s, s) for s in range(1, 6)]
    box.send(metrics=metrics, tags={"note": "kept"})
    (tmp_path / "steps.csv").write_text("step\n1\n")
    if second_signal:

        def ctrl_c(seconds):
            raise KeyboardInterrupt("second signal 2")

        monkeypatch.setattr(O.time, "sleep", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            box.close("KILLED", tmp_path, wait_s=60)
    else:
        assert box.close("KILLED", tmp_path, wait_s=0) is False
    kept = json.loads((tmp_path / O.PENDING).read_text())  # before: no file after the second signal
    assert kept["status"] == "KILLED" and kept["tags"] == {"note": "kept"}
    assert kept["metrics"] == [[m.key, m.value, m.timestamp, m.step] for m in metrics]
    assert f"python -m sweep.resend {tmp_path}" in said[-1] and "5 metric values" in said[-1]
    again, status = O.read_pending(tmp_path, MlflowClient(DEAD))
    assert status == "KILLED" and [(m.key, m.value, m.step) for m in again.metrics] == [
        (m.key, m.value, m.step) for m in metrics
    ]


def test_a_server_still_away_is_never_said_to_answer_again(tmp_path, monkeypatch):
    """With nothing queued the outbox does not ask the server, so it cannot tell that it is back: the end-of-run
    wait on a dead server (whose artifact upload fails) says it stopped answering once, never that it answers."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    clock = iter(range(0, 10_000, 2))
    monkeypatch.setattr(O.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(O.time, "sleep", lambda s: None)
    said: list[str] = []
    box = O.Outbox(MlflowClient(DEAD), "run0", say=said.append)
    box.send(metrics=[Metric("loss", 1.0, 1000, 1)])  # away: the value is kept
    (tmp_path / "steps.csv").write_text("step\n1\n")
    box.metrics.clear()  # as after a send that got through: the server's next answer is the upload's
    assert box.close("FINISHED", tmp_path, wait_s=30) is False
    assert not [line for line in said if "answers again" in line], said
    assert [line for line in said if "stopped answering" in line] == said[:1]
    assert "did not answer by the end of the run" in said[-1]


def test_the_away_line_says_why_in_a_few_words(monkeypatch):
    """A refused connection, a server that accepts but never answers: the warning names the server and says
    which in a few words, not urllib3's exception text cut mid-token (``HTTPConnectionPool(host='127.0)``)."""
    import socket

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    said: list[str] = []
    O.Outbox(MlflowClient(DEAD), "run0", say=said.append).send(metrics=[Metric("loss", 1.0, 1000, 1)])
    with socket.socket() as mute:  # listens (the kernel completes the connection), never reads nor answers
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        uri = f"http://127.0.0.1:{mute.getsockname()[1]}"
        O.Outbox(MlflowClient(uri), "run0", say=said.append).send(metrics=[Metric("loss", 1.0, 1000, 1)])
    assert said == [
        f"warning: the tracking server {server} stopped answering ({why}); training goes on: steps.csv keeps "
        "every step, metrics are kept and sent when it answers"
        for server, why in [
            (DEAD, "connection refused"),
            (uri, "no answer within MLFLOW_HTTP_REQUEST_TIMEOUT=1 s"),
        ]
    ]
