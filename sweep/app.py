"""Dispatch a composed config to its experiment: validate, join torchrun's ranks, open the store, run."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from sweep.config import Config, forensics_on, validate
from sweep.config.convert import flat_params
from sweep.distributed import launch as ranks
from sweep.experiments.training import run_single
from sweep.startup import resume_gc
from sweep.tracking.tracker import open_store


def experiment(name: str):
    """The entry point of ``+experiment=name``; the sweep (Optuna) and the spike are imported only when run."""
    if name == "sweep":
        from sweep.experiments.study.sweep import run_sweep

        resume_gc()  # its trials may all run in other processes: no first step here to wait for
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
        "auto" if trials_own else cfg.dist.strategy,
        cfg.run,
        cfg.data.batch_size,
        cfg.device,
        cfg.dist.timeout_s,
        cfg.clip.mode,
        forensics_on(cfg.forensics),
    )

    def go() -> object:
        if launch.distributed:
            launch.refuse_different(flat_params(cfg))  # before the store opens: nothing to clean up
        store = open_store(cfg, overrides, launch, base_dir or Path.cwd())
        if launch.distributed:  # calibrate, train or spike (resolve_strategy refuses the sweep)
            return experiment(cfg.run)(cfg, store, Console(soft_wrap=True, quiet=not launch.is_main), launch)
        return experiment(cfg.run)(cfg, store, Console(soft_wrap=True))

    return launch.run(go)
