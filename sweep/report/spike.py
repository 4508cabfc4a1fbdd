"""The spike experiment's report: its table (terminal, markdown, CSV), summary line and figure."""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.table import Table

from sweep.config.schema import Config, window_ranges
from sweep.report.format import markdown_table, pct, ui_command
from sweep.report.plots import legend, plt, save
from sweep.results.spike import Arm, loss_excess, void_comparison
from sweep.tasks.build import count_text

if TYPE_CHECKING:
    from sweep.tracking.tracker import RunTracker

#: Columns of the terminal table (the markdown/CSV artifacts have all of them).
TERMINAL_COLUMNS = ("arm", "τ", "‖g‖", "×peak", "applied", "recovery")
COLORS = {"none": "tab:red", "fixed": "tab:orange", "calibrated": "tab:blue"}
Pairs = dict[str, tuple[Arm, Arm]]


def model_size(arm: Arm) -> str:
    return f"{count_text(sum(p.numel() for p in arm.task.model.parameters()))} params"


def tolerance_text(tolerance: float) -> str:
    """``spike.recovery_tolerance`` as a percentage with the digits it has (0.025: 2.5%, not 2%)."""
    return f"{tolerance * 100:.4g}%"


def table_title(cfg: Config) -> str:
    s = cfg.spike
    return (
        f"One corrupted batch at step {s.at_step}: ‖g‖ = {s.factor:g} × the running peak; "
        f"loss excess over each run's unspiked twin at +H steps; recovery = steps to be back "
        f"within ±{tolerance_text(s.recovery_tolerance)} of it for good"
    )


def table_rows(arms: Sequence[Arm], cfg: Config) -> list[dict[str, Any]]:
    """One row per spiked arm: the spike step's norms, loss excess at each horizon, recovery."""
    out = []
    for a in arms:
        m, row = a.metrics, a.rows[cfg.spike.at_step - 1]
        tau = m["tau_at_spike"]
        d = {
            "arm": a.name,
            "dtype": a.family,
            "τ": f"{tau:.3g}" if math.isfinite(tau) else "none",
            "‖g‖": f"{row['grad_l2_pre_clip']:.3g}",
            "×peak": f"{m['spike_ratio']:.1f}" if math.isfinite(m["spike_ratio"]) else "—",
            "applied": "skipped" if row["skipped"] else f"{row['grad_l2_post_clip']:.3g}",
        }
        d.update({f"+{h}": pct(m[f"loss_excess_{h}"], signed=True) for h in cfg.spike.horizons})
        d["recovery"] = recovery_text(a)
        d["loss ×k"] = f"{m['spike_loss_multiplier']:.3g}"
        d["gap before spike"] = pct(m["pre_spike_gap"], signed=True)
        d["final loss"] = f"{a.result.metrics.get('final_loss', math.nan):.3f}"
        out.append(d)
    return out


def recovery_text(arm: Arm) -> str:
    """The steps to recovery, ``>N`` if it never came, ``void`` if the twin skipped the spike step too."""
    if void_comparison(arm):
        return "void"
    rec = int(arm.metrics["recovery_steps"])
    return str(rec) if arm.metrics["recovered"] else f">{rec - 1}"


def write_spike_table(tracker: RunTracker, rows: list[dict[str, Any]], title: str, fp16_outcome: str) -> None:
    """``spike_table.md`` and ``spike_table.csv`` into the parent run's artifacts."""
    tracker.artifact_path("spike_table.md").write_text(
        f"{title}\n\n{markdown_table(list(rows[0]), [list(r.values()) for r in rows])}"
        + (f"\nfp16: {fp16_outcome}\n" if fp16_outcome else ""),
        encoding="utf-8",
    )
    with open(tracker.artifact_path("spike_table.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def rich_table(rows: list[dict[str, Any]], title: str) -> Table:
    """The terminal table: arm, τ, the spike's norm (×peak, applied), loss excess per horizon, recovery."""
    keys = [k for k in rows[0] if k in TERMINAL_COLUMNS or k.startswith("+")]
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for k in keys:
        t.add_column(k, justify="left" if k == "arm" else "right", no_wrap=True)
    for r in rows:
        t.add_row(*[str(r[k]) for k in keys])
    return t


def summary_line(pairs: Pairs, cfg: Config) -> str:
    s = cfg.spike
    last = max(s.horizons)

    def rec(m: dict[str, float]) -> str:
        n, tol = int(m["recovery_steps"]), tolerance_text(s.recovery_tolerance)
        if m["recovered"]:
            return f"back within ±{tol} for good after {n} step(s)"
        return f"not back within ±{tol} in {n - 1} steps"

    return "; ".join(
        f"{p}: void (its unspiked twin skipped step {s.at_step} too, so it tells nothing of the spike)"
        if void_comparison(arm)
        else f"{p}: {pct(arm.metrics[f'loss_excess_{last}'], signed=True)} at +{last}, {rec(arm.metrics)}"
        for p, (_, arm) in pairs.items()
    )


def _smooth(xs: Sequence[float], w: int = 5) -> list[float]:
    out = []
    for i in range(len(xs)):
        win = [x for x in xs[max(0, i - w + 1) : i + 1] if math.isfinite(x)]
        out.append(sum(win) / len(win) if win else math.nan)
    return out


def spike_figure(pairs: Pairs, fp16: Pairs, cfg: Config, path: Path) -> Path:
    """Loss, per-step loss excess, pre-clip norm and (fp16) loss scale vs step; spike step marked."""
    at = cfg.spike.at_step
    fig, ((ax_loss, ax_ex), (ax_norm, ax_16)) = plt.subplots(2, 2, figsize=(11, 7))
    window = range(max(1, at - 10), cfg.steps + 1)
    for policy, (twin, arm) in pairs.items():
        _plot_pair(ax_loss, ax_ex, ax_norm, twin, arm, COLORS[policy], policy, window, at)
    for twin, arm in fp16.values():
        ex = [math.nan if t == at else loss_excess(arm.rows, twin.rows, t) * 100 for t in window]
        ax_ex.plot(list(window), ex, color="tab:purple", lw=1.0, label=f"{arm.name} (vs fp16 twin)")
        _plot_scale(ax_16, twin, "0.5", "--")
        _plot_scale(ax_16, arm, "tab:purple", "-")
    _decorate(ax_loss, ax_ex, ax_norm, ax_16, pairs, fp16, cfg, window)
    return save(fig, path, dpi=80)


def _plot_pair(ax_loss, ax_ex, ax_norm, twin: Arm, arm: Arm, color: str, policy: str, window: range, at: int) -> None:
    def losses(a: Arm) -> list[float]:  # the corrupted batch's own (multiplied) loss is not plotted
        return [math.nan if a.spiked and r["step"] == at else r["loss"] for r in a.rows]

    tau = arm.metrics["tau_at_spike"]
    label = policy + (f" (τ={tau:.2g})" if math.isfinite(tau) else "")
    steps = [r["step"] for r in arm.rows]
    ax_loss.plot(steps, _smooth(losses(twin)), color=color, lw=0.9, ls="--", alpha=0.8)
    ax_loss.plot(steps, _smooth(losses(arm)), color=color, lw=1.0, label=label)
    ex = [math.nan if t == at else loss_excess(arm.rows, twin.rows, t) * 100 for t in window]
    ax_ex.plot(list(window), ex, color=color, lw=1.0, label=label)
    taken = [r for r in arm.rows if not r["skipped"]]
    ax_norm.plot(
        [r["step"] for r in taken], [r["grad_l2_pre_clip"] for r in taken], color=color, lw=0.8, alpha=0.8, label=label
    )
    ax_norm.scatter([at], [arm.rows[at - 1]["grad_l2_post_clip"]], color=color, marker="v", zorder=5, s=30)
    if math.isfinite(tau):
        ax_norm.axhline(tau, color=color, lw=0.8, ls=":")


def _plot_scale(ax, a: Arm, color: str, ls: str) -> None:
    ax.step(
        [r["step"] for r in a.rows],
        [math.log2(r["scaler_scale"]) for r in a.rows],
        where="post",
        color=color,
        lw=1.0,
        ls=ls,
        label=a.name,
    )
    sk = [r["step"] for r in a.rows if r["skipped"]]
    ax.scatter(sk, [math.log2(a.rows[t - 1]["scaler_scale"]) for t in sk], marker="x", color=color, s=20, zorder=5)


def _decorate(ax_loss, ax_ex, ax_norm, ax_16, pairs: Pairs, fp16: Pairs, cfg: Config, window: range) -> None:
    at, tol = cfg.spike.at_step, cfg.spike.recovery_tolerance
    ax_loss.plot([], [], color="gray", ls="--", lw=0.9, label="unspiked twin")
    ref = pairs["calibrated"][0] if "calibrated" in pairs else next(iter(pairs.values()))[0]
    lo = min(r["loss"] for r in ref.rows[at - 1 :] if math.isfinite(r["loss"]))
    hi = max(r["loss"] for r in ref.rows[max(0, at - 60) : at] if math.isfinite(r["loss"]))
    ax_loss.set_ylim(lo * 0.85, hi * 1.3)
    ax_loss.set_ylabel("training loss (mean of 5 steps)")
    ax_loss.set_title(f"loss ({cfg.model.name}, {ref.family}): spike = {cfg.spike.factor:g}× the running peak")
    ax_ex.axhspan(-tol * 100, tol * 100, color="green", alpha=0.08, label=f"±{tolerance_text(tol)}")
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
        ax_16.set_ylabel("log2 loss scale  (× skipped step)")
        ax_16.set_title(f"fp16 variant ({model_size(next(iter(fp16.values()))[0])}): loss scale")
    else:
        ax_16.set_axis_off()
    for ax in (ax_loss, ax_ex, ax_norm) + ((ax_16,) if fp16 else ()):
        ax.axvline(at, color="red", lw=0.8, alpha=0.5)
        ax.set_xlabel("step")
        legend(ax, fontsize=7, loc="best")


def where_to_look(figure: Path, table: Any, uri: str, experiment_id: str, parent_run_id: str) -> str:
    """The run's last lines: the figure, the table, and how to open the runs (the command every run prints,
    ``ui_command``: a loopback ``mlflow ui`` for a file store, the server's page for an ``http`` store)."""
    return f"figure: {figure}\ntable: {table}\nruns: {ui_command(uri, experiment_id)}  (parent run {parent_run_id})"
