"""The CUDA check behind ``scripts/gpu_check``: install, then each phase under its own timeout.

    python scripts/gpu_check.py [--out DIR] [--budget SECONDS] [--profile gpu|smoke] [--python PY] [--only a,b]
                                [--wheels DIR] [--venv DIR] [--install] [--work DIR]

Phases (docs/cuda.md): ``install`` (a ``.venv-gpu`` over the machine's own CUDA torch with
``scripts/gpu_requirements.txt`` from the registry or, offline, from a wheelhouse; else torch's
CUDA build and the project from the registry), ``tests`` (``pytest -m cuda`` over ``tests/cuda``
and ``tests/engine/test_fused.py``, where it selects ``test_no_cuda_sync_between_flushes``;
figures from ``record_property`` in the JUnit XML), the app runs ``calibrate_bf16``,
``calibrate_fp16`` and ``sweep`` (concurrent with the tests: their figures are thresholds and
ratios, not times), then the timed benches, alone on the device: ``pipeline_50M``,
``pipeline_1B``, ``step_fp16``, ``step_bf16``. A phase that fails, or runs out of its time, is
recorded with its error in the JSON and the next one runs; one overall deadline (``--budget``)
bounds them all. ``--only`` picks among the phases after ``install``, which runs first whatever
``--only`` says, unless ``--python PY`` is given (or ``--profile smoke`` without ``--install``).
Writes three files under ``--out``: ``gpu_check.json``, ``summary.txt`` and
``gpu_check_files.tar.gz`` (the logs, the JUnit XML, the benches' JSON, the MLflow stores; loose in
``--work``, where only an earlier check's files are removed: a folder holding others is refused).
Exits 0 when every phase run succeeded, 1 otherwise.

``--profile smoke`` runs every phase at toy sizes, the app runs and the benches on the CPU (only
the ``pytest -m cuda`` phase uses a GPU, where one is visible), without installing anything (with
``--install``, after the install phase, which then accepts a CPU torch): it checks this driver, not
the device.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-gpu"
TORCH = "torch==2.13.0"  # on the default registry, Linux x86_64: the CUDA build
#: A system torch at least this new and built for CUDA is used as it is: the oldest release the
#: suite has passed on (docs/cuda.md).
MIN_SYSTEM_TORCH = (2, 11)
REQUIREMENTS = REPO / "scripts" / "gpu_requirements.txt"
UV_TOOL = Path(tempfile.gettempdir()) / "clipamp-gpu-check-uv"

#: The app's model and data at a GPU size: the GPT-2-small shape with a byte vocabulary (85M params).
GPU_TASK = (
    "model.d_model=768",
    "model.n_layer=12",
    "model.n_head=12",
    "model.block_size=512",
    "data.seq_len=512",
    "data.batch_size=16",
)
SMOKE_TASK = ("model.d_model=32", "model.n_layer=1", "model.block_size=32", "data.seq_len=32", "data.batch_size=4")

#: Per profile: the app runs' overrides and the benches' arguments.
PROFILES = {
    "gpu": {
        "device": "cuda",
        "calibrate": ("steps=500",),
        "sweep": ("steps=250", "calibrate.window=60", "study.n_trials=4", "optim.warmup_steps=25"),
        "pipeline_50M": ("--numel", "50e6", "--rounds", "7", "--iters", "3"),
        "pipeline_1B": ("--numel", "1e9", "--rounds", "5", "--iters", "2"),
        "step": ("--d-model", "768", "--layers", "12", "--heads", "12", "--vocab", "50257", "--tie")
        + ("--batch", "16", "--seq", "512", "--steps", "15", "--rounds", "4"),
    },
    "smoke": {
        "device": "cpu",
        "calibrate": ("steps=40", "calibrate.window=15", "calibrate.start=0"),
        "sweep": ("steps=20", "calibrate.window=8", "study.n_trials=2"),
        "pipeline_50M": ("--numel", "2e6", "--rounds", "1", "--iters", "1"),
        "pipeline_1B": ("--numel", "3e6", "--rounds", "1", "--iters", "1"),
        "step": ("--d-model", "32", "--layers", "1", "--heads", "2", "--batch", "2", "--seq", "16")
        + ("--steps", "2", "--rounds", "1"),
    },
}

#: Each phase's own time limit (seconds); the overall deadline can shorten it.
LIMITS = {
    "install": 300,
    "tests": 150,
    "calibrate_bf16": 150,
    "calibrate_fp16": 150,
    "sweep": 170,
    "pipeline_50M": 60,
    "pipeline_1B": 110,
    "step_fp16": 60,
    "step_bf16": 60,
}
CONCURRENT = ("tests", "calibrate_bf16", "calibrate_fp16", "sweep")
TIMED = ("pipeline_50M", "pipeline_1B", "step_fp16", "step_bf16")
PHASES = ("install", *CONCURRENT, *TIMED)

METRICS = (
    "recommended_max_norm",
    "grad_norm_p95",
    "clip_ratio",
    "skip_ratio",
    "final_loss",
    "eval_loss",
    "validation_clip_ratio",
    "steps_skipped",
)


class Check:
    """The JSON being built: written after every phase, so a killed check still leaves its figures.

    ``out`` receives three files: ``gpu_check.json``, ``summary.txt`` and ``gpu_check_files.tar.gz``
    (every log, the JUnit XML, the benches' JSON and the app runs' MLflow stores, rewritten after
    each phase). The loose files live in ``work``, emptied of an earlier check's files first; a
    ``work`` that :func:`work_refusal` refuses raises ValueError.
    """

    BUNDLE = "gpu_check_files.tar.gz"
    BUNDLE_MAX = 15 * 2**20  # past this, the bundle leaves the MLflow stores out (their figures are in the JSON)

    def __init__(self, out: Path, budget: float, profile: str, work: Path | None = None) -> None:
        self.out, self.t0, self.budget = out, time.monotonic(), budget
        self.work = work or out / "work"
        self.data: dict = {
            "profile": profile,
            "budget_s": budget,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": sys.executable,
        }
        self.data["phases"] = {}
        refusal = work_refusal(self.work.resolve(), out.resolve())
        if refusal:
            raise ValueError(refusal)
        out.mkdir(parents=True, exist_ok=True)
        clear_work(self.work)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def record(self, name: str, result: dict) -> None:
        self.data["phases"][name] = result
        self.save()
        self.bundle()

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str))

    def bundle(self) -> Path:
        path = self.out / self.BUNDLE
        for skip in ((), ("app",)):
            with tarfile.open(path, "w:gz") as tar:
                for item in sorted(self.work.iterdir()):
                    if item.name not in skip:
                        tar.add(item, arcname=item.name)
            if path.stat().st_size <= self.BUNDLE_MAX:
                break
        return path


#: What the check writes into ``--work``, and all it removes from there: a log per phase, the JUnit
#: XML, the benches' JSON and ``app/`` with a folder per app run.
WORK_FILES = {"tests.xml", *(f"{p}.log" for p in PHASES), *(f"{p}.json" for p in TIMED)}
APP_RUNS = ("calibrate_bf16", "calibrate_fp16", "sweep")


def foreign_entries(work: Path) -> list[str]:
    """What ``work`` holds that the check does not write there (relative names; [] when none or no folder)."""
    if not work.is_dir():
        return []
    found = []
    for item in sorted(work.iterdir()):
        if item.name == "app" and item.is_dir() and not item.is_symlink():
            found += [f"app/{run.name}" for run in sorted(item.iterdir()) if run.name not in APP_RUNS]
        elif item.name not in WORK_FILES or item.is_dir():
            found.append(item.name)
    return found


def work_refusal(work: Path, out: Path) -> str | None:
    """Why ``work`` (resolved) must not hold the loose files, as one line naming the fix; None when it may.

    Refused: ``/`` and the folders right under it, ``$HOME``, the temp folders, the checkout and the
    folders above any of them, ``--out`` or a folder holding it, and a folder holding anything that
    the check does not write (:data:`WORK_FILES`, ``app/`` runs): the check empties only its own.
    """
    home = Path.home().resolve()
    temps = {Path(tempfile.gettempdir()).resolve(), Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")}
    shared = {home, *home.parents, REPO, *REPO.parents, *temps}
    fix = "give --work a new or empty folder of its own, e.g. .gpu_check_work"
    if work in shared or work.parent == Path(work.anchor):
        return f"--work {work}: a system, home or temp folder, the checkout or one above it; {fix}"
    if work == out or work in out.parents:
        return f"--work {work}: --out {out} is inside it; {fix}, apart from --out"
    if work.exists() and not work.is_dir():
        return f"--work {work}: not a folder; {fix}"
    strangers = foreign_entries(work)
    if strangers:
        listed = ", ".join(strangers[:3]) + (f" and {len(strangers) - 3} more" if len(strangers) > 3 else "")
        return f"--work {work}: holds {listed}, which the check did not write and would not empty; {fix}"
    return None


def clear_work(work: Path) -> None:
    """Empty ``work`` of an earlier check's files (it holds no other: :func:`work_refusal`), or make it."""
    work.mkdir(parents=True, exist_ok=True)
    for item in work.iterdir():
        if item.name == "app" and item.is_dir() and not item.is_symlink():
            for run in item.iterdir():
                if run.name in APP_RUNS and run.is_dir() and not run.is_symlink():
                    shutil.rmtree(run)
                elif run.name in APP_RUNS:
                    run.unlink()
        elif item.name in WORK_FILES and not item.is_dir():
            item.unlink()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the phase's whole process group (spawned ranks, pip's children)
    except ProcessLookupError:
        pass
    proc.wait()


def run_phases(check: Check, jobs: dict[str, tuple[list[str], Path, dict]]) -> dict[str, dict]:
    """Run ``jobs`` (name → argv, cwd, env) at once, each until its own limit or the deadline."""
    procs, results = {}, {}
    for name, (argv, cwd, env) in jobs.items():
        limit = min(LIMITS[name], check.left())
        if check.left() < 5:
            results[name] = {"status": "not run", "error": "no time left in the check's budget"}
            continue
        cwd.mkdir(parents=True, exist_ok=True)
        log = check.work / f"{name}.log"
        with log.open("w") as f:
            f.write("$ " + " ".join(argv) + "\n")
            f.flush()
            proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        procs[name] = (proc, time.monotonic(), limit, log)
    while procs:
        time.sleep(0.2)
        for name, (proc, t0, limit, log) in list(procs.items()):
            took = time.monotonic() - t0
            if proc.poll() is None and took < limit:
                continue
            timed_out = proc.poll() is None
            if timed_out:
                _kill(proc)
            status = "timeout" if timed_out else ("ok" if proc.returncode == 0 else "failed")
            result = {"status": status, "seconds": round(took, 1), "rc": proc.returncode, "log": log.name}
            if status != "ok":
                result["error"] = (f"no result within {limit:.0f} s\n" if timed_out else "") + _tail(log)
            results[name] = result
            del procs[name]
    return {name: results[name] for name in jobs}  # in the jobs' order, whatever order they ended in


# -- install ------------------------------------------------------------------------------------
PROBE = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, torch.cuda.is_available()]))"


def _probe(python: str, *modules: str) -> list | None:
    code = "".join(f"import {m}; " for m in modules) + PROBE
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 and p.stdout.strip() else None


def _sh(argv: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> int:
    with log.open("a") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            _kill(proc)
            f.write(f"timed out after {timeout:.0f} s\n")
            return 124


def _uv(log: Path, timeout: float) -> list[str] | None:
    """A uv command: on PATH, else pip-installed into a scratch folder (``--target``: no venv, no
    ensurepip and no externally-managed refusal involved); None when neither works."""
    found = shutil.which("uv")
    if found:
        return [found]
    exe = UV_TOOL / "bin" / "uv"
    if not exe.exists():
        pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(UV_TOOL)]
        _sh([*pip, "uv"], log, min(90.0, timeout))
    return [str(exe)] if exe.exists() else None


#: pip settings (``pip config list``) → the uv variables that mean the same, so uv reads the same registry.
PIP_TO_UV = {
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
    "cert": "SSL_CERT_FILE",
}


def uv_env(pip_config: str) -> dict[str, str]:
    """The environment for uv: pip's configured indexes, links, constraints and CA bundle carried
    over (``PIP_*`` variables win over config files, as for pip)."""
    env = {}
    for line in pip_config.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in PIP_TO_UV and value:
            env[PIP_TO_UV[name]] = value.strip().strip("'\"")
    for name, uv_name in PIP_TO_UV.items():
        value = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if value:
            env[uv_name] = value
    return {**os.environ, **env, "UV_HTTP_TIMEOUT": "60"}


def _pip_config() -> str:
    try:
        p = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return p.stdout


def _make_venv(venv: Path, uv: list[str] | None, log: Path) -> None:
    if _sh([sys.executable, "-m", "venv", str(venv)], log, 60) != 0 and uv is not None:
        _sh(["rm", "-rf", str(venv)], log, 30)  # venv without ensurepip (python3-venv missing) leaves a husk
        _sh([*uv, "venv", "--python", sys.executable, str(venv)], log, 60, uv_env(_pip_config()))


def torch_at_least(version: str, floor: tuple[int, int] = MIN_SYSTEM_TORCH) -> bool:
    m = re.match(r"(\d+)\.(\d+)", version)
    return bool(m) and (int(m[1]), int(m[2])) >= floor


def system_site_dirs() -> list[str]:
    """This interpreter's site directories (a venv's own, where it is one), in sys.path order."""
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]


def venv_over_system(venv: Path, log: Path) -> str | None:
    """A venv without pip whose ``sys.path`` ends with this interpreter's site directories, so it
    imports the system's torch (and what else is there) behind what gets installed into it; its python.

    ``--system-site-packages`` is not enough when this interpreter is itself a venv: it adds the base
    interpreter's site directory, not this one's.
    """
    if _sh([sys.executable, "-m", "venv", "--without-pip", str(venv)], log, 60) != 0:
        return None
    py = str(venv / "bin" / "python")
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in system_site_dirs())
    (Path(purelib) / "_clipamp_system_site.pth").write_text(lines)
    return py


def default_wheelhouse() -> Path | None:
    """``$GPU_CHECK_WHEELS``, else ``./.whl`` if it holds wheels (``scripts/gpu_wheels.py`` fills it)."""
    path = Path(os.environ.get("GPU_CHECK_WHEELS") or REPO / ".whl")
    return path if path.is_dir() and any(path.glob("*.whl")) else None


def install(
    check: Check, venv: Path = VENV, wheels: Path | None = None, need_cuda: bool = True
) -> tuple[dict, str | None]:
    """A venv (``.venv-gpu``) whose torch sees the GPU and which imports the project: the phases' python.

    Reuses a ready ``.venv-gpu``. When this interpreter has torch ≥ 2.11 built for CUDA, uses that
    torch: a venv over the system's site directories gets what ``scripts/gpu_requirements.txt``
    finds missing there, from the wheelhouse ``wheels`` with ``--no-index`` when one is given, else
    from the registry, and the project runs from the checkout. Otherwise installs ``torch==2.13.0``
    (the CUDA build on the default registry) and the project, with uv (parallel downloads) and pip
    as the fallback. ``need_cuda=False`` accepts a torch without CUDA (the smoke profile's install).

    The phase fails when pip fails or the venv does not import the app; its python is still returned
    whenever that venv's torch works, so the phases that need less (the benches) still run.
    """
    t0, log = time.monotonic(), check.work / "install.log"
    log.write_text("")
    deadline = t0 + min(LIMITS["install"], check.left() - 60)
    py = str(venv / "bin" / "python")
    mods = ("clipamp_engine", "sweep", "mlflow", "optuna", "hydra", "pytest")
    system = _probe(sys.executable)
    result: dict = {"system_python": sys.version.split()[0], "system_torch": system}
    result["wheelhouse"] = f"{wheels} ({len(list(wheels.glob('*.whl')))} wheels)" if wheels else None
    usable = lambda probe: bool(probe and (probe[2] or not need_cuda))  # noqa: E731
    rc, ready = 0, Path(py).exists() and _probe(py, *mods)
    if usable(ready):
        result["how"] = f"reused {venv.name}"
    elif usable(system) and torch_at_least(system[0]):
        _sh(["rm", "-rf", str(venv)], log, 30)
        py = venv_over_system(venv, log) or py
        source = ["--no-index", "--find-links", str(wheels)] if wheels else []
        # The system's pip, imported through the .pth, installs into the venv (its sys.prefix); unlike
        # ``pip --python`` this needs no pip ≥ 22.3.
        pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        where = f"from {wheels.name}/ (--no-index)" if wheels else "from the registry"
        result["how"] = f"system torch {system[0]} reused; pip {where}"
        rc = _sh([*pip, *source, "-r", str(REQUIREMENTS)], log, deadline - time.monotonic())
    else:
        uv = _uv(log, deadline - time.monotonic())
        if not Path(py).exists():
            _make_venv(venv, uv, log)
        want = [TORCH, "-e", str(REPO), "pytest>=8"]
        tools = [("pip", [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"], None)]
        if uv is not None:
            tools.insert(0, ("uv", [*uv, "pip", "install", "--python", py], uv_env(_pip_config())))
        for how, cmd, env in tools:
            result["how"] = how
            rc = _sh([*cmd, *want], log, deadline - time.monotonic(), env)
            if rc == 0:
                break
    if not usable(ready):  # not reused: probe the venv as installed
        ready = _probe(py, *mods)
    torch_probe = ready or _probe(py)
    result["status"] = "ok" if rc == 0 and usable(ready) else "failed"
    result |= {"seconds": round(time.monotonic() - t0, 1), "log": log.name, "torch": torch_probe}
    if result["status"] != "ok":
        if not torch_probe:
            why = "the venv's python does not import torch\n"
        elif not usable(torch_probe):
            why = "torch sees no CUDA device\n"
        else:
            why = "" if ready else f"the venv does not import all of {', '.join(mods)}\n"
        result["error"] = why + _tail(log)
    return result, py if usable(torch_probe) else None


# -- figures ------------------------------------------------------------------------------------
def junit_figures(path: Path) -> dict:
    """Counts, each failure's message and every ``record_property`` figure from pytest's JUnit XML."""
    if not path.exists():
        return {}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures, skips, props, outcomes = {}, {}, {}, {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skip = case.find("skipped")
        outcome = "failed" if bad is not None else "skipped" if skip is not None else "passed"
        counts[outcome] += 1
        outcomes[name] = outcome
        if bad is not None:
            failures[name] = (bad.get("message") or "")[:500]
        elif skip is not None:
            skips[name] = skip.get("message", "")
        for prop in case.iter("property"):
            props.setdefault(prop.get("name"), {})[name] = prop.get("value")
    return {"counts": counts, "outcomes": outcomes, "failures": failures, "skips": skips, "properties": _keyed(props)}


def _keyed(props: dict[str, dict[str, str]]) -> dict[str, str]:
    """One key per recorded value: a property's name when one test recorded it, else ``name[id]``
    for each test that did, ``id`` its parameters (``test_x::test_y[fused]`` → ``fused``) or, where
    those do not tell the tests apart, the whole test name."""
    out = {}
    for prop, by_case in props.items():
        if len(by_case) == 1:
            out[prop] = next(iter(by_case.values()))
            continue
        ids = {case: case.partition("[")[2].rstrip("]") or case for case in by_case}
        if len(set(ids.values())) < len(ids):
            ids = {case: case for case in by_case}
        out |= {f"{prop}[{ids[case]}]": value for case, value in by_case.items()}
    return out


def _scale_trace(db: sqlite3.Connection, run: str) -> dict | None:
    rows = db.execute(
        "SELECT step, value FROM metrics WHERE run_uuid = ? AND key = 'scaler_scale' ORDER BY step, timestamp", (run,)
    ).fetchall()
    if not rows:
        return None
    changes = [rows[0]] + [b for a, b in zip(rows, rows[1:]) if b[1] != a[1]]
    backoffs = sum(b[1] < a[1] for a, b in zip(changes, changes[1:]))
    return {
        "first": rows[0][1],
        "last": rows[-1][1],
        "min": min(v for _, v in rows),
        "backoffs": backoffs,
        "growths": len(changes) - 1 - backoffs,
        "changes": changes[:60],
    }


def mlflow_figures(db_path: Path) -> list[dict]:
    """Every run in an MLflow sqlite store: name, dtype, τ used, the summary metrics, fp16's scale trace."""
    if not db_path.exists():
        return []
    db = sqlite3.connect(db_path)
    try:
        runs = []
        for run, name, status, start, end in db.execute(
            "SELECT run_uuid, name, status, start_time, end_time FROM runs ORDER BY start_time"
        ).fetchall():
            tags = dict(db.execute("SELECT key, value FROM tags WHERE run_uuid = ?", (run,)).fetchall())
            params = dict(db.execute("SELECT key, value FROM params WHERE run_uuid = ?", (run,)).fetchall())
            metrics = dict(db.execute("SELECT key, value FROM latest_metrics WHERE run_uuid = ?", (run,)).fetchall())
            entry = {"name": name, "status": status, "dtype": tags.get("dtype") or params.get("amp.dtype")}
            entry |= {"child": "mlflow.parentRunId" in tags, "max_norm": params.get("clip.max_norm")}
            entry |= {"tau_used": tags.get("tau_used"), "seconds": (end - start) / 1e3 if start and end else None}
            entry |= {k: metrics[k] for k in METRICS if k in metrics}
            if entry["dtype"] == "fp16":
                entry["scale"] = _scale_trace(db, run)
            runs.append(entry)
        return runs
    finally:
        db.close()


def console_lines(log: Path, *prefixes: str) -> list[str]:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [s.strip() for s in lines if s.strip().startswith(prefixes)]


# -- the check ----------------------------------------------------------------------------------
def jobs_for(check: Check, py: str, profile: dict, only: set[str]) -> tuple[dict, dict]:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env |= {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # a CUDA image's own pytest plugins stay out of the tests
    dev, task = profile["device"], GPU_TASK if profile["device"] == "cuda" else SMOKE_TASK
    app = check.work / "app"
    concurrent, timed = {}, {}
    junit = check.work / "tests.xml"
    tests = ["tests/cuda", "tests/engine/test_fused.py"]  # -m cuda: every test marked cuda in them
    concurrent["tests"] = [py, "-m", "pytest", "-m", "cuda", *tests, "-q", "-rA", "-p", "no:cacheprovider"]
    concurrent["tests"] += ["--junitxml", str(junit)]
    for dtype in ("bf16", "fp16"):
        over = ["+experiment=calibrate", f"device={dev}", *task, f"amp.dtype={dtype}", *profile["calibrate"]]
        concurrent[f"calibrate_{dtype}"] = [py, "-m", "sweep", *over]
    concurrent["sweep"] = [py, "-m", "sweep", "+experiment=sweep", f"device={dev}", *task, *profile["sweep"]]
    for name in ("calibrate_bf16", "calibrate_fp16", "sweep"):
        store = f"tracking.uri=sqlite:///{app / name / 'mlflow.db'}"
        # No periodic checkpoint (at 85M parameters each is ~1 GB, three runs writing at once);
        # SIGKILL at a phase's limit writes none either.
        concurrent[name] += [store, "progress_every=100", "checkpoint_every=0"]
    for size in ("50M", "1B"):
        bench = [py, "bench/bench_pipeline.py", "--device", dev, *profile[f"pipeline_{size}"]]
        timed[f"pipeline_{size}"] = [*bench, "--json", str(check.work / f"pipeline_{size}.json")]
    for dtype in ("fp16", "bf16"):
        bench = [
            py,
            "bench/bench_step.py",
            "--device",
            dev,
            "--dtype",
            dtype,
            "--fused",
            "--deferred",
            *profile["step"],
        ]
        timed[f"step_{dtype}"] = [*bench, "--json", str(check.work / f"step_{dtype}.json")]

    def where(name: str) -> Path:
        return app / name if name in ("calibrate_bf16", "calibrate_fp16", "sweep") else REPO

    pick = lambda d: {n: (argv, where(n), env) for n, argv in d.items() if not only or n in only}  # noqa: E731
    return pick(concurrent), pick(timed)


def figures_of(check: Check, name: str) -> dict:
    out = check.work
    if name == "tests":
        return junit_figures(out / "tests.xml")
    if name.startswith(("pipeline_", "step_")):
        path = out / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else {}
    figures = {"runs": mlflow_figures(out / "app" / name / "mlflow.db")}
    figures["console"] = console_lines(out / f"{name}.log", "Recommended", "validation:", "Pick:", "final loss")
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or REPO / "gpu_check_out"))
    ap.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", 470)))
    ap.add_argument("--profile", choices=sorted(PROFILES), default="gpu")
    ap.add_argument("--python", default=None, help="use this interpreter as is (no install phase)")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated phases to run after install (default: all); install runs first whatever --only says, "
        "unless --python is given (or --profile smoke without --install)",
    )
    ap.add_argument("--wheels", type=Path, default=default_wheelhouse(), help="install from this wheelhouse, offline")
    ap.add_argument("--venv", type=Path, default=VENV, help="the venv the install phase makes (default .venv-gpu)")
    ap.add_argument("--install", action="store_true", help="run the install phase with --profile smoke too")
    ap.add_argument(
        "--work",
        type=Path,
        default=REPO / ".gpu_check_work",
        help="the loose logs; an earlier check's are removed first, and a folder holding anything else is refused",
    )
    args = ap.parse_args()
    only = {p for p in args.only.split(",") if p}
    unknown = only - set(PHASES)
    if unknown:
        ap.error(f"--only: unknown phase(s) {', '.join(sorted(unknown))}; phases: {', '.join(PHASES)}")
    work = args.work.resolve()
    refusal = work_refusal(work, args.out.resolve())
    if refusal:
        ap.error(refusal)
    check = Check(args.out.resolve(), args.budget, args.profile, work)
    check.data["nvidia_smi"] = _nvidia_smi()
    py = args.python or (sys.executable if args.profile == "smoke" and not args.install else None)
    if py is None:
        result, py = install(check, args.venv, args.wheels, need_cuda=PROFILES[args.profile]["device"] == "cuda")
        check.record("install", result)
    if py is None:
        for name in PHASES[1:]:
            check.record(name, {"status": "not run", "error": "install failed"})
    else:
        concurrent, timed = jobs_for(check, py, PROFILES[args.profile], only)
        for group in (concurrent, *({n: j} for n, j in timed.items())):  # the benches one at a time
            for name, result in run_phases(check, group).items():
                result["figures"] = figures_of(check, name)
                check.record(name, result)
    check.data["headline"] = headline(check.data["phases"])
    check.save()
    summary = format_summary(check.data)
    (check.out / "summary.txt").write_text(summary + "\n")
    print(summary)
    check.bundle()
    print(f"figures: {check.out / 'gpu_check.json'}; logs: {check.out / check.BUNDLE} (and {check.work})")
    return 0 if all(r.get("status") == "ok" for r in check.data["phases"].values()) else 1


def _nvidia_smi() -> str | None:
    query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
    try:
        return subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# -- the headline: the figures the check exists for -------------------------------------------
def headline(phases: dict) -> dict:
    """Fused vs canonical at both sizes, the sync checks, the step ratio, fp16 vs bf16 in the app."""
    out: dict = {"failed": {n: r.get("error", "")[-300:] for n, r in phases.items() if r.get("status") != "ok"}}
    for size in ("50M", "1B"):
        variants = (phases.get(f"pipeline_{size}", {}).get("figures") or {}).get("variants", {})
        out[f"pipeline_{size}"] = {
            v: {
                "canonical_over_fused": f["ratios"]["b/d"],
                "canonical_foreach_over_fused": f["ratios"]["a/d"],
                "fused_over_floor": f["ratios"]["d/c"],
                "fused_gbs": (f.get("achieved_gbs") or {}).get("d"),
                "copy_gbs": f.get("copy_gbs"),
                "peak_gbs": f.get("peak_gbs"),
            }
            for v, f in variants.items()
        }
    tests = phases.get("tests", {}).get("figures") or {}
    out["no_sync_between_flushes"] = {k: v for k, v in tests.get("outcomes", {}).items() if "never_syncs" in k}
    out["sync_counts"] = {k: v for k, v in tests.get("properties", {}).items() if "syncs" in k}
    out["tests"] = tests.get("counts")
    for dtype in ("fp16", "bf16"):
        step = phases.get(f"step_{dtype}", {}).get("figures") or {}
        out[f"step_{dtype}_engine_over_canonical"] = step.get("ratio_paired")
        runs = (phases.get(f"calibrate_{dtype}", {}).get("figures") or {}).get("runs") or [{}]
        keep = ("recommended_max_norm", "clip_ratio", "validation_clip_ratio", "skip_ratio", "final_loss", "scale")
        out[f"calibrate_{dtype}"] = {k: runs[-1].get(k) for k in keep}
    sweep = phases.get("sweep", {}).get("figures") or {}
    out["sweep_trials"] = [
        {k: r.get(k) for k in ("name", "dtype", "max_norm", "eval_loss", "clip_ratio", "skip_ratio")}
        for r in sweep.get("runs", [])
        if r.get("child") and r["name"].startswith("trial")
    ]
    out["sweep_pick"] = next((ln for ln in sweep.get("console", []) if ln.startswith("Pick:")), None)
    return out


# -- the summary table --------------------------------------------------------------------------
def _pct(x) -> str:
    return f"{float(x):.1%}" if x is not None else "-"


def _num(x, fmt: str = ".3g") -> str:
    return format(float(x), fmt) if x is not None else "-"


def _phase_line(name: str, r: dict) -> str:
    f = r.get("figures") or {}
    note = ""
    if name == "install" and r.get("torch"):
        note = f"torch {r['torch'][0]} (CUDA {r['torch'][1]}), {r.get('how', '')}"
    elif name == "tests" and f.get("counts"):
        c, props = f["counts"], f.get("properties", {})
        note = f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
        syncs = {k.removeprefix("default_path_syncs_per_step_"): v for k, v in props.items() if "syncs_per_step" in k}
        no_sync = {k.split("[")[-1].rstrip("]"): v for k, v in f.get("outcomes", {}).items() if "never_syncs" in k}
        note += "; fused path, no sync between flushes: " + ", ".join(f"{k} {v}" for k, v in no_sync.items())
        note += "; default-path syncs/step " + ", ".join(f"{k} {v}" for k, v in syncs.items()) if syncs else ""
    elif name.startswith("pipeline_") and f.get("variants"):
        parts = []
        for v, fig in f["variants"].items():
            gbs = (fig.get("achieved_gbs") or {}).get("d")
            ceilings = [(n, fig.get(f"{n}_gbs")) for n in ("copy", "peak") if fig.get(f"{n}_gbs")]
            of = ", ".join(f"{gbs / c:.0%} of {n}" for n, c in ceilings) if gbs else ""
            bw = f", (d) {gbs:.0f} GB/s" + (f" = {of}" if of else "") if gbs else ""
            ratios = fig["ratios"]
            parts.append(
                f"{v}: canonical/fused {ratios['b/d']:.2f}x (with foreach AdamW {ratios['a/d']:.2f}x), "
                f"fused/floor {ratios['d/c']:.2f}{bw}"
            )
        note = "; ".join(parts)
    elif name.startswith("step_") and f.get("ratio_paired") is not None:
        note = (
            f"{f['params'] / 1e6:.1f}M params: engine/canonical {f['ratio_paired']:.3f} "
            f"({f['engine_ms']:.1f} vs {f['canonical_ms']:.1f} ms/step)"
        )
    elif f.get("runs"):
        trials = [run for run in f["runs"] if run["child"] and run["name"].startswith("trial")]
        note = "; ".join(_run_note(run, trial=True) for run in trials) if name == "sweep" else _run_note(f["runs"][-1])
        note += "".join(f"; {line}" for line in f.get("console", []) if line.startswith("Pick:"))
    status = r.get("status", "?")
    if status != "ok" and r.get("error"):
        note = (note + "; " if note else "") + r["error"].strip().splitlines()[-1][:160]
    return f"{name:15s} {status:8s} {_num(r.get('seconds'), '.0f'):>5s}s  {note}"


def _run_note(run: dict, trial: bool = False) -> str:
    """A calibrate run: its recommended τ; a sweep trial: the τ it trained with."""
    tau = run.get("max_norm") if trial else run.get("recommended_max_norm")
    note = f"{run['dtype']} τ={_num(tau)} clip {_pct(run.get('clip_ratio'))} skip {_pct(run.get('skip_ratio'))}"
    note += f" loss {_num(run.get('final_loss'))}" + (f" eval {_num(run.get('eval_loss'))}" if trial else "")
    scale = run.get("scale")
    if scale:
        note += f" scale {scale['first']:.0f}→{scale['last']:.0f} ({scale['backoffs']} back-offs)"
    return note


def format_summary(data: dict) -> str:
    head = f"gpu_check ({data['profile']}): {data.get('nvidia_smi') or 'no nvidia-smi'}; {data.get('elapsed_s', 0)} s"
    lines = [head, f"{'phase':15s} {'status':8s} {'time':>6s}  figures"]
    lines += [_phase_line(name, r) for name, r in data["phases"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
