"""``+experiment=spike``: replay the seed's bad batch under each clipping policy and measure the damage.

The story (seed lesson 000): a run's loss flattens at step 8,217 after one batch whose gradient
norm is 20× its previous peak; with a global clip at 1.0 the same batch becomes a unit-norm
update and training survives. This experiment replays it on the default task, from one seed and
one data order, as child runs of one MLflow parent run. Each clipping policy runs twice, an
unspiked twin (the normal batch at ``spike.at_step``) and the spiked run:

- ``none`` (``clip=none``): children ``none-reference`` and ``none``;
- ``fixed`` (global clip at ``spike.fixed_max_norm``): ``fixed-reference`` and ``fixed``;
- ``calibrated`` (``calibrate=True``: τ = Quantile_q of the calibration window that ends before
  the spike): ``reference`` and ``calibrated``;
- with ``spike.fp16=true``, the calibrated pair again in fp16 on a smaller GPT
  (``spike.fp16_overrides``): ``fp16-reference`` and ``fp16-calibrated``. There the spike
  overflows the loss scale: the step must be skipped, the scale backed off and the run continue
  with finite parameters (or, without overflow, the spike must be clipped); a violation fails
  the parent run.

Why a twin per policy: the policies already differ before the spike (clipping at 1.0 through the
warm-up transient trains a different model than an unclipped calibration window does), so a
single reference would mix that difference into the spike's damage. A twin has the same seed,
data order and policy as its spiked run, so the two are the same run, bit for bit, until the
spike; ``pre_spike_gap`` still reports each policy's distance from the calibrated ``reference``.

The corrupted batch. At the spike step the batch is replaced by a *binary blob*: seeded uniform
random bytes as inputs and targets (what a compressed or binary file that slipped into a text
corpus, or a misaligned read, feeds a byte-level LM). The cross-entropy gradient is bounded per
token, so the blob's own gradient norm is only a few × the recent peak; its loss is therefore
also multiplied by ``k`` (what a normalisation bug does, e.g. a summed loss divided by a wrong
token count — seed 004, "Why token normalization matters"). ``k`` is solved so that the pre-clip
norm is ``spike.factor`` × the running peak: inside the twin, at the spike step, the live model
(the weights after step ``at_step − 1``, bit-identical in the spiked run) computes the blob's
gradient with ``torch.autograd.grad`` (``.grad`` untouched; bf16 autocast for bf16 runs, fp32 for
fp16/fp32 runs) and the gradient is linear in ``k``. The running peak is the largest finite
pre-clip norm of the ``spike.peak_window`` steps before the spike (0: since step 1): the seed's
"previous peak" at step 8,217 is not the initialisation transient of step 1.

Measurements. ``loss_excess_H = loss / twin's loss − 1`` at step ``at_step + H``, per step and
unsmoothed: both runs see the identical batch at every step but the spike step, so batch-to-batch
difficulty cancels (the remaining noise is ≈ ±0.5% on the default task). ``recovery_steps``:
the first H ≥ 1 from which the excess stays ≤ ``spike.recovery_tolerance`` until the end of the
run (an arm that drifts out again later has not recovered); an arm still above it at its last
step logs the steps it had left + 1 and ``recovered = 0``. The twins log the same metrics (zeros).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from clipamp_engine import DTYPES, total_norm

from sweep.config.schema import Config
from sweep.errors import UserError
from sweep.run.pipeline import RunResult, flatten, run_training, window_ranges
from sweep.tasks.build import Batch, Task, build_task
from sweep.run.tracking import RunTracker, redact

#: The clipping policies compared (each as an unspiked twin + a spiked run); fp16 runs the last only.
POLICIES = ("none", "fixed", "calibrated")
FP16_POLICIES = ("calibrated",)
GAP_STEPS = 10  # steps before the spike averaged into pre_spike_gap


# -- the corrupted batch --------------------------------------------------------------------
def binary_blob(batch: Batch, seed: int) -> Batch:
    """A batch of the same shape made of seeded uniform random bytes (inputs and next-byte targets)."""
    B, T = batch.inputs.shape
    g = torch.Generator().manual_seed(seed)
    blob = torch.randint(0, 256, (B, T + 1), generator=g, dtype=torch.int64).to(batch.inputs.device)
    return Batch(blob[:, :-1].contiguous(), blob[:, 1:].contiguous(), "binary_blob")


def grad_norm(model: torch.nn.Module, loss_fn: Callable, batch: Batch, dtype: str) -> float:
    """Global L2 norm of the token-mean loss's gradient on ``batch``; ``.grad`` and RNG untouched.

    bf16 runs are measured under bf16 autocast like the engine's step; fp16 and fp32 in fp32
    (an unscaled fp16 backward would underflow).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    device_type = params[0].device.type
    amp = (torch.autocast(device_type, dtype=DTYPES["bf16"]) if dtype == "bf16" else contextlib.nullcontext())
    with torch.random.fork_rng(devices=[]):
        with amp:
            out = loss_fn(model(batch.inputs), batch.targets)
        loss = out[0].float() / out[1].clamp(min=1) if isinstance(out, tuple) else out.float()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return total_norm([g for g in grads if g is not None]).item()  # sync: once, at the spike step


class SpikeLoss:
    """``loss_fn`` that multiplies the loss of one marked batch (micro-batches included) by ``k``.

    The marked batch is recognised by the storage of its targets tensor, so every other batch
    (train, eval) goes through untouched.
    """

    def __init__(self, loss_fn: Callable) -> None:
        self.loss_fn = loss_fn
        self.marked: torch.Tensor | None = None
        self.k = 1.0

    def mark(self, targets: torch.Tensor, k: float) -> None:
        self.marked, self.k = targets, k

    def __call__(self, output: Any, targets: torch.Tensor) -> Any:
        out = self.loss_fn(output, targets)
        if self.marked is None or targets.untyped_storage().data_ptr() != self.marked.untyped_storage().data_ptr():
            return out
        return (out[0] * self.k, out[1]) if isinstance(out, tuple) else out * self.k


@dataclass
class Crafted:
    """The corrupted batch of one policy pair, made inside its unspiked twin at the spike step."""

    batch: Batch
    k: float  # loss multiplier
    natural_norm: float  # the blob's gradient norm at k = 1
    peak: float  # running peak in the twin
    target: float  # factor × peak


def running_peak(norms: dict[int, float], at_step: int, window: int) -> float:
    """Largest finite pre-clip norm of the ``window`` steps before ``at_step`` (0: all of them)."""
    first = at_step - window if window else 1
    values = [v for s, v in norms.items() if first <= s < at_step and math.isfinite(v)]
    return max(values) if values else math.nan


# -- the measurements -----------------------------------------------------------------------
def loss_excess(rows: Sequence[dict], ref_rows: Sequence[dict], step: int) -> float:
    """``loss / reference loss − 1`` at ``step`` (1-based), on the identical batch."""
    a, b = rows[step - 1]["loss"], ref_rows[step - 1]["loss"]
    return a / b - 1.0 if math.isfinite(a) and math.isfinite(b) and b > 0 else math.nan


def recovery_steps(excess: Sequence[float], tolerance: float) -> int | None:
    """First H ≥ 1 from which ``excess[H-1:]`` stays ≤ ``tolerance`` to the end; None if the last is above."""
    h = len(excess) + 1
    while h > 1 and math.isfinite(excess[h - 2]) and excess[h - 2] <= tolerance:
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
    gap = [loss_excess(arm.rows, main_ref.rows, t) for t in range(max(1, at - GAP_STEPS), at)]
    gap = [g for g in gap if math.isfinite(g)]
    m["pre_spike_gap"] = sum(gap) / len(gap) if gap else math.nan
    row = arm.rows[at - 1]
    m.update(spike_pre_clip_norm=row["grad_l2_pre_clip"], spike_post_clip_norm=row["grad_l2_post_clip"],
             spike_skipped=float(bool(row["skipped"])), spike_running_peak=arm.peak,
             spike_ratio=row["grad_l2_pre_clip"] / arm.peak if arm.peak > 0 else math.nan,
             spike_loss_multiplier=arm.crafted.k if arm.spiked else 1.0, spike_natural_norm=arm.crafted.natural_norm,
             tau_at_spike=row["max_norm"] if row["max_norm"] is not None else math.nan,
             params_finite=float(all(bool(torch.isfinite(p).all()) for p in arm.task.model.parameters())))
    return m


# -- config checks --------------------------------------------------------------------------
def check_spike_config(cfg: Config) -> None:
    """Meaning checks for ``+experiment=spike``; ``UserError`` names the value and the fix."""
    s = cfg.spike
    if cfg.data.name == "synthetic":
        raise UserError("spike needs byte data (the corrupted batch is a binary blob): "
                        "pass data=stdlib or data=text, not data=synthetic")
    if not s.factor > 0:
        raise UserError(f"spike.factor={s.factor} must be > 0, e.g. spike.factor=20")
    if not s.fixed_max_norm > 0:
        raise UserError(f"spike.fixed_max_norm={s.fixed_max_norm} must be > 0, e.g. spike.fixed_max_norm=1.0")
    if not s.horizons or any(h < 1 for h in s.horizons):
        raise UserError(f"spike.horizons={list(s.horizons)} must be positive step counts, e.g. [1,5,20,100]")
    if not s.recovery_tolerance > 0:
        raise UserError(f"spike.recovery_tolerance={s.recovery_tolerance} must be > 0, e.g. 0.05 (5%)")
    if s.peak_window < 0:
        raise UserError(f"spike.peak_window={s.peak_window} must be >= 0 (0: the peak since step 1)")
    last = max(s.horizons)
    if not 2 <= s.at_step <= cfg.steps - last:
        raise UserError(f"spike.at_step={s.at_step} must be in [2, steps - {last}] with steps={cfg.steps} "
                        f"(the last horizon is +{last}): raise steps to >= {s.at_step + last} or lower spike.at_step")
    windows = window_ranges(cfg)
    if not windows or windows[0][-1] >= s.at_step:
        w = windows[0] if windows else range(1, 1)
        raise UserError(f"spike.at_step={s.at_step} must land after the calibration window ends "
                        f"(calibrate.window={cfg.calibrate.window} ends at step {w[-1] if w else '?'}): "
                        f"raise spike.at_step or lower calibrate.window")
    late = [w for w in windows if w[-1] >= s.at_step]
    if late:
        raise UserError(f"calibrate.every={cfg.calibrate.every} opens a calibration window at steps "
                        f"{late[0][0]}–{late[0][-1]}, at or after spike.at_step={s.at_step}, which would turn "
                        f"clipping off after the spike: use calibrate.every=0, or a larger calibrate.every that "
                        f"opens no window in steps {s.at_step}–{cfg.steps}")


def with_overrides(cfg: Config, overrides: Sequence[str], key: str) -> Config:
    """``cfg`` with ``KEY=VALUE`` overrides merged through the schema (unknown keys/types refused)."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)
    except Exception as e:  # OmegaConf validation errors
        raise UserError(f"{key}={list(overrides)}: {' '.join(str(e).split()).split(' full_key:')[0]}; "
                        f"pass KEY=VALUE items of the config, e.g. model.d_model=32") from None


def arm_config(cfg: Config, policy: str) -> Config:
    """The config of one policy's runs: its clip mode (calibrated: set by the windows), no resume."""
    arm_cfg = copy.deepcopy(cfg)
    if policy == "none":
        arm_cfg.clip = type(cfg.clip)(mode="none")
    elif policy == "fixed":
        arm_cfg.clip = type(cfg.clip)(mode="norm", max_norm=cfg.spike.fixed_max_norm)
    if hasattr(arm_cfg, "resume"):
        arm_cfg.resume = None
    return arm_cfg


def arm_name(policy: str, spiked: bool, prefix: str = "") -> str:
    """calibrated → reference / calibrated; none → none-reference / none; prefix fp16- for fp16."""
    if spiked:
        return f"{prefix}{policy}"
    return f"{prefix}reference" if policy == "calibrated" else f"{prefix}{policy}-reference"


# -- running the arms -----------------------------------------------------------------------
def play_pair(cfg: Config, policy: str, client, experiment_id: str, *, parent_run_id: str, tags: dict[str, str],
              uri: str, console: Console, prefix: str = "") -> tuple[Arm, Arm]:
    """One policy's unspiked twin (which crafts the corrupted batch at the spike step), then its spiked run.

    Both runs have the same seed, data order and policy, so they are the same run until the spike.
    """
    s = cfg.spike
    at = s.at_step
    arm_cfg = arm_config(cfg, policy)
    crafted: list[Crafted] = []
    out: list[Arm] = []
    for spiked in (False, True):
        task = build_task(arm_cfg.model, arm_cfg.data, seed=arm_cfg.seed, device=arm_cfg.device)
        loss = SpikeLoss(task.loss_fn)
        task = replace(task, loss_fn=loss)
        norms: dict[int, float] = {}

        def on_step(log, norms=norms) -> None:
            norms[log.step] = log.grad_l2_pre_clip

        def craft(step: int, batch: Batch, task=task, loss=loss, norms=norms) -> Batch:
            if step != at:
                return batch
            peak = running_peak(norms, at, s.peak_window)
            if not (math.isfinite(peak) and peak > 0):
                raise UserError(f"no finite pre-clip norm in the {s.peak_window or at - 1} steps before "
                                f"spike.at_step={at}: raise spike.peak_window or spike.at_step")
            blob = binary_blob(batch, seed=cfg.seed * 1_000_003 + at)
            natural = grad_norm(task.model, loss.loss_fn, blob, arm_cfg.amp.dtype)
            target = s.factor * peak
            crafted.append(Crafted(blob, target / natural, natural, peak, target))
            return batch

        def inject(step: int, batch: Batch, loss=loss) -> Batch:
            if step != at:
                return batch
            loss.mark(crafted[0].batch.targets, crafted[0].k)
            return crafted[0].batch

        name = arm_name(policy, spiked, prefix)
        result = run_training(
            arm_cfg, client, experiment_id, run_name=f"spike-{name}", calibrate=policy == "calibrated",
            parent_run_id=parent_run_id,
            tags={**tags, "spike_arm": name, "spike_policy": policy, "spike_family": arm_cfg.amp.dtype,
                  "spiked": str(spiked).lower()},
            batch_hook=inject if spiked else craft, on_step=on_step, task=task, uri=uri,
            announce=lambda msg, name=name: console.print(f"[dim]{name}: {msg}[/dim]"))
        if not crafted:
            raise RuntimeError(f"spike-{name} never reached step {at}")
        out.append(Arm(name, policy, arm_cfg.amp.dtype, spiked, result, task,
                       running_peak(norms, at, s.peak_window), crafted[0]))
    return out[0], out[1]


def fp16_outcome(arm: Arm, cfg: Config) -> tuple[bool, str]:
    """Did the fp16 run survive the spike: skipped + scale backed off (or clipped), then continued finite?"""
    at = cfg.spike.at_step
    row, rows = arm.rows[at - 1], arm.rows
    after = rows[at:]
    taken_after = [r for r in after if not r["skipped"]]
    continued = bool(taken_after) and all(math.isfinite(r["loss"]) for r in taken_after)
    finite = arm.metrics.get("params_finite") == 1.0
    if row["skipped"]:
        s0, s1 = row["scaler_scale"], after[0]["scaler_scale"] if after else math.nan
        absorbing = getattr(cfg.amp, "hysteresis", 1) > 1  # DeepSpeed hysteresis may absorb one overflow
        backed = s1 < s0 or absorbing
        what = (f"overflow at the spike ({row['skip_reason']}): step skipped, loss scale "
                f"2^{math.log2(s0):g} → 2^{math.log2(s1):g}")
        ok = backed and continued and finite
    else:
        tau = row["max_norm"]
        clipped = tau is not None and row["grad_l2_post_clip"] <= tau * (1 + 1e-3)
        what = (f"no overflow at the spike: ‖g‖ {row['grad_l2_pre_clip']:.3g} clipped to "
                f"{row['grad_l2_post_clip']:.3g} (τ = {tau if tau is not None else float('nan'):.3g})")
        ok = clipped and continued and finite
    what += (f"; {len(taken_after)}/{len(after)} later steps taken, "
             f"parameters {'finite' if finite else 'NOT finite'}")
    return ok, what


# -- report ---------------------------------------------------------------------------------
def model_size(task: Task) -> str:
    n = sum(p.numel() for p in task.model.parameters())
    return f"{n / 1e6:.2f}M params" if n >= 10_000 else f"{n} params"


def _pct(x: float) -> str:
    return "—" if not math.isfinite(x) else f"{x * 100:+.1f}%"


#: Columns of the terminal table (the markdown/CSV artifacts have all of them).
TERMINAL_COLUMNS = ("arm", "τ", "‖g‖", "×peak", "applied", "recovery")


def table_rows(arms: Sequence[Arm], cfg: Config) -> list[dict[str, Any]]:
    """One row per spiked arm: the spike step's norms, loss excess at each horizon, recovery."""
    out = []
    for a in arms:
        m, row = a.metrics, a.rows[cfg.spike.at_step - 1]
        tau = m["tau_at_spike"]
        rec = int(m["recovery_steps"])
        d = {"arm": a.name, "dtype": a.family, "τ": f"{tau:.3g}" if math.isfinite(tau) else "none",
             "‖g‖": f"{row['grad_l2_pre_clip']:.3g}",
             "×peak": f"{m['spike_ratio']:.1f}" if math.isfinite(m["spike_ratio"]) else "—",
             "applied": "skipped" if row["skipped"] else f"{row['grad_l2_post_clip']:.3g}"}
        d.update({f"+{h}": _pct(m[f"loss_excess_{h}"]) for h in cfg.spike.horizons})
        d["recovery"] = str(rec) if m["recovered"] else f">{rec - 1}"
        d["loss ×k"] = f"{m['spike_loss_multiplier']:.3g}"
        d["gap before spike"] = _pct(m["pre_spike_gap"])
        d["final loss"] = f"{a.result.metrics.get('final_loss', math.nan):.3f}"
        out.append(d)
    return out


def rich_table(rows: list[dict[str, Any]], title: str) -> Table:
    """The terminal table: arm, τ, the spike's norm (×peak, applied), loss excess per horizon, recovery."""
    from rich import box

    keys = [k for k in rows[0] if k in TERMINAL_COLUMNS or k.startswith("+")]
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for k in keys:
        t.add_column(k, justify="left" if k == "arm" else "right", no_wrap=True)
    for r in rows:
        t.add_row(*[str(r[k]) for k in keys])
    return t


def markdown_table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


COLORS = {"none": "tab:red", "fixed": "tab:orange", "calibrated": "tab:blue"}


def _smooth(xs: Sequence[float], w: int = 5) -> list[float]:
    out = []
    for i in range(len(xs)):
        win = [x for x in xs[max(0, i - w + 1):i + 1] if math.isfinite(x)]
        out.append(sum(win) / len(win) if win else math.nan)
    return out


def spike_figure(pairs: dict[str, tuple[Arm, Arm]], fp16: dict[str, tuple[Arm, Arm]], cfg: Config,
                 path: Path) -> Path:
    """Loss, per-step loss excess, pre-clip norm and (fp16) loss scale vs step; spike step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    at, tol = cfg.spike.at_step, cfg.spike.recovery_tolerance
    fig, ((ax_loss, ax_ex), (ax_norm, ax_16)) = plt.subplots(2, 2, figsize=(11, 7))

    def losses(a: Arm) -> list[float]:  # the corrupted batch's own (multiplied) loss is not plotted
        return [math.nan if a.spiked and r["step"] == at else r["loss"] for r in a.rows]

    window = range(max(1, at - 10), cfg.steps + 1)
    for policy, (twin, arm) in pairs.items():
        color = COLORS[policy]
        tau = arm.metrics["tau_at_spike"]
        label = policy + (f" (τ={tau:.2g})" if math.isfinite(tau) else "")
        steps = [r["step"] for r in arm.rows]
        ax_loss.plot(steps, _smooth(losses(twin)), color=color, lw=0.9, ls="--", alpha=0.8)
        ax_loss.plot(steps, _smooth(losses(arm)), color=color, lw=1.0, label=label)
        ex = [math.nan if t == at else loss_excess(arm.rows, twin.rows, t) * 100 for t in window]
        ax_ex.plot(list(window), ex, color=color, lw=1.0, label=label)
        taken = [r for r in arm.rows if not r["skipped"]]
        ax_norm.plot([r["step"] for r in taken], [r["grad_l2_pre_clip"] for r in taken], color=color, lw=0.8,
                     alpha=0.8, label=label)
        ax_norm.scatter([at], [arm.rows[at - 1]["grad_l2_post_clip"]], color=color, marker="v", zorder=5, s=30)
        if math.isfinite(tau):
            ax_norm.axhline(tau, color=color, lw=0.8, ls=":")
    for policy, (twin, arm) in fp16.items():
        ex = [math.nan if t == at else loss_excess(arm.rows, twin.rows, t) * 100 for t in window]
        ax_ex.plot(list(window), ex, color="tab:purple", lw=1.0, label=f"{arm.name} (vs fp16 twin)")
        for a, ls in ((twin, "--"), (arm, "-")):
            ax_16.step([r["step"] for r in a.rows], [math.log2(r["scaler_scale"]) for r in a.rows], where="post",
                       color="0.5" if ls == "--" else "tab:purple", lw=1.0, ls=ls, label=a.name)
            sk = [r["step"] for r in a.rows if r["skipped"]]
            ax_16.scatter(sk, [math.log2(a.rows[t - 1]["scaler_scale"]) for t in sk], marker="x",
                          color="0.5" if ls == "--" else "tab:purple", s=20, zorder=5)
    ax_loss.plot([], [], color="gray", ls="--", lw=0.9, label="unspiked twin")
    ref = pairs["calibrated"][0] if "calibrated" in pairs else next(iter(pairs.values()))[0]
    lo = min(r["loss"] for r in ref.rows[at - 1:] if math.isfinite(r["loss"]))
    hi = max(r["loss"] for r in ref.rows[max(0, at - 60):at] if math.isfinite(r["loss"]))
    ax_loss.set_ylim(lo * 0.85, hi * 1.3)
    ax_loss.set_ylabel("training loss (mean of 5 steps)")
    ax_loss.set_title(f"loss ({cfg.model.name}, {ref.family}): spike = {cfg.spike.factor:g}× the running peak")
    ax_ex.axhspan(-tol * 100, tol * 100, color="green", alpha=0.08, label=f"±{tol:.0%}")
    ax_ex.set_xlim(window[0], window[-1])
    ax_ex.set_ylabel("loss / twin's loss − 1 (%), same batches")
    ax_ex.set_title("loss excess over the unspiked twin, per step")
    ax_norm.set_yscale("log")
    ax_norm.set_ylabel("pre-clip ‖g‖  (▼ applied, ··· τ)")
    ax_norm.set_title("global gradient norm (spiked runs)")
    for w in window_ranges(cfg):
        ax_norm.axvspan(w[0], w[-1], color="orange", alpha=0.1)
    ax_norm.plot([], [], color="orange", alpha=0.3, lw=6, label="calibration windows")
    if fp16:
        twin16 = next(iter(fp16.values()))[0]
        ax_16.set_ylabel("log2 loss scale  (× skipped step)")
        ax_16.set_title(f"fp16 variant ({model_size(twin16.task)}): loss scale")
    else:
        ax_16.set_axis_off()
    for ax in (ax_loss, ax_ex, ax_norm) + ((ax_16,) if fp16 else ()):
        ax.axvline(at, color="red", lw=0.8, alpha=0.5)
        ax.set_xlabel("step")
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


@dataclass
class SpikeResult:
    """What ``run_spike`` measured: the parent run, each policy's (twin, spiked) pair, the table."""

    parent_run_id: str
    pairs: dict[str, tuple[Arm, Arm]]
    fp16: dict[str, tuple[Arm, Arm]]
    table: list[dict[str, Any]]
    figure: Path
    fp16_ok: bool | None = None
    fp16_outcome: str = ""

    @property
    def arms(self) -> dict[str, Arm]:
        """Every child by name (reference, calibrated, none-reference, none, …, fp16-…)."""
        return {a.name: a for pair in list(self.pairs.values()) + list(self.fp16.values()) for a in pair}


def log_run_metrics(client, run_id: str, metrics: dict[str, float], step: int) -> None:
    """Summary metrics on a run that has already ended (non-finite values dropped, as RunTracker does)."""
    import time

    from mlflow.entities import Metric

    ts = int(time.time() * 1000)
    batch = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None and math.isfinite(v)]
    if batch:
        client.log_batch(run_id, metrics=batch)


def run_spike(cfg: Config, client, experiment_id: str, *, uri: str, tags: dict[str, str] | None = None,
              console: Console | None = None) -> SpikeResult:
    """Run each policy's pair as children of one parent run; log metrics, figure and table; print them."""
    console = console or Console()
    check_spike_config(cfg)
    s = cfg.spike
    cfg16 = None
    if s.fp16:
        cfg16 = with_overrides(cfg, s.fp16_overrides, "spike.fp16_overrides")
        cfg16.amp.dtype = "fp16"
        check_spike_config(cfg16)
    tags = dict(tags or {})
    parent = RunTracker(client, experiment_id, f"spike-{cfg.model.name}-{cfg.amp.dtype}",
                        tags={**tags, "run": "spike", "dtype": cfg.amp.dtype, "model": cfg.model.name,
                              "data": cfg.data.name, "device": cfg.device})
    status = "FAILED"
    try:
        parent.log_params(flatten(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)))
        console.print(f"spike: parent run {parent.run_id}; a corrupted batch at step {s.at_step} with "
                      f"‖g‖ = {s.factor:g} × the peak of the {s.peak_window or s.at_step - 1} steps before it")
        common = dict(parent_run_id=parent.run_id, tags=tags, uri=uri, console=console)
        pairs = {p: play_pair(cfg, p, client, experiment_id, **common) for p in POLICIES}
        fp16 = ({p: play_pair(cfg16, p, client, experiment_id, prefix="fp16-", **common) for p in FP16_POLICIES}
                if cfg16 is not None else {})
        for family, family_cfg in ((pairs, cfg), (fp16, cfg16)):
            main_ref = family["calibrated"][0] if "calibrated" in family else None
            for twin, arm in family.values():
                for a in (twin, arm):
                    a.metrics = arm_metrics(a, twin, main_ref or twin, family_cfg)
                    log_run_metrics(client, a.result.run_id, a.metrics, step=s.at_step)
        ok, outcome = fp16_outcome(fp16["calibrated"][1], cfg16) if fp16 else (None, "")

        spiked = [arm for _, arm in list(pairs.values()) + list(fp16.values())]
        rows = table_rows(spiked, cfg)
        title = (f"One corrupted batch at step {s.at_step}: ‖g‖ = {s.factor:g} × the running peak; "
                 f"loss excess over each run's unspiked twin at +H steps; recovery = steps to be back "
                 f"within {s.recovery_tolerance:.0%} for good")
        figure = spike_figure(pairs, fp16, cfg, parent.artifact_path("spike.png"))
        parent.artifact_path("spike_table.md").write_text(
            f"{title}\n\n{markdown_table(rows)}" + (f"\nfp16: {outcome}\n" if outcome else ""), encoding="utf-8")
        with open(parent.artifact_path("spike_table.csv"), "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        parent.log_metrics({f"{a.name}.{k}": v for a in spiked for k, v in a.metrics.items()
                            if k.startswith(("loss_excess", "recovery", "spike_"))}, step=s.at_step)
        if fp16:
            parent.set_tags({"fp16_spike": ("survived: " if ok else "FAILED: ") + outcome})

        print_wide(console, rich_table(rows, title))
        console.print(summary_line(pairs, cfg))
        if fp16:
            console.print(f"fp16 ({model_size(fp16['calibrated'][1].task)}): "
                          + ("[green]" if ok else "[bold red]") + outcome)
        if s.figure_out:
            dest = Path(s.figure_out)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(figure, dest)
            console.print(f"figure copied to {dest}")
        console.print(f"figure: {figure}\ntable: {parent.artifact_path('spike_table.md')}\n"
                      f"runs: mlflow ui --backend-store-uri {redact(uri)} → experiment {experiment_id}, "
                      f"parent run {parent.run_id}")
        if ok is False:
            raise RuntimeError(f"the fp16 run did not survive the spike as required: {outcome}")
        status = "FINISHED"
        return SpikeResult(parent.run_id, pairs, fp16, rows, figure, ok, outcome)
    finally:
        parent.end(status)


def print_wide(console: Console, renderable: Any, width: int = 110) -> None:
    """Print at ``width`` columns when the output is not a terminal (a pipe or log file does not wrap)."""
    if console.is_terminal or console.width >= width:
        console.print(renderable)
        return
    Console(file=console.file, width=width, no_color=console.no_color, soft_wrap=True).print(renderable)


def summary_line(pairs: dict[str, tuple[Arm, Arm]], cfg: Config) -> str:
    s = cfg.spike
    last = max(s.horizons)

    def rec(m: dict[str, float]) -> str:
        n, tol = int(m["recovery_steps"]), f"{s.recovery_tolerance:.0%}"
        if m["recovered"]:
            return f"back within {tol} for good after {n} step(s)"
        return f"not back within {tol} in {n - 1} steps"

    return "; ".join(f"{p}: {_pct(arm.metrics[f'loss_excess_{last}'])} at +{last}, {rec(arm.metrics)}"
                     for p, (_, arm) in pairs.items())
