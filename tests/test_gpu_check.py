"""scripts/gpu_check: one line and exit 0 without a CUDA device; its driver runs every phase under its
own limit, records a failing or overrunning phase and goes on; the smoke profile runs end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check_driver", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_cuda_device_it_prints_one_line_and_exits_0(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path / "out"))
    p = subprocess.run(["bash", "scripts/gpu_check"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    assert p.stderr == ""
    assert len(p.stdout.splitlines()) == 1 and p.stdout.startswith("gpu_check: no CUDA device visible")
    assert not (tmp_path / "out").exists()  # nothing installed, nothing written


def test_a_failing_or_overrunning_phase_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    g = _driver()
    monkeypatch.setitem(g.LIMITS, "tests", 1)
    check = g.Check(tmp_path, budget=60, profile="smoke")
    py = sys.executable
    jobs = {
        "tests": ([py, "-c", "import time; print('started', flush=True); time.sleep(30)"], tmp_path, dict(os.environ)),
        "sweep": ([py, "-c", "raise SystemExit('broken phase')"], tmp_path, dict(os.environ)),
        "step_bf16": ([py, "-c", "print('fine')"], tmp_path, dict(os.environ)),
    }
    results = g.run_phases(check, jobs)
    assert results["tests"]["status"] == "timeout" and results["tests"]["seconds"] < 10
    assert "no result within 1 s" in results["tests"]["error"] and "started" in results["tests"]["error"]
    assert results["sweep"]["status"] == "failed" and results["sweep"]["rc"] == 1
    assert results["sweep"]["error"].splitlines()[-1] == "broken phase"
    assert results["step_bf16"]["status"] == "ok"
    for name, result in results.items():
        check.record(name, result)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {n: r["status"] for n, r in saved["phases"].items()} == {
        "tests": "timeout",
        "sweep": "failed",
        "step_bf16": "ok",
    }
    lines = g.format_summary(saved).splitlines()
    assert [ln.split()[:2] for ln in lines[2:]] == [["tests", "timeout"], ["sweep", "failed"], ["step_bf16", "ok"]]
    assert lines[3].endswith("broken phase")


def test_a_phase_past_the_budget_is_not_run(tmp_path):
    g = _driver()
    check = g.Check(tmp_path, budget=3, profile="smoke")
    results = g.run_phases(check, {"tests": ([sys.executable, "-c", "pass"], tmp_path, dict(os.environ))})
    assert results == {"tests": {"status": "not run", "error": "no time left in the check's budget"}}


def test_a_phase_that_did_not_run_makes_the_exit_status_1(tmp_path):
    argv = [sys.executable, "scripts/gpu_check.py", "--profile", "smoke", "--out", str(tmp_path), "--only", "tests"]
    p = subprocess.run([*argv, "--budget", "3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and p.stderr == ""
    assert "tests           not run" in p.stdout
    head = json.loads((tmp_path / "gpu_check.json").read_text())["headline"]
    assert head["failed"] == {"tests": "no time left in the check's budget"}


def test_uv_gets_pips_registry_settings(monkeypatch):
    g = _driver()
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    config = "global.index-url='https://ignored.example/simple'\n:env:.find-links='/opt/wheels'\nglobal.timeout='60'\n"
    env = g.uv_env(config)
    assert env["UV_INDEX_URL"] == "https://mirror.example/simple"  # the variable wins over the file, as for pip
    assert env["UV_FIND_LINKS"] == "/opt/wheels"
    assert "UV_TIMEOUT" not in env and env["UV_HTTP_TIMEOUT"] == "60"


def test_scale_trace_counts_backoffs_and_growths_from_the_store(store):
    """The fp16 figures come from the run's MLflow store: latest metrics and the scaler_scale history."""
    from mlflow import MlflowClient

    g = _driver()
    client = MlflowClient(store)
    exp = client.create_experiment("x")
    run = client.create_run(exp, run_name="calibrate-gpt-fp16", tags={"dtype": "fp16"}).info.run_id
    for step, scale in enumerate([65536.0, 65536.0, 32768.0, 32768.0, 65536.0, 16384.0, 16384.0], start=1):
        client.log_metric(run, "scaler_scale", scale, step=step)
    client.log_metric(run, "recommended_max_norm", 1.25)
    client.log_metric(run, "skip_ratio", 2 / 7)
    client.set_terminated(run)
    (figures,) = g.mlflow_figures(Path(store.removeprefix("sqlite:///")))
    assert figures["dtype"] == "fp16" and figures["status"] == "FINISHED" and not figures["child"]
    assert figures["recommended_max_norm"] == 1.25 and figures["skip_ratio"] == pytest.approx(2 / 7)
    scale = figures["scale"]
    assert (scale["first"], scale["last"], scale["min"], scale["backoffs"], scale["growths"]) == (
        65536,
        16384,
        16384,
        2,
        1,
    )
    assert scale["changes"] == [(1, 65536.0), (3, 32768.0), (5, 65536.0), (6, 16384.0)]
    assert g._run_note(figures) == "fp16 τ=1.25 clip - skip 28.6% loss - scale 65536→16384 (2 back-offs)"


@pytest.mark.slow
def test_junit_figures_read_outcomes_messages_and_properties(tmp_path):
    g = _driver()
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_ok(record_property):\n    record_property('syncs', 3)\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='needs a CUDA device')\ndef test_gpu():\n    pass\n"
    )
    xml = tmp_path / "out.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path), "--junitxml", str(xml)]
    subprocess.run(argv, cwd=tmp_path, capture_output=True, timeout=120)
    f = g.junit_figures(xml)
    assert f["counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert f["outcomes"] == {"test_x::test_ok": "passed", "test_x::test_bad": "failed", "test_x::test_gpu": "skipped"}
    assert "one is not two" in f["failures"]["test_x::test_bad"]
    assert f["skips"] == {"test_x::test_gpu": "needs a CUDA device"} and f["properties"] == {"syncs": "3"}


@pytest.mark.slow
def test_smoke_profile_runs_every_phase_and_its_figures_agree_with_the_logs(tmp_path):
    """The driver at toy sizes on this CPU: the cuda tests all skip (none counted as passing), the
    calibrate figure read from the MLflow store is the τ the run printed, the benches' JSON arrives."""
    only = "tests,calibrate_fp16,pipeline_50M,step_bf16"
    argv = [sys.executable, "scripts/gpu_check.py", "--profile", "smoke", "--out", str(tmp_path), "--only", only]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    phases = data["phases"]
    assert {n: r["status"] for n, r in phases.items()} == dict.fromkeys(only.split(","), "ok")

    tests = phases["tests"]["figures"]
    assert tests["counts"]["passed"] == 0 and tests["counts"]["failed"] == 0 and tests["counts"]["skipped"] >= 20
    assert set(tests["skips"].values()) <= {
        "needs a CUDA device",
        "NCCL across ranks needs 2 CUDA devices (one rank per GPU)",
    }

    (run,) = phases["calibrate_fp16"]["figures"]["runs"]
    printed = re.search(r"Recommended clip.max_norm=([0-9.]+)", (tmp_path / "calibrate_fp16.log").read_text())
    assert run["dtype"] == "fp16" and run["status"] == "FINISHED"
    assert f"{run['recommended_max_norm']:.4g}" == f"{float(printed.group(1)):.4g}"
    assert run["scale"]["first"] == 65536.0 and 0 <= run["skip_ratio"] <= 1

    pipeline = phases["pipeline_50M"]["figures"]["variants"]
    assert set(pipeline) == {"fp32", "bf16"} and all(v["ratios"]["a/d"] > 0 for v in pipeline.values())
    assert phases["step_bf16"]["figures"]["dtype"] == "bf16"
    head = data["headline"]
    assert head["failed"] == {} and head["tests"] == tests["counts"]
    assert head["calibrate_fp16"]["recommended_max_norm"] == run["recommended_max_norm"]
    assert head["pipeline_50M"]["fp32"]["canonical_over_fused"] == pipeline["fp32"]["ratios"]["b/d"]
    assert head["step_bf16_engine_over_canonical"] == phases["step_bf16"]["figures"]["ratio_paired"]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.splitlines()[0].startswith("gpu_check (smoke)") and p.stdout.startswith(summary)
