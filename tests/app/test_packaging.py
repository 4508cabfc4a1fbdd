"""clipamp as a real package: a non-editable wheel carries the Hydra config tree and the ``clipamp``
console script, which runs an experiment from an empty folder with the checkout nowhere on
``sys.path``; ``--help`` and shell completion speak of clipamp, never of ``__main__``.

The wheel is built offline (``pip wheel --no-deps --no-build-isolation``) from a copy of the
checkout and installed into a fresh venv that sees the project's dependencies through a ``.pth``
line pointing at this interpreter's site-packages (a path line only: that folder's own ``.pth``
files, the editable install's finder among them, are not run).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.app.helpers import CONF, EXPERIMENTS, REPO, TINY, run_cli

COPY_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "mlruns",
    "__pycache__",
    ".pytest_cache",
    "tests",
    "outputs",
    "multirun",
)


def build_wheel(src: Path, out: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "--disable-pip-version-check",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("clipamp-*.whl")
    return wheel


def copy_checkout(dest: Path) -> Path:
    shutil.copytree(REPO, dest, ignore=COPY_IGNORE)
    return dest


def fresh_venv(where: Path, wheel: Path) -> Path:
    """A new venv holding only the wheel (non-editable); the dependencies come from this interpreter's."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # --ignore-installed: a clipamp seen elsewhere (a checkout's egg-info on PYTHONPATH) is neither
    # "already satisfied" nor uninstalled; the .pth comes after the install for the same reason
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            "-q",
            "--disable-pip-version-check",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        env=clean_env(),
    )
    Path(purelib, "clipamp_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return where


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    return build_wheel(copy_checkout(tmp / "src"), tmp / "dist")


@pytest.mark.slow  # a subprocess or a wheel build
def test_wheel_carries_the_config_tree_and_the_console_script(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {f"sweep/conf/{p.relative_to(CONF).as_posix()}" for p in CONF.rglob("*.yaml")}
    assert tree and tree <= names, f"missing from the wheel: {sorted(tree - names)}"
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry).decode()
    assert re.search(r"^clipamp = sweep\.console:clipamp$", scripts, re.M), scripts  # light: Ctrl-C at start-up
    assert re.search(r"^clipamp-recommend = sweep\.console:clipamp_recommend$", scripts, re.M), scripts


@pytest.mark.slow  # a subprocess or a wheel build
def test_help_names_clipamp_and_lists_every_experiment(tmp_path):
    out = run_cli("--help", cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("clipamp:") and "__main__" not in out.stdout
    for name in EXPERIMENTS:
        assert re.search(rf"^  {name} ", out.stdout, re.M), f"experiment {name} missing from --help"
    groups = {line.split(":")[0] for line in out.stdout.splitlines() if re.match(r"^[a-z_]+: \w", line)}
    assert {p.name for p in CONF.iterdir() if p.is_dir()} <= groups
    assert not list(tmp_path.iterdir()), "--help wrote files"


@pytest.mark.slow  # a subprocess or a wheel build
def test_completion_query_offers_experiments_and_groups(tmp_path):
    env = {"PYTHONPATH": str(REPO), "COMP_LINE": "clipamp +experiment=", "COMP_POINT": "20"}
    out = run_cli("-sc", "query=bash", cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    assert set(out.stdout.split()) >= {f"+experiment={n}" for n in EXPERIMENTS}


@pytest.mark.slow
def test_installed_wheel_runs_calibrate_from_an_empty_folder(wheel, tmp_path):
    venv = fresh_venv(tmp_path / "venv", wheel)
    work = tmp_path / "empty"
    work.mkdir()
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sweep; print(sweep.__file__)"],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert Path(where).is_relative_to(venv), f"sweep imported from {where}, not the installed wheel"

    run = subprocess.run(
        [str(venv / "bin" / "clipamp"), "+experiment=calibrate", *TINY, "steps=20", "calibrate.window=10"],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    db = work / "mlruns" / "mlflow.db"
    assert db.is_file()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (r,) = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
    assert r.info.status == "FINISHED" and r.data.params["steps"] == "20"
    assert r.data.metrics["recommended_max_norm"] > 0

    helped = subprocess.run(
        [str(venv / "bin" / "clipamp"), "--help"],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert helped.returncode == 0 and helped.stdout.startswith("clipamp:") and "__main__" not in helped.stdout
    script = subprocess.run(
        [str(venv / "bin" / "clipamp"), "-sc", "install=bash"],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert script.returncode == 0, script.stderr
    assert re.search(r"complete .*-F hydra_bash_completion clipamp$", script.stdout.strip()), script.stdout


@pytest.mark.slow
def test_a_wheel_without_the_config_tree_fails_from_an_empty_folder(tmp_path):
    """The control of the test above: the same install, minus the package data, cannot start."""
    src = copy_checkout(tmp_path / "src")
    pyproject = src / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(re.sub(r"\[tool\.hatch\.build\.targets\.wheel\.force-include\]\n[^\n]*\n", "", text))
    assert "force-include" not in pyproject.read_text()
    venv = fresh_venv(tmp_path / "venv", build_wheel(src, tmp_path / "dist"))
    work = tmp_path / "empty"
    work.mkdir()
    run = subprocess.run(
        [str(venv / "bin" / "clipamp"), "+experiment=calibrate", "steps=20", "calibrate.window=10"],
        cwd=work,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and not list(work.iterdir())
    assert run.stderr.strip().startswith("error: Primary config directory not found"), run.stderr
