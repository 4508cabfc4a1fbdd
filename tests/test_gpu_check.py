"""scripts/gpu_check: one line and exit 0 without a CUDA device; its driver runs every phase under its
own limit, records a failing or overrunning phase and goes on; the smoke profile runs end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str = "gpu_check"):
    """``scripts/NAME.py`` loaded as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
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


@pytest.mark.slow  # runs the wrapper and the driver in a subprocess
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_shows_the_options_without_a_cuda_device(tmp_path, flag):
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # a python3 >= 3.11 first
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path / "out"), PATH=path)
    argv = ["bash", "scripts/gpu_check", "--profile", "smoke", flag]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr
    assert p.stdout.startswith("usage: gpu_check.py") and "no CUDA device" not in p.stdout
    assert all(f"--{name}" in p.stdout for name in ("out", "budget", "profile", "only", "work", "wheels"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # waits out a 1 s phase limit
def test_a_failing_or_overrunning_phase_is_recorded_and_the_next_one_runs(tmp_path, monkeypatch):
    g = _script()
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
    g = _script()
    check = g.Check(tmp_path, budget=3, profile="smoke")
    results = g.run_phases(check, {"tests": ([sys.executable, "-c", "pass"], tmp_path, dict(os.environ))})
    assert results == {"tests": {"status": "not run", "error": "no time left in the check's budget"}}


def test_a_phase_that_did_not_run_makes_the_exit_status_1(tmp_path):
    argv = [sys.executable, "scripts/gpu_check.py", "--profile", "smoke", "--out", str(tmp_path), "--only", "tests"]
    p = subprocess.run(
        [*argv, "--budget", "3", "--work", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 1 and p.stderr == ""
    assert "tests           not run" in p.stdout
    head = json.loads((tmp_path / "gpu_check.json").read_text())["headline"]
    assert head["failed"] == {"tests": "no time left in the check's budget"}


def test_uv_gets_pips_registry_settings(monkeypatch):
    g = _script()
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

    g = _script()
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
def test_bandwidth_is_read_against_the_measured_copy_and_the_datasheet_peak():
    """The bench's line and the summary's give each arm's GB/s as a share of the measured copy
    bandwidth and of the peak, and leave out a ceiling that is not known."""
    spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "bench" / "bench_pipeline.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gbs = {"c": 3870.0, "d": 3440.0}
    assert bench.bandwidth_line(gbs, 4300.0, 4916.0) == (
        "(c) 3870 GB/s = 90% of copy 4300, 79% of peak 4916   (d) 3440 GB/s = 80% of copy 4300, 70% of peak 4916"
    )
    assert (
        bench.bandwidth_line(gbs, 4300.0, None) == "(c) 3870 GB/s = 90% of copy 4300   (d) 3440 GB/s = 80% of copy 4300"
    )
    assert bench.bandwidth_line(gbs, None, None) == "(c) 3870 GB/s   (d) 3440 GB/s"
    copy = bench.copy_gbs("cpu", nbytes=2**22, reps=3)  # the same code as on CUDA, bar the synchronize
    assert 0 < copy < float("inf")

    check = _script()
    ratios = {"a/d": 1.5, "b/d": 1.25, "d/c": 1.1}
    fig = {"ratios": ratios, "achieved_gbs": gbs, "copy_gbs": 4300.0, "peak_gbs": 4916.0}
    line = check._phase_line("pipeline_1B", {"status": "ok", "figures": {"variants": {"bf16": fig}}})
    want = "bf16: canonical/fused 1.25x (with foreach AdamW 1.50x), fused/floor 1.10, (d) 3440 GB/s"
    assert want + " = 80% of copy, 70% of peak" in line
    head = check.headline({"pipeline_1B": {"status": "ok", "figures": {"variants": {"bf16": fig}}}})
    assert head["pipeline_1B"]["bf16"] == {
        "canonical_over_fused": 1.25,
        "canonical_foreach_over_fused": 1.5,
        "fused_over_floor": 1.1,
        "fused_gbs": 3440.0,
        "copy_gbs": 4300.0,
        "peak_gbs": 4916.0,
    }


@pytest.mark.slow  # a pytest subprocess
def test_junit_figures_read_outcomes_messages_and_properties(tmp_path):
    g = _script()
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


def test_a_property_that_several_tests_record_keeps_each_tests_value(tmp_path):
    """test_fp16_skips_backoff_and_growth_match_gradscaler[default] and [fused] both record
    fp16_scale_trace: both traces are kept, keyed by the test's parameters (else its name)."""
    g = _script()
    case = '<testcase classname="tests.cuda.{m}" name="{t}"><properties>{p}</properties></testcase>'
    prop = '<property name="{n}" value="{v}" />'
    trace = "test_fp16_skips_backoff_and_growth_match_gradscaler[{}]"
    cases = [
        case.format(m="test_scaler", t=trace.format("default"), p=prop.format(n="fp16_scale_trace", v="[1, 2]")),
        case.format(m="test_scaler", t=trace.format("fused"), p=prop.format(n="fp16_scale_trace", v="[1, 3]")),
        case.format(m="test_syncs", t="test_one", p=prop.format(n="syncs_bf16", v="0") + prop.format(n="n", v="1")),
        case.format(m="test_syncs", t="test_two", p=prop.format(n="n", v="2")),
    ]
    (tmp_path / "t.xml").write_text(f'<testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>')
    assert g.junit_figures(tmp_path / "t.xml")["properties"] == {
        "fp16_scale_trace[default]": "[1, 2]",
        "fp16_scale_trace[fused]": "[1, 3]",
        "syncs_bf16": "0",
        "n[test_syncs::test_one]": "1",
        "n[test_syncs::test_two]": "2",
    }


@pytest.mark.slow
def test_smoke_profile_runs_every_phase_and_its_figures_agree_with_the_logs(tmp_path):
    """The driver at toy sizes on this CPU: the cuda tests all skip (none counted as passing), the
    calibrate figure read from the MLflow store is the τ the run printed, the benches' JSON arrives,
    and the out folder holds three files, the logs and stores bundled in one."""
    only = "tests,calibrate_fp16,pipeline_50M,step_bf16"
    out = tmp_path / "out"
    argv = [sys.executable, "scripts/gpu_check.py", "--profile", "smoke", "--out", str(out), "--only", only]
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    argv += ["--work", str(tmp_path / "work")]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    assert sorted(f.name for f in out.iterdir()) == ["gpu_check.json", "gpu_check_files.tar.gz", "summary.txt"]
    with tarfile.open(out / "gpu_check_files.tar.gz") as tar:
        bundled = set(tar.getnames())
        log = tar.extractfile("calibrate_fp16.log").read().decode()
    assert {"tests.xml", "pipeline_50M.json", "step_bf16.json", "app/calibrate_fp16/mlflow.db"} <= bundled
    assert {f"{name}.log" for name in only.split(",")} <= bundled
    data = json.loads((out / "gpu_check.json").read_text())
    phases = data["phases"]
    assert {n: r["status"] for n, r in phases.items()} == dict.fromkeys(only.split(","), "ok")

    tests = phases["tests"]["figures"]
    assert tests["counts"]["passed"] == 0 and tests["counts"]["failed"] == 0 and tests["counts"]["skipped"] >= 20
    assert set(tests["skips"].values()) <= {
        "needs a CUDA device",
        "NCCL across ranks needs 2 CUDA devices (one rank per GPU)",
    }

    (run,) = phases["calibrate_fp16"]["figures"]["runs"]
    printed = re.search(r"Recommended clip.max_norm=([0-9.]+)", log)
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
    summary = (out / "summary.txt").read_text()
    assert summary.splitlines()[0].startswith("gpu_check (smoke)") and p.stdout.startswith(summary)


# -- installing on a machine that has torch and no registry ---------------------------------------
def _wheel(folder: Path, name: str, version: str, size: int = 0, requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel pip installs: one module, METADATA, WHEEL, RECORD; ``size`` bytes of padding."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n" + "#" * size)
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_the_check_needs_pyprojects_runtime_with_pyprojects_bounds():
    """scripts/gpu_requirements.txt is pyproject.toml's dependencies with the same bounds, less torch
    (the machine's own) and what no phase imports; mlflow-skinny stands for mlflow."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ours = {canonicalize_name(r.name): r.specifier for r in map(Requirement, project["dependencies"])}
    ours |= {canonicalize_name(r.name): r.specifier for r in map(Requirement, project["optional-dependencies"]["dev"])}
    lines = (ROOT / "scripts" / "gpu_requirements.txt").read_text().splitlines()
    check = {canonicalize_name(r.name): r.specifier for r in (Requirement(ln) for ln in lines if ln and ln[0] != "#")}
    assert check.pop("mlflow-skinny") == ours["mlflow"]
    assert check.pop("sqlalchemy") == check.pop("alembic") == SpecifierSet()  # the sqlite store's, mlflow's bounds
    assert check == {name: ours[name] for name in check}
    not_needed = {"torch", "transformers", "tokenizers", "datasets", "safetensors", "accelerate", "tensorboard"}
    runtime = {canonicalize_name(Requirement(d).name) for d in project["dependencies"]}
    assert runtime - not_needed - {"mlflow"} == set(check) - {"pytest"}


def test_the_wheelhouse_leaves_out_only_large_wheels_the_machine_has_at_a_fitting_version(tmp_path, monkeypatch):
    w = _script("gpu_wheels")
    req = tmp_path / "requirements.txt"
    req.write_text("# comment\nappdep>=2\n")
    monkeypatch.setattr(w, "REQUIREMENTS", req)
    big = 1_200_000
    wheels = [
        _wheel(tmp_path, "appdep", "2.0", requires=("held_ok", "held_old>=3", 'held_py39; python_version < "3.10"')),
        _wheel(tmp_path, "held_ok", "1.0", size=big),  # the machine has 1.5: nothing asks more
        _wheel(tmp_path, "held_old", "3.1", size=big),  # the machine has 2.9: appdep needs >= 3
        _wheel(tmp_path, "held_unversioned", "1.0", size=big),
        _wheel(tmp_path, "held_small", "1.0"),
        _wheel(tmp_path, "held_py39", "1.0", size=big),  # a requirement for another Python: not counted
        _wheel(tmp_path, "not_held", "1.0", size=big),
    ]
    have = tmp_path / "have.txt"
    have.write_text(
        "# the machine\nheld-ok==1.5\nHeld_Old==2.9\nheld.unversioned @ file:///wheels/h.whl\n"
        "held-small==1.0\nheld-py39==0.1\n-e git+https://example.org/x.git#egg=not_held\n"
    )
    out = w.leave_out(wheels, w.read_have(have), keep_under=1.0, env=w.target_env("3.12"))
    assert sorted(p.name.split("-")[0] for p in out) == ["held_ok", "held_py39", "held_unversioned"]


@pytest.mark.slow
def test_install_uses_the_systems_torch_and_takes_the_rest_from_the_wheelhouse_offline(tmp_path, monkeypatch):
    """This interpreter plays the CUDA machine's: its torch is used where it is, a missing project
    comes from the wheelhouse with no index, and a project the wheelhouse lacks fails the phase with
    pip's message while the venv is still handed to the phases."""
    import torch

    g = _script()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "clipamp_probe_dep", "1.0")
    req = tmp_path / "requirements.txt"
    req.write_text("clipamp-probe-dep>=1\npytest>=8\n")
    monkeypatch.setattr(g, "REQUIREMENTS", req)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # an index contact would fail
    check = g.Check(tmp_path / "out", budget=300, profile="smoke")
    result, py = g.install(check, tmp_path / "venv", wheels, need_cuda=False)
    assert result["status"] == "ok", result
    assert result["how"] == f"system torch {torch.__version__} reused; pip from wheels/ (--no-index)"
    assert py == str(tmp_path / "venv" / "bin" / "python") and result["torch"][0] == torch.__version__
    code = "import clipamp_probe_dep, torch; print(clipamp_probe_dep.__file__); print(torch.__file__)"
    dep, torch_file = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert Path(dep).is_relative_to(tmp_path / "venv") and torch_file == torch.__file__

    req.write_text("clipamp-probe-dep>=1\nclipamp-probe-missing\n")
    result, py = g.install(check, tmp_path / "venv2", wheels, need_cuda=False)
    assert result["status"] == "failed" and py == str(tmp_path / "venv2" / "bin" / "python")
    assert "No matching distribution found for clipamp-probe-missing" in result["error"]


@pytest.mark.slow  # makes a venv and runs the wrapper in it
def test_the_wrapper_runs_the_python_that_has_torch(tmp_path):
    """With a GPU listed, a python3 that has torch and a python3.12 that has not, the driver runs
    under the one with torch (a CUDA image's own), whatever the order of the names."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: Fake (UUID: GPU-0)'\n")
    (bin_ / "nvidia-smi").chmod(0o755)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    bare = tmp_path / "bare" / "bin" / "python"  # the base interpreter, without torch
    assert subprocess.run([bare, "-c", "import torch"], capture_output=True).returncode != 0
    for name, python in (("python3.12", bare), ("python3", sys.executable)):  # python3: the image's, with torch
        (bin_ / name).write_text(f'#!/bin/sh\nexec "{python}" "$@"\n')  # a link would lose the venv
        (bin_ / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", CUDA_VISIBLE_DEVICES="0")
    argv = [
        "bash",
        "scripts/gpu_check",
        "--profile",
        "smoke",
        "--only",
        "tests",
        "--budget",
        "3",
        "--out",
        str(tmp_path),
        "--work",
        str(tmp_path / "work"),
    ]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "tests           not run" in p.stdout, p.stdout + p.stderr
    assert json.loads((tmp_path / "gpu_check.json").read_text())["python"] == sys.executable


def test_the_gpu_profiles_commands_compose_and_parse(tmp_path):
    """What the check runs on a GPU, checked here: each app run's overrides compose into the typed
    config at the GPU size (85M parameters) without periodic checkpoints, and each bench's
    arguments parse."""
    from tests.app.helpers import compose_cfg
    from tests.docs.pages import script_parses

    g = _script()
    check = g.Check(tmp_path, budget=60, profile="gpu")
    concurrent, timed = g.jobs_for(check, sys.executable, g.PROFILES["gpu"], only=set())
    assert set(concurrent) | set(timed) == set(g.PHASES) - {"install"}
    for name in ("calibrate_bf16", "calibrate_fp16", "sweep"):
        argv = concurrent[name][0]
        assert argv[1:3] == ["-m", "sweep"]
        cfg = compose_cfg(*argv[3:])
        assert cfg.device == "cuda" and cfg.model.d_model == 768 and cfg.data.seq_len == 512
        assert cfg.checkpoint_every == 0  # not one ~1 GB checkpoint per 100 steps, three runs at once
        assert cfg.tracking.uri == f"sqlite:///{tmp_path / 'work' / 'app' / name / 'mlflow.db'}"
    for name, (argv, _, _) in timed.items():
        script_parses(argv[1], argv[2:])
        assert argv[argv.index("--device") + 1] == "cuda", name


FIX = "give --work a new or empty folder of its own, e.g. .gpu_check_work"


@pytest.mark.parametrize("where", ["checkout", "out", "above_out", "foreign"])
def test_a_work_folder_it_would_empty_wrongly_is_refused(tmp_path, where):
    """Nothing the check did not write is deleted: a folder holding --out, or anything else, is
    refused with one line naming it and the fix (the old check emptied it, --out with it)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept.txt").write_text("figures from an earlier check")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "keep.txt").write_text("x")
    work = {"checkout": ROOT, "out": out, "above_out": tmp_path, "foreign": tmp_path / "precious"}[where]
    argv = [sys.executable, "scripts/gpu_check.py", "--profile", "smoke", "--out", str(out), "--work", str(work)]
    argv += ["--only", "tests", "--budget", "3"]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == ""
    why = {
        "checkout": "a system, home or temp folder, the checkout or one above it; " + FIX,
        "out": f"--out {out} is inside it; {FIX}, apart from --out",
        "above_out": f"--out {out} is inside it; {FIX}, apart from --out",
        "foreign": f"holds keep.txt, which the check did not write and would not empty; {FIX}",
    }[where]
    assert p.stderr.splitlines()[-1] == f"gpu_check.py: error: --work {work}: {why}"
    assert (out / "kept.txt").read_text() == "figures from an earlier check" and (ROOT / "pyproject.toml").exists()
    assert (tmp_path / "precious" / "keep.txt").read_text() == "x"


def test_home_root_and_temp_folders_are_refused_and_an_earlier_checks_files_are_emptied(tmp_path):
    """/, $HOME, /tmp and the folders right under / are never a work folder, even empty; a work
    folder that holds only what a check wrote (the default one, on a second run) is emptied."""
    g = _script()
    out = tmp_path / "out"
    for folder in (Path("/"), Path.home(), Path("/tmp"), Path("/var/tmp"), Path("/opt"), ROOT.parent):
        why = g.work_refusal(folder.resolve(), out)
        assert why and why.startswith(f"--work {folder.resolve()}: a system, home or temp folder"), folder
        assert why.endswith(FIX)
    with pytest.raises(ValueError, match="holds notes.md, which the check did not write"):
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "notes.md").write_text("mine")
        g.Check(out, budget=60, profile="smoke", work=tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.md").exists()

    work = tmp_path / "work"
    check = g.Check(out, budget=60, profile="smoke", work=work)
    g.run_phases(check, {"sweep": ([sys.executable, "-c", "open('mlflow.db', 'w')"], work / "app" / "sweep", {})})
    (work / "tests.xml").write_text("<testsuites/>")
    check.record("sweep", {"status": "ok"})
    assert sorted(p.name for p in work.rglob("*")) == ["app", "mlflow.db", "sweep", "sweep.log", "tests.xml"]
    assert g.work_refusal(work, out) is None
    g.Check(out, budget=60, profile="smoke", work=work)  # the second run
    assert [p.name for p in work.rglob("*")] == ["app"]
    (work / "app" / "mine").mkdir()
    why = "holds app/mine, which the check did not write and would not empty"
    assert g.work_refusal(work, out) == f"--work {work}: {why}; {FIX}"


@pytest.mark.slow  # runs the wheelhouse script in subprocesses
def test_the_wheelhouse_script_names_a_missing_have_file_and_a_failing_pip(tmp_path):
    """A --have file that is not there is refused before any download; pip failing (here: no index,
    nothing to find) ends with one line naming pip's step, after pip's own message."""
    script = [sys.executable, "scripts/gpu_wheels.py", str(tmp_path / "whl")]
    p = subprocess.run([*script, "--have", str(tmp_path / "nope.txt")], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and not (tmp_path / "whl").exists()
    assert p.stderr.splitlines()[-1] == (
        f"gpu_wheels.py: error: --have {tmp_path / 'nope.txt'}: no such file "
        "(write the machine's `pip list --format=freeze` there)"
    )
    (tmp_path / "empty").mkdir()
    offline = dict(os.environ, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(tmp_path / "empty"))
    p = subprocess.run(script, cwd=ROOT, env=offline, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "No matching distribution found for antlr4-python3-runtime==4.9.3" in p.stderr
    assert p.stderr.splitlines()[-1] == "gpu_wheels: pip wheel failed (exit 1), see above; nothing left out"
