"""What the spike experiment measures: each arm, its loss excess over its twin, recovery, the fp16 outcome."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sweep.config.schema import Config
from sweep.config.validate_spike import check_spike
from sweep.errors import UserError
from sweep.run.pipeline import RunResult
from sweep.tasks.build import Batch, Task

GAP_STEPS = 10  # steps before the spike averaged into pre_spike_gap


@dataclass
class Crafted:
    """The corrupted batch of one policy pair, made inside its unspiked twin at the spike step."""

    batch: Batch
    k: float  # loss multiplier
    natural_norm: float  # the blob's gradient norm at k = 1
    peak: float  # running peak in the twin
    target: float  # factor × peak


def loss_excess(rows: Sequence[dict], ref_rows: Sequence[dict], step: int) -> float:
    """``loss / reference loss − 1`` at ``step`` (1-based), on the identical batch."""
    a, b = rows[step - 1]["loss"], ref_rows[step - 1]["loss"]
    return a / b - 1.0 if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def recovery_steps(excess: Sequence[float], tolerance: float) -> int | None:
    """First H ≥ 1 from which ``|excess[H-1:]|`` stays ≤ ``tolerance`` to the end; None if the last is outside.

    Two-sided: a loss more than ``tolerance`` *below* its twin's is a run the spike sent elsewhere,
    not one back on its twin's trajectory."""
    h = len(excess) + 1
    while h > 1 and math.isfinite(excess[h - 2]) and abs(excess[h - 2]) <= tolerance:
        h -= 1
    return h if h <= len(excess) else None


@dataclass
class Arm:
    """One child run of the experiment and what it measured."""

    name: str  # e.g. none, none-reference; reference / calibrated; fp16-reference / fp16-calibrated
    policy: str  # calibrated, none, fixed
    family: str  # the autocast dtype of the family
    spiked: bool
    result: RunResult
    task: Task
    peak: float  # its own running peak before the spike
    crafted: Crafted  # the corrupted batch of its pair (made in the unspiked twin)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def rows(self) -> list[dict]:
        return self.result.records.rows


def arm_metrics(arm: Arm, twin: Arm, main_ref: Arm, cfg: Config) -> dict[str, float]:
    """The per-child metrics: loss_excess_H and recovery vs its unspiked twin, and the spike step's figures."""
    s = cfg.spike
    at = s.at_step
    excess = [loss_excess(arm.rows, twin.rows, t) for t in range(at + 1, cfg.steps + 1)]
    m = {f"loss_excess_{h}": excess[h - 1] for h in s.horizons}
    rec = recovery_steps(excess, s.recovery_tolerance)
    m["recovery_steps"] = float(rec if rec is not None else len(excess) + 1)
    m["recovered"] = float(rec is not None)
    m["spike_twin_skipped"] = float(bool(twin.rows[at - 1]["skipped"]))
    if arm.spiked and m["spike_twin_skipped"]:  # void: both skipped the step, the same run again after it
        m["recovery_steps"] = m["recovered"] = math.nan
    gap = [loss_excess(arm.rows, main_ref.rows, t) for t in range(max(1, at - GAP_STEPS), at)]
    gap = [g for g in gap if math.isfinite(g)]
    m["pre_spike_gap"] = sum(gap) / len(gap) if gap else math.nan
    row = arm.rows[at - 1]
    m.update(
        spike_pre_clip_norm=row["grad_l2_pre_clip"],
        spike_post_clip_norm=row["grad_l2_post_clip"],
        spike_skipped=float(bool(row["skipped"])),
        spike_running_peak=arm.peak,
        spike_ratio=row["grad_l2_pre_clip"] / arm.peak if arm.peak > 0 else math.nan,
        spike_loss_multiplier=arm.crafted.k if arm.spiked else 1.0,
        spike_natural_norm=arm.crafted.natural_norm,
        tau_at_spike=row["max_norm"] if row["max_norm"] is not None else math.nan,
        params_finite=float(all(bool(torch.isfinite(p).all()) for p in arm.task.model.parameters())),
    )
    return m


def void_comparison(arm: Arm) -> bool:
    """A spiked arm whose unspiked twin skipped the spike step too: both runs skipped it (the same update,
    none, and the same scale back-off), so they are the same run again after it and say nothing of the spike."""
    return arm.spiked and arm.metrics.get("spike_twin_skipped") == 1.0


def step_the_twin_took(twin: Arm, cfg: Config) -> int | None:
    """The ``spike.at_step`` nearest the current one that ``check_spike`` accepts and the twin did not skip.
    The twin never sees the spike, so its steps do not depend on ``spike.at_step``: it takes that step again."""
    at = cfg.spike.at_step
    for n in sorted(range(2, len(twin.rows) + 1), key=lambda n: (abs(n - at), n)):
        if twin.rows[n - 1]["skipped"]:
            continue
        moved = copy.deepcopy(cfg)
        moved.spike.at_step, moved.spike.figure_out = n, None  # the timing checks only
        try:
            check_spike(moved)
        except UserError:
            continue
        return n
    return None


def fp16_outcome(arm: Arm, cfg: Config, twin: Arm | None = None) -> tuple[bool | None, str]:
    """Did the fp16 run survive the spike: skipped + scale backed off (or clipped), then continued finite?
    ``twin``: the unspiked run; where it overflowed at the same step too, the comparison is void (None):
    the overflow was not the spike's, so the replay cannot say whether the run survives one."""
    at = cfg.spike.at_step
    row, rows = arm.rows[at - 1], arm.rows
    after = rows[at:]
    taken_after = [r for r in after if not r["skipped"]]
    continued = bool(taken_after) and all(math.isfinite(r["loss"]) for r in taken_after)
    finite = arm.metrics.get("params_finite") == 1.0
    if twin is not None and twin.rows[at - 1]["skipped"]:
        n = step_the_twin_took(twin, cfg)
        return None, (
            f"void, not counted as survived: its unspiked twin overflowed at step {at} by itself (no spike), so "
            "both skipped it and are the same run again after it; "
            + (f"move the spike to a step the twin took, e.g. spike.at_step={n}" if n else "move spike.at_step")
        )
    if row["skipped"]:
        s0, s1 = row["scaler_scale"], after[0]["scaler_scale"] if after else math.nan
        absorbing = cfg.amp.hysteresis > 1  # DeepSpeed hysteresis may absorb one overflow
        backed = s1 < s0 or absorbing
        what = (
            f"overflow at the spike ({row['skip_reason']}): step skipped, loss scale "
            f"2^{math.log2(s0):g} → 2^{math.log2(s1):g}"
        )
        ok = backed and continued and finite
    else:
        tau = row["max_norm"]
        clipped = tau is not None and row["grad_l2_post_clip"] <= tau * (1 + 1e-3)
        what = (
            f"no overflow at the spike: ‖g‖ {row['grad_l2_pre_clip']:.3g} clipped to "
            f"{row['grad_l2_post_clip']:.3g} (τ = {tau if tau is not None else float('nan'):.3g})"
        )
        ok = clipped and continued and finite
    what += f"; {len(taken_after)}/{len(after)} later steps taken, parameters {'finite' if finite else 'NOT finite'}"
    return ok, what


@dataclass
class SpikeResult:
    """What ``run_spike`` measured: the parent run, each policy's (twin, spiked) pair, the table."""

    parent_run_id: str
    pairs: dict[str, tuple[Arm, Arm]]
    fp16: dict[str, tuple[Arm, Arm]]
    table: list[dict[str, Any]]
    figure: Path
    fp16_ok: bool | None = None  # None: no fp16 pair, or its comparison is void (``void_comparison``)
    fp16_outcome: str = ""

    @property
    def arms(self) -> dict[str, Arm]:
        """Every child by name (reference, calibrated, none-reference, none, …, fp16-…)."""
        return {a.name: a for pair in list(self.pairs.values()) + list(self.fp16.values()) for a in pair}
