"""``+experiment=calibrate`` and ``+experiment=train``: one tracked run, then its terminal summary.

``calibrate`` runs ``clip=calibrated`` with the windows ``calibrate.*`` describes: it records
pre-clip norms in calibration windows and then trains at the recommended τ = Quantile_q; ``train``
uses the configured clip policy throughout (``clip=MODE``). Under torchrun both run on every rank
(``launch``); rank 0 reports.
"""

from __future__ import annotations

from rich.console import Console

from sweep.config.schema import Config, calibrated
from sweep.distributed.launch import Launch
from sweep.report.run import print_run_summary, write_run_report
from sweep.run.pipeline import RunHooks, RunResult, RunSpec, run_training
from sweep.tracking.tracker import Store, redact


def run_single(cfg: Config, store: Store, console: Console | None = None, launch: Launch | None = None) -> RunResult:
    """Train ``cfg`` as one run named ``<run>-<model>-<dtype>`` and print what it measured."""
    console = console or Console()
    spec = RunSpec(f"{cfg.run}-{cfg.model.name}-{cfg.amp.dtype}")
    cfg = calibrated(cfg) if cfg.run == "calibrate" else cfg
    hooks = RunHooks(artifacts=write_run_report, announce=console.print)
    launch = launch or Launch()
    result = run_training(cfg, store, spec, hooks, launch)
    if launch.is_main:  # the other ranks' results hold their eval loss only
        print_run_summary(result, uri=redact(store.uri), experiment_id=store.experiment_id, console=console)
    return result
