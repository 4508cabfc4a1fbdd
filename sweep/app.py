"""Dispatch a composed config to its experiment: validate, join torchrun's ranks, open the store, run."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from sweep.config import Config, validate
from sweep.distributed import launch as ranks
from sweep.experiments.training import run_single
from sweep.tracking.store import anchored
from sweep.tracking.tracker import Store, resolve_uri


def experiment(name: str):
    """The entry point of ``+experiment=name``; the sweep (Optuna) and the spike are imported only when run."""
    if name == "sweep":
        from sweep.experiments.study.sweep import run_sweep

        return run_sweep
    if name == "spike":
        from sweep.experiments.spike.experiment import run_spike

        return run_spike
    return run_single


def run(cfg: Config, overrides: list[str] | None = None, base_dir: Path | None = None) -> object:
    """Run ``cfg.run`` (calibrate, train, sweep, spike); user mistakes raise ``UserError``.

    ``base_dir``: where the user ran the command (default: the cwd); a relative sqlite store is
    anchored there, whatever folder Hydra runs the job in.
    """
    validate(cfg)
    trials_own = cfg.run == "sweep" and cfg.study.nproc_per_trial > 1  # dist.strategy is for the trials' jobs
    launch = ranks.start(
        "auto" if trials_own else cfg.dist.strategy, cfg.run, cfg.data.batch_size, cfg.device, cfg.dist.timeout_s
    )

    def go() -> object:
        store = open_store(cfg, overrides, launch, base_dir or Path.cwd())
        if launch.distributed:  # calibrate, train or spike (resolve_strategy refuses the sweep)
            return experiment(cfg.run)(cfg, store, Console(soft_wrap=True, quiet=not launch.is_main), launch)
        return experiment(cfg.run)(cfg, store, Console(soft_wrap=True))

    return launch.run(go)


def open_store(cfg: Config, overrides: list[str] | None, launch: ranks.Launch, base_dir: Path) -> Store:
    """Rank 0 opens (creates, migrates) the store; the other ranks wait, learn the experiment, never touch it."""
    opened: list[Store] = []

    def on_main() -> tuple[str, str, dict[str, str]]:
        uri = anchored(resolve_uri(cfg.tracking.uri), base_dir)
        opened.append(Store.open(uri, cfg.tracking.experiment, overrides))
        return opened[0].experiment_id, opened[0].uri, opened[0].tags

    experiment_id, uri, tags = launch.agree(on_main)
    return opened[0] if opened else Store(None, experiment_id, uri, tags)
