"""PNG plots of one run: grad-norm trace, log-norm histogram, loss scale, loss (matplotlib, Agg)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _finite(xs):
    return [x for x in xs if x is not None and math.isfinite(x)]


def plot_run(rows: list[dict[str, Any]], out_dir: Path, *, quantiles: dict[str, float] | None = None,
             tau: float | None = None, title: str = "") -> list[Path]:
    """Write ``grad_norm.png``, ``grad_norm_hist.png``, ``scaler_scale.png`` and ``loss.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    pre = [r["grad_l2_pre_clip"] for r in rows]
    taken = [(s, p, r) for s, p, r in zip(steps, pre, rows) if not r["skipped"] and math.isfinite(p)]
    skipped = [s for s, r in zip(steps, rows) if r["skipped"]]
    quantiles = {k: v for k, v in (quantiles or {}).items() if k != "max"}
    paths = []

    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot([t[0] for t in taken], [t[1] for t in taken], lw=0.8, label="pre-clip ‖g‖")
    post = [(r["step"], r["grad_l2_post_clip"]) for r in rows if not r["skipped"]]
    ax.plot([p[0] for p in post], [p[1] for p in post], lw=0.8, alpha=0.7, label="post-clip ‖g‖")
    for name, v in quantiles.items():
        ax.axhline(v, ls=":", lw=0.8, color="gray")
        ax.annotate(name, (steps[-1], v), fontsize=7, color="gray", ha="right", va="bottom")
    if tau is not None:
        ax.axhline(tau, color="red", lw=1.2, label=f"τ = {tau:.3g}")
    windows = [r["step"] for r in rows if r.get("phase") == "calibrate"]
    if windows:
        ax.axvspan(min(windows), max(windows), color="orange", alpha=0.08, label="calibration window")
    if skipped:
        ymax = max(_finite(pre) or [1.0])
        ax.scatter(skipped, [ymax] * len(skipped), marker="x", color="black", zorder=5, label="skipped step")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("global L2 norm")
    ax.set_title(f"gradient norm {title}".strip())
    ax.legend(fontsize=7, loc="upper right")
    paths.append(_save(fig, out_dir / "grad_norm.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    logs = [math.log10(p) for p in _finite(pre) if p > 0]
    ax.hist(logs, bins=40, color="steelblue")
    for name, v in quantiles.items():
        if v > 0:
            ax.axvline(math.log10(v), ls="--", lw=0.8, color="gray")
            ax.annotate(name, (math.log10(v), ax.get_ylim()[1] * 0.9), fontsize=7, rotation=90)
    if tau:
        ax.axvline(math.log10(tau), color="red", lw=1.2)
    ax.set_xlabel("log10 pre-clip ‖g‖")
    ax.set_ylabel("steps")
    ax.set_title("norm distribution (finite steps)")
    paths.append(_save(fig, out_dir / "grad_norm_hist.png"))

    fig, ax = plt.subplots(figsize=(9, 3))
    ax.step(steps, [r["scaler_scale"] for r in rows], where="post")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title("GradScaler scale (1 = no loss scaling)")
    paths.append(_save(fig, out_dir / "scaler_scale.png"))

    fig, ax = plt.subplots(figsize=(9, 3.5))
    losses = [(r["step"], r["loss"]) for r in rows if math.isfinite(r["loss"])]
    ax.plot([l[0] for l in losses], [l[1] for l in losses], lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("loss")
    paths.append(_save(fig, out_dir / "loss.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
