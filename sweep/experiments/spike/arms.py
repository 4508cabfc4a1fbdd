"""The spike experiment's runs: for each clipping policy, an unspiked twin and the spiked run."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rich.console import Console

from sweep.config.schema import Config, calibrated
from sweep.distributed.launch import Launch
from sweep.errors import UserError
from sweep.experiments.spike.batch import SpikeLoss, binary_blob, grad_norm, running_peak
from sweep.results.spike import Arm, Crafted
from sweep.run.pipeline import RunHooks, RunSpec, run_training
from sweep.tasks.build import Batch, build_task
from sweep.tracking.tracker import Store


def arm_config(cfg: Config, policy: str) -> Config:
    """The config of one policy's runs: its clip mode (calibrated: ``calibrate.*``'s windows), no resume and no
    periodic checkpoint (the replay is not resumable, and the store takes a run's steps only up to its latest
    checkpoint while it trains, ``RunTracker.hold_after``)."""
    arm_cfg = calibrated(cfg) if policy == "calibrated" else copy.deepcopy(cfg)
    if policy == "none":
        arm_cfg.clip = type(cfg.clip)(mode="none")
    elif policy == "fixed":
        arm_cfg.clip = type(cfg.clip)(mode="norm", max_norm=cfg.spike.fixed_max_norm)
    arm_cfg.resume, arm_cfg.checkpoint_every = None, 0
    return arm_cfg


def arm_name(policy: str, spiked: bool, prefix: str = "") -> str:
    """calibrated → reference / calibrated; none → none-reference / none; prefix fp16- for fp16."""
    if spiked:
        return f"{prefix}{policy}"
    return f"{prefix}reference" if policy == "calibrated" else f"{prefix}{policy}-reference"


@dataclass
class _Spiker:
    """The batch hooks of one pair: the twin crafts the corrupted batch at the spike step, the
    spiked run feeds it (with its loss multiplier) in place of the normal batch."""

    cfg: Config
    dtype: str
    crafted: list[Crafted] = field(default_factory=list)

    def craft(self, task, loss: SpikeLoss, norms: dict[int, float]):
        s, at = self.cfg.spike, self.cfg.spike.at_step

        def hook(step: int, batch: Batch) -> Batch:
            if step != at:
                return batch
            peak = running_peak(norms, at, s.peak_window)
            if not (math.isfinite(peak) and peak > 0):
                raise UserError(
                    f"no finite pre-clip norm in the {min(s.peak_window or at - 1, at - 1)} steps before "
                    f"spike.at_step={at}: raise spike.peak_window or spike.at_step"
                )
            blob = binary_blob(batch, seed=self.cfg.seed * 1_000_003 + at)
            natural = grad_norm(task.model, loss.loss_fn, blob, self.dtype)
            target = s.factor * peak
            self.crafted.append(Crafted(blob, target / natural, natural, peak, target))
            return batch

        return hook

    def inject(self, loss: SpikeLoss):
        at = self.cfg.spike.at_step

        def hook(step: int, batch: Batch) -> Batch:
            if step != at:
                return batch
            loss.mark(self.crafted[0].batch.targets, self.crafted[0].k)
            return self.crafted[0].batch

        return hook


def play_pair(
    cfg: Config,
    policy: str,
    store: Store,
    *,
    parent_run_id: str,
    console: Console,
    artifacts: Callable | None = None,
    prefix: str = "",
    launch: Launch | None = None,
) -> tuple[Arm, Arm]:
    """One policy's unspiked twin (which crafts the corrupted batch at the spike step), then its spiked run.

    Both runs have the same seed, data order and policy, so they are the same run until the spike.
    ``artifacts``: the runs' report hook (``RunHooks.artifacts``), from the entry point. Under torchrun
    (``launch``, DDP) every rank crafts the same corrupted *global* batch (same seed, same replicated
    weights, the global norms the engine records) before it takes its share of it.
    """
    at = cfg.spike.at_step
    arm_cfg = arm_config(cfg, policy)
    spiker = _Spiker(cfg, arm_cfg.amp.dtype)
    out: list[Arm] = []
    for spiked in (False, True):
        task = build_task(arm_cfg.model, arm_cfg.data, seed=arm_cfg.seed, device=arm_cfg.device)
        loss = SpikeLoss(task.loss_fn)
        task = replace(task, loss_fn=loss)
        norms: dict[int, float] = {}
        name = arm_name(policy, spiked, prefix)
        spec = RunSpec(
            f"spike-{name}",
            parent_run_id=parent_run_id,
            task=task,
            tags={
                "spike_arm": name,
                "spike_policy": policy,
                "spike_family": arm_cfg.amp.dtype,
                "spiked": str(spiked).lower(),
            },
        )
        hooks = RunHooks(
            batch=spiker.inject(loss) if spiked else spiker.craft(task, loss, norms),
            step=lambda log, norms=norms: norms.__setitem__(log.step, log.grad_l2_pre_clip),
            artifacts=artifacts,
            announce=lambda msg, name=name: console.print(f"[dim]{name}: {msg}[/dim]"),
            flush_after=lambda step: step == at - 1,  # the spike step's batch hook reads the norms before it
        )
        result = run_training(arm_cfg, store, spec, hooks, launch)
        if not spiker.crafted:
            raise RuntimeError(f"spike-{name} never reached step {at}")
        out.append(
            Arm(
                name,
                policy,
                arm_cfg.amp.dtype,
                spiked,
                result,
                task,
                running_peak(norms, at, cfg.spike.peak_window),
                spiker.crafted[0],
            )
        )
    return out[0], out[1]
