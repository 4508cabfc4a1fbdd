"""``run_spike``: the experiment's entry point: the parent run, each policy's pair, metrics, report."""

from __future__ import annotations

import shutil
from pathlib import Path

from rich.console import Console

from sweep.config.convert import flat_params, with_overrides
from sweep.config.schema import Config
from sweep.config.validate_spike import check_spike
from sweep.distributed.launch import Launch
from sweep.errors import UserError
from sweep.experiments.spike.arms import play_pair
from sweep.report.format import print_wide
from sweep.report.run import write_run_report
from sweep.report.spike import (
    model_size,
    rich_table,
    spike_figure,
    summary_line,
    table_rows,
    table_title,
    where_to_look,
    write_spike_table,
)
from sweep.results.spike import Arm, SpikeResult, arm_metrics, fp16_outcome
from sweep.tracking.tracker import RunTracker, SilentTracker, Store, log_metrics, redact

#: The clipping policies compared (each as an unspiked twin + a spiked run); fp16 runs the last only.
POLICIES = ("none", "fixed", "calibrated")
FP16_POLICIES = ("calibrated",)
Pairs = dict[str, tuple[Arm, Arm]]

#: The exit status of a spike whose fp16 run did not survive (a user mistake is 2, nothing trained 3).
EXIT_FP16_FAILED = 4


class Fp16NotSurvived(UserError):
    """The fp16 run did not survive the spike: every run, the figure and the table are written first,
    the parent run ends FAILED with the ``fp16_spike`` tag, and the command exits ``EXIT_FP16_FAILED``
    with this one line (an outcome of the experiment, not a bug: no traceback)."""

    status = EXIT_FP16_FAILED


def fp16_config(cfg: Config) -> Config | None:
    """The fp16 variant's config (``spike.fp16_overrides`` on top, dtype fp16), checked; None if off."""
    if not cfg.spike.fp16:
        return None
    cfg16 = with_overrides(cfg, cfg.spike.fp16_overrides, "spike.fp16_overrides")
    cfg16.amp.dtype = "fp16"
    check_spike(cfg16)
    return cfg16


def open_parent(cfg: Config, store: Store, launch: Launch) -> RunTracker | SilentTracker:
    """The parent run: created by rank 0; the other ranks get its id, silently."""
    made: list[RunTracker] = []

    def on_main() -> tuple[str, str]:
        parent = RunTracker(
            store.client,
            store.experiment_id,
            f"spike-{cfg.model.name}-{cfg.amp.dtype}",
            tags={
                **store.tags,
                "run": "spike",
                "dtype": cfg.amp.dtype,
                "model": cfg.model.name,
                "data": cfg.data.name,
                "device": cfg.device,
                "ranks": str(launch.world),
            },
        )
        made.append(parent)
        return parent.run_id, parent.run_name

    run_id, name = launch.agree(on_main)
    return made[0] if made else SilentTracker(run_id, name)


def run_spike(
    cfg: Config, store: Store, console: Console | None = None, launch: Launch | None = None
) -> SpikeResult | None:
    """Run each policy's pair as children of one parent run; log metrics, figure and table; print them.

    Under torchrun (``launch``) every rank trains every arm on its share of each (spiked) global
    batch; rank 0 alone records, measures and reports (the other ranks return None).
    """
    console = console or Console()
    launch = launch or Launch()
    s = cfg.spike
    cfg16 = fp16_config(cfg)
    parent = open_parent(cfg, store, launch)
    with parent:  # FINISHED, KILLED by Ctrl-C / SIGTERM (as the arm that was training), else FAILED
        parent.log_params(flat_params(cfg))
        console.print(
            f"spike: parent run {parent.run_id}; a corrupted batch at step {s.at_step} with "
            f"‖g‖ = {s.factor:g} × the peak of the {min(s.peak_window or s.at_step - 1, s.at_step - 1)} steps before it"
        )
        common = dict(parent_run_id=parent.run_id, console=console, artifacts=write_run_report, launch=launch)
        pairs = {p: play_pair(cfg, p, store, **common) for p in POLICIES}
        fp16 = (
            {p: play_pair(cfg16, p, store, prefix="fp16-", **common) for p in FP16_POLICIES}
            if cfg16 is not None
            else {}
        )
        if not launch.is_main:
            return None
        for family, family_cfg in ((pairs, cfg), (fp16, cfg16)):
            measure_family(store, family, family_cfg)
        ok, outcome = fp16_outcome(fp16["calibrated"][1], cfg16, twin=fp16["calibrated"][0]) if fp16 else (None, "")
        result = report(cfg, store, parent, pairs, fp16, ok, outcome, console)
        if ok is False:
            raise Fp16NotSurvived(
                f"the fp16 run did not survive the spike: {outcome}; the parent run {parent.run_id} ended FAILED "
                "with its figure, table and every child run kept"
            )
        return result


def measure_family(store: Store, family: Pairs, cfg: Config) -> None:
    """Each arm's metrics against its twin (and the family's calibrated reference), logged on its run."""
    main_ref = family["calibrated"][0] if "calibrated" in family else None
    for twin, arm in family.values():
        for a in (twin, arm):
            a.metrics = arm_metrics(a, twin, main_ref or twin, cfg)
            log_metrics(store.client, a.result.run_id, a.metrics, step=cfg.spike.at_step)


def report(
    cfg: Config,
    store: Store,
    parent: RunTracker,
    pairs: Pairs,
    fp16: Pairs,
    ok: bool | None,
    outcome: str,
    console: Console,
) -> SpikeResult:
    """The parent's figure, table and per-arm metrics; the terminal table and summary."""
    s = cfg.spike
    spiked = [arm for _, arm in list(pairs.values()) + list(fp16.values())]
    rows, title = table_rows(spiked, cfg), table_title(cfg)
    figure = spike_figure(pairs, fp16, cfg, parent.artifact_path("spike.png"))
    write_spike_table(parent, rows, title, outcome)
    parent.log_metrics(
        {
            f"{a.name}.{k}": v
            for a in spiked
            for k, v in a.metrics.items()
            if k.startswith(("loss_excess", "recovery", "spike_"))
        },
        step=s.at_step,
    )
    if fp16:  # a void outcome (None) says so itself: "void, not counted as survived: …"
        parent.set_tags({"fp16_spike": {True: "survived: ", False: "FAILED: ", None: ""}[ok] + outcome})
    print_wide(console, rich_table(rows, title))
    console.print(summary_line(pairs, cfg))
    if fp16:
        color = {True: "[green]", False: "[bold red]", None: "[yellow]"}[ok]
        console.print(f"fp16 ({model_size(fp16['calibrated'][1])}): {color}{outcome}")
    if s.figure_out:
        dest = Path(s.figure_out)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(figure, dest)
        console.print(f"figure copied to {dest}")
    table = parent.artifact_path("spike_table.md")
    console.print(where_to_look(figure, table, redact(store.uri), store.experiment_id, parent.run_id))
    return SpikeResult(parent.run_id, pairs, fp16, rows, figure, ok, outcome)
