"""Acceptance (issue 16): after a calibrate run, the link the run prints opens the MLflow UI on the
experiment's training runs with the recommended τ and p95 in view, without a click.

A real ``mlflow server`` on 127.0.0.1 and headless Chromium (Debian package ``chromium``, which
``bash scripts/test`` installs; where it cannot be had the test skips, naming the package).
``CLIPAMP_UI_SCREENS=DIR`` keeps the screenshots there.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
from pathlib import Path

import pytest
from mlflow import MlflowClient

from sweep import app
from tests.app.helpers import TINY, compose_cfg
from tests.mlflow_server import MlflowServer
from tests.system import system_program

pytestmark = pytest.mark.slow  # a calibrate run, an MLflow server and a browser


def _chromium() -> str:
    return system_program("chromium", "chromium-browser", "google-chrome", package="chromium")


def _browser(chromium: str, url: str, *args: str) -> str:
    """Chromium loads ``url`` headless (1600×1000, 20 s of virtual time for the page's requests)."""
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1600,1000",
        "--virtual-time-budget=20000",
        *args,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180).stdout


def _visible_text(dom: str) -> str:
    text = re.sub(r"<(style|script)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", text)))


@pytest.fixture
def server(tmp_path):
    """``mlflow server`` on the test's store, stopped with its children; not yet awaited."""
    srv = MlflowServer(f"sqlite:///{tmp_path}/mlruns/mlflow.db", tmp_path)
    srv.start(wait_s=None)
    try:
        yield srv
    finally:
        srv.stop()


def test_printed_link_shows_the_recommended_tau_and_p95(tmp_path, store, server, capsys):
    chromium = _chromium()
    uri, port = server.store, server.port
    assert uri == store
    cfg = compose_cfg("+experiment=calibrate", *TINY, "steps=40", "calibrate.window=20", f"tracking.uri={uri}")
    result = app.run(cfg, ["+experiment=calibrate"])
    printed = capsys.readouterr().out
    link = re.search(r"→ (http://127\.0\.0\.1:5000/\S+)", printed).group(1).replace(":5000/", f":{port}/")
    run = MlflowClient(uri).get_run(result.run_id)
    tau, p95 = run.data.metrics["recommended_max_norm"], run.data.metrics["grad_norm_p95"]
    server.wait(240)

    text = _visible_text(_browser(chromium, link, "--dump-dom"))
    screens = Path(os.environ.get("CLIPAMP_UI_SCREENS") or tmp_path)
    screens.mkdir(parents=True, exist_ok=True)
    _browser(chromium, link, f"--screenshot={screens / 'mlflow-runs.png'}")
    assert (screens / "mlflow-runs.png").stat().st_size > 10_000

    # the experiment's description, first line: the latest answer
    name = run.info.run_name
    assert re.search(rf"Latest: {name} : recommended τ \( clip\.max_norm \) {tau:.4g} , p95 {p95:.4g}", text), text
    # the training-runs table (not the GenAI pages) with the shared view's columns: τ and p95 first
    row = re.search(rf"{name} (?:\d+|a few|an?) \w+ ago (\S+) (\S+) (none → \S+)", text)
    assert row, text
    assert float(row.group(1)) == pytest.approx(tau, rel=1e-12)
    assert float(row.group(2)) == pytest.approx(p95, rel=1e-12)
    assert row.group(3) == run.data.tags["tau_used"] == f"none → {tau:.4g}"

    # the chart view (one click away) opens on the answer's section; the other metrics' section is collapsed
    charts = link + "&compareRunsMode=CHART"
    text = _visible_text(_browser(chromium, charts, "--dump-dom"))
    first, others = text.find("Gradient clipping (7)"), text.find("Model metrics (")
    assert 0 < first < others, text
    _browser(
        chromium,
        charts,
        "--window-size=1600,1400",
        "--virtual-time-budget=60000",
        f"--screenshot={screens / 'mlflow-charts.png'}",
    )
