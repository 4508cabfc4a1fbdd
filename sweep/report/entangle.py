"""The LR check's figure: mean eval loss over the (lr, τ) grid of ``study=entangle``."""

from __future__ import annotations

import math
from pathlib import Path

#: the τ axis label of the unclipped row (as in ``sweep.experiments.study.entangle.NONE``)
NONE = "none"


def plot_entangle(cells, verdict, path: Path, title: str = "") -> Path:
    """Mean eval loss over the (lr, τ) grid (``cells``: lr, tau, max_norm, mean, sd, n), annotated
    mean ± SD, with the verdict's best clipped cell and its unclipped lower-LR match marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from sweep.report.plots import legend

    lrs = sorted(cells["lr"].unique())
    taus = [NONE] + sorted(
        (t for t in cells["tau"].unique() if t != NONE),
        key=lambda t: -float(cells.loc[cells["tau"] == t, "max_norm"].iloc[0]),
    )
    grid = np.full((len(taus), len(lrs)), np.nan)
    text = [["" for _ in lrs] for _ in taus]
    for _, r in cells.iterrows():
        i, j = taus.index(r["tau"]), lrs.index(r["lr"])
        grid[i, j] = r["mean"]
        text[i][j] = f"{r['mean']:.3f}" + (f"\n±{r['sd']:.3f}" if math.isfinite(r["sd"]) else "")
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(lrs), 1.4 + 0.9 * len(taus)))
    im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    for i in range(len(taus)):
        for j in range(len(lrs)):
            ax.text(
                j,
                i,
                text[i][j],
                ha="center",
                va="center",
                fontsize=8,
                color="white" if np.isfinite(grid[i, j]) and grid[i, j] > np.nanmean(grid) else "black",
            )
    marks = ((verdict.best_clipped, "red", "best clipped"), (verdict.match, "orange", "best unclipped, lower LR"))
    for cell, colour, label in marks:
        if cell is not None:
            ax.add_patch(
                plt.Rectangle(
                    (lrs.index(cell.lr) - 0.5, taus.index(cell.tau) - 0.5),
                    1,
                    1,
                    fill=False,
                    edgecolor=colour,
                    lw=2.5,
                    label=label,
                )
            )
    tau_labels = []
    for t in taus:
        v = cells.loc[cells["tau"] == t, "max_norm"].iloc[0]
        tau_labels.append("none" if t == NONE else f"{t} = {v:.3g}")
    ax.set_xticks(range(len(lrs)), [f"{x:.3g}" for x in lrs])
    ax.set_yticks(range(len(taus)), tau_labels)
    ax.set_xlabel("optim.lr")
    ax.set_ylabel("clip.max_norm τ")
    fig.colorbar(im, ax=ax, label="eval loss (mean over seeds)")
    legend(ax, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=7)
    ax.set_title((title + "\n" if title else "") + verdict.kind, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
