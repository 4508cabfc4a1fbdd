"""Shared test helpers: compose the real conf/ tree, tiny task sizes, run the CLI in a subprocess (or in this
process, without an interpreter's start-up)."""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))

#: Small enough that any experiment runs in seconds on 2 CPU cores.
TINY = [
    "model.d_model=32",
    "model.n_layer=1",
    "model.n_head=2",
    "model.block_size=32",
    "data.batch_size=4",
    "data.seq_len=32",
    "data.max_files=40",
    "data.eval_batches=1",
    "progress=false",
    "tracking.plots=false",
]


@functools.cache
def _register() -> None:
    """Register the schema in Hydra's ConfigStore once per process, as ``sweep.__main__`` does: storing it
    builds a structured config of the whole schema, a fifth of a compose's time."""
    from sweep.config import register

    register()


def compose_cfg(*overrides: str):
    """The typed Config object that ``python -m sweep`` would run with these overrides (a copy of its own: the
    caller may change it)."""
    environ = frozenset((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST")  # pytest's, per test
    return copy.deepcopy(_composed(overrides, os.getcwd(), environ))


@functools.cache
def _composed(overrides: tuple[str, ...], cwd: str, environ: frozenset):
    """One compose per distinct command in this process: each compose builds Hydra's own config tree, most of its
    cost, and tests compose the same command many times. The key holds what a compose reads besides conf/ (the
    working folder, the environment); a compose that raises is not kept, so it raises each time."""
    from sweep.config.convert import to_config

    _register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return to_config(cfg)


def repo_pythonpath(env: dict | None = None) -> str:
    """``PYTHONPATH`` for a child process that imports this tree's ``sweep`` and ``tests``: the checkout
    first, then ``env``'s own (default: this process's environment)."""
    env = os.environ if env is None else env
    return os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))


def csv_of(stdout: str) -> Path:
    """The path of the run's steps.csv, from the ``steps.csv: PATH`` line the app prints."""
    return Path(next(l for l in stdout.splitlines() if l.startswith("steps.csv: ")).split(": ", 1)[1].strip())


def run_cli(*args: str, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "sweep", *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def run_cli_here(*args: str, cwd: Path, capsys, monkeypatch) -> subprocess.CompletedProcess:
    """What ``python -m sweep ARGS`` in ``cwd`` exits with and prints, as ``run_cli`` returns it, from the same
    entry point (``sweep.__main__.cli``: the precheck, Hydra's ``main``, its exit lines) run in this process: no
    interpreter start-up, which is most of a refused command's seconds. What the app sets for its process (the
    environment, the SIGINT handler, the form of warnings, Hydra's global state, and the logging Hydra's
    ``disabled`` config turns off: every existing logger, the root's level) is restored after it."""
    import logging
    import signal
    import warnings

    from hydra.core.global_hydra import GlobalHydra

    import sweep.__main__ as entry
    import sweep.app  # noqa: F401  imported first: its import-time settings are this process's, not the run's

    environ, sigint, form = dict(os.environ), signal.getsignal(signal.SIGINT), warnings.formatwarning
    known = logging.root.manager.loggerDict.values()
    loggers = [logging.getLogger(), *(x for x in known if isinstance(x, logging.Logger))]
    logged = [(x, x.disabled, x.level, list(x.handlers), x.propagate) for x in loggers]
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["sweep", *args])
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    capsys.readouterr()
    try:
        entry.cli()
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        os.environ.clear()
        os.environ.update(environ)
        signal.signal(signal.SIGINT, sigint)
        warnings.formatwarning = form
        GlobalHydra.instance().clear()
        for x, disabled, level, handlers, propagate in logged:
            x.disabled, x.handlers, x.propagate = disabled, handlers, propagate
            x.setLevel(level)  # and clears the loggers' level caches
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["sweep", *args], status, out, err)


def store_in(folder: Path, template: Path) -> str:
    """A fresh sqlite store at ``folder/mlruns/mlflow.db`` (the default location for cwd=folder), copied
    from the migrated ``template`` (creating one costs seconds); its URI."""
    db = folder / "mlruns" / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, db)
    return f"sqlite:///{db}"


def kill_after(step: int):
    """A step hook that interrupts the run (as Ctrl-C would) right after ``step``."""

    def hook(log):
        if log.step == step:
            raise KeyboardInterrupt(f"killed after step {step}")

    return hook
