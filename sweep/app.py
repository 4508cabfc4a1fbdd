"""Dispatch a composed config to its experiment: validate, open the tracking store, run."""

from __future__ import annotations

from rich.console import Console

from sweep.config import Config, validate
from sweep.experiments.spike.experiment import run_spike
from sweep.experiments.study.sweep import run_sweep
from sweep.experiments.training import run_single
from sweep.run.tracking import Store

EXPERIMENTS = {"calibrate": run_single, "train": run_single, "sweep": run_sweep, "spike": run_spike}


def run(cfg: Config, overrides: list[str] | None = None) -> object:
    """Run ``cfg.run`` (calibrate, train, sweep, spike); user mistakes raise ``UserError``."""
    validate(cfg)
    store = Store.open(cfg.tracking.uri, cfg.tracking.experiment, overrides)
    return EXPERIMENTS[cfg.run](cfg, store, Console(soft_wrap=True))
