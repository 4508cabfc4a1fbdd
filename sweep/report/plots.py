"""PNG figures (matplotlib, Agg): one run's traces and histogram, a sweep's loss vs clipping ratio."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from sweep.pick import Pick, completed

DTYPE_COLOURS = {"bf16": "tab:blue", "fp16": "tab:orange", "fp32": "tab:green"}


def _finite(xs):
    return [x for x in xs if x is not None and math.isfinite(x)]


def legend(ax, **kwargs) -> None:
    """``ax.legend(**kwargs)`` when something on ``ax`` has a label (matplotlib warns otherwise, e.g. for
    a study with no complete trial)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def save(fig, path: Path, dpi: int = 90) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def plot_run(
    rows: list[dict[str, Any]],
    out_dir: Path,
    *,
    quantiles: dict[str, float] | None = None,
    recommended: float | None = None,
    title: str = "",
) -> list[Path]:
    """Write ``grad_norm.png``, ``grad_norm_hist.png``, ``scaler_scale.png`` and ``loss.png``.

    The norm figures draw the τ the run clipped at (the steps' ``max_norm``, red, "τ used") and, where it
    is no τ the run used (e.g. a fixed-τ or unclipped run), the ``recommended`` τ (dashed, "recommended τ")."""
    out_dir.mkdir(parents=True, exist_ok=True)
    quantiles = {k: v for k, v in (quantiles or {}).items() if k != "max"}
    used = taus_used(rows)
    if recommended is not None and (not math.isfinite(recommended) or recommended in used):
        recommended = None
    steps = [r["step"] for r in rows]
    paths = [
        _grad_norm_trace(rows, quantiles, recommended, title, out_dir / "grad_norm.png"),
        _grad_norm_hist(rows, quantiles, used, recommended, out_dir / "grad_norm_hist.png"),
    ]

    fig, ax = plt.subplots(figsize=(9, 3))
    ax.step(steps, [r["scaler_scale"] for r in rows], where="post")
    ax.set_yscale("log", base=2)
    ax.set(xlabel="step", ylabel="loss scale", title="GradScaler scale (1 = no loss scaling)")
    paths.append(save(fig, out_dir / "scaler_scale.png"))

    fig, ax = plt.subplots(figsize=(9, 3.5))
    losses = [(r["step"], r["loss"]) for r in rows if math.isfinite(r["loss"])]
    ax.plot([s for s, _ in losses], [v for _, v in losses], lw=0.8)
    ax.set(xlabel="step", ylabel="training loss", title="loss")
    paths.append(save(fig, out_dir / "loss.png"))
    return paths


def taus_used(rows: list[dict[str, Any]]) -> list[float]:
    """The distinct finite τ the steps were clipped at (their ``max_norm``; what the ``tau_used`` tag condenses)."""
    return sorted({float(v) for v in _finite(r.get("max_norm") for r in rows)})


def _tau_trace(rows) -> tuple[list[int], list[float]]:
    """The τ in force at each step (NaN where the step was not clipped at a τ)."""
    values = [r.get("max_norm") for r in rows]
    return [r["step"] for r in rows], [v if v is not None and math.isfinite(v) else math.nan for v in values]


def _grad_norm_trace(rows, quantiles: dict[str, float], recommended: float | None, title: str, path: Path) -> Path:
    steps = [r["step"] for r in rows]
    pre = [r["grad_l2_pre_clip"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4))
    taken = [
        (r["step"], r["grad_l2_pre_clip"]) for r in rows if not r["skipped"] and math.isfinite(r["grad_l2_pre_clip"])
    ]
    ax.plot([s for s, _ in taken], [p for _, p in taken], lw=0.8, label="pre-clip ‖g‖")
    post = [(r["step"], r["grad_l2_post_clip"]) for r in rows if not r["skipped"]]
    ax.plot([s for s, _ in post], [p for _, p in post], lw=0.8, alpha=0.7, label="post-clip ‖g‖")
    for name, v in quantiles.items():
        ax.axhline(v, ls=":", lw=0.8, color="gray")
        ax.annotate(name, (steps[-1], v), fontsize=7, color="gray", ha="right", va="bottom")
    used = taus_used(rows)
    if used:
        xs, ys = _tau_trace(rows)
        label = f"τ used = {used[0]:.3g}" if len(used) == 1 else f"τ used ({used[0]:.3g}–{used[-1]:.3g})"
        ax.step(xs, ys, where="post", color="red", lw=1.2, label=label)
    if recommended is not None:
        ax.axhline(recommended, color="purple", ls="--", lw=1.0, label=f"recommended τ = {recommended:.3g}")
    windows = [r["step"] for r in rows if r.get("phase") == "calibrate"]
    if windows:
        ax.axvspan(min(windows), max(windows), color="orange", alpha=0.08, label="calibration window")
    skipped = [r["step"] for r in rows if r["skipped"]]
    if skipped:
        ymax = max(_finite(pre) or [1.0])
        ax.scatter(skipped, [ymax] * len(skipped), marker="x", color="black", zorder=5, label="skipped step")
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="global L2 norm", title=f"gradient norm {title}".strip())
    legend(ax, fontsize=7, loc="upper right")
    return save(fig, path)


def _grad_norm_hist(
    rows, quantiles: dict[str, float], used: list[float], recommended: float | None, path: Path
) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    logs = [math.log10(p) for p in _finite(r["grad_l2_pre_clip"] for r in rows) if p > 0]
    ax.hist(logs, bins=40, color="steelblue")
    for name, v in quantiles.items():
        if v > 0:
            ax.axvline(math.log10(v), ls="--", lw=0.8, color="gray")
            ax.annotate(name, (math.log10(v), ax.get_ylim()[1] * 0.9), fontsize=7, rotation=90)
    for i, tau in enumerate(t for t in used if t > 0):
        ax.axvline(math.log10(tau), color="red", lw=1.2, label="τ used" if i == 0 else None)
    if recommended is not None and recommended > 0:
        ax.axvline(math.log10(recommended), color="purple", ls="--", lw=1.0, label="recommended τ")
    legend(ax, fontsize=7)
    ax.set(xlabel="log10 pre-clip ‖g‖", ylabel="steps", title="norm distribution (finite steps)")
    return save(fig, path)


def plot_sweep(
    df,
    pick: Pick | None,
    path: Path,
    *,
    band: tuple[float, float],
    anchor: dict[str, float] | None = None,
    title: str = "",
) -> Path:
    """Eval loss vs clipping ratio (Pareto front, band, pick) and vs max_norm, coloured by dtype."""
    done = completed(df)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    a.axvspan(band[0], band[1], color="green", alpha=0.08, label=f"target band [{band[0]:g}, {band[1]:g}]")
    for dtype, g in done.groupby("dtype"):
        c = DTYPE_COLOURS.get(dtype, "gray")
        a.scatter(g["clip_ratio"], g["eval_loss"], color=c, label=dtype, s=36, zorder=3)
        b.scatter(g["max_norm"], g["eval_loss"], color=c, label=dtype, s=36, zorder=3)
        for _, r in g.iterrows():
            a.annotate(
                str(int(r["trial"])),
                (r["clip_ratio"], r["eval_loss"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
    front = done[done["pareto"]].sort_values("clip_ratio") if "pareto" in done else done.iloc[:0]
    if len(front):
        a.step(
            front["clip_ratio"],
            front["eval_loss"],
            where="post",
            color="black",
            lw=0.8,
            ls="--",
            label="Pareto front",
            zorder=2,
        )
    if pick is not None:
        for ax, x in ((a, pick.clip_ratio), (b, pick.max_norm)):
            ax.scatter(
                [x],
                [pick.eval_loss],
                marker="*",
                s=260,
                facecolor="none",
                edgecolor="red",
                lw=1.5,
                zorder=4,
                label=f"pick: trial {pick.trial}",
            )
    for k, v in (anchor or {}).items():
        b.axvline(v, ls=":", lw=0.8, color="gray")
        b.annotate(k, (v, b.get_ylim()[1]), fontsize=7, color="gray", rotation=90, va="top")
    a.set(xlabel="clipping ratio (share of taken steps clipped)", ylabel="eval loss")
    b.set_xscale("log")
    b.set(xlabel="max_norm τ", ylabel="eval loss")
    legend(a, fontsize=7)
    legend(b, fontsize=7)
    other = df[df["state"] != "COMPLETE"]["state"].value_counts().to_dict()
    fig.suptitle(
        f"{title}  ({len(done)} complete" + "".join(f", {v} {k.lower()}" for k, v in other.items()) + ")", fontsize=9
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    return save(fig, path, dpi=110)
