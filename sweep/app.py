"""Dispatch a composed, validated config to its experiment."""

from __future__ import annotations

from rich.console import Console

from sweep.config.schema import Config, validate
from sweep.report.tables import print_run_summary
from sweep.run.pipeline import run_training
from sweep.run.tracking import ensure_experiment, open_client, redact, resolve_uri


def run(cfg: Config, overrides: list[str] | None = None) -> object:
    """Run ``cfg.run`` (calibrate, train, sweep, spike); user mistakes raise ``UserError``."""
    validate(cfg)
    console = Console(soft_wrap=True)
    uri = resolve_uri(cfg.tracking.uri)
    client = open_client(uri)
    experiment_id = ensure_experiment(client, cfg.tracking.experiment, uri)
    tags = {"overrides": " ".join(overrides or []), "tracking_uri": redact(uri)}
    if cfg.run in ("calibrate", "train"):
        result = run_training(cfg, client, experiment_id, run_name=f"{cfg.run}-{cfg.model.name}-{cfg.amp.dtype}",
                              calibrate=cfg.run == "calibrate", tags=tags, announce=console.print, uri=uri)
        print_run_summary(result, uri=redact(uri), experiment_id=experiment_id, console=console)
        return result
    if cfg.run == "sweep":
        from sweep.experiments.study.sweep import run_sweep

        return run_sweep(cfg, client, experiment_id, uri=uri, tags=tags, console=console)
    from sweep.experiments.spike.experiment import run_spike

    return run_spike(cfg, client, experiment_id, uri=uri, tags=tags, console=console)
