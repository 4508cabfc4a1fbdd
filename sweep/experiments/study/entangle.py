"""``+experiment=sweep study=entangle``: does a gain from clipping come from a smaller step (the LR)?

A practical rule: if changing max_grad_norm improves training, check whether the same improvement
comes from lowering the LR — clipping and the LR are entangled through the effective step length
(Zhang et al., "Why gradient clipping accelerates training", ICLR 2020). This study trains a grid of
``optim.lr`` × ``clip.max_norm`` (τ from a calibration window's quantiles, plus no clipping) over
``study.seeds`` seeds, every cell a child MLflow run of one parent, and answers in one line
(``entangle_verdict``):

1. the best clipped cell (lowest mean eval loss over seeds) at (lr*, τ*);
2. **gain**: is it better than the unclipped cell at the same lr* by more than the noise? If not,
   there is nothing to disentangle;
3. **match**: is it matched, within the noise, by an unclipped cell at a *lower* LR? Then clipping
   acts as a step-length cap — lower the LR instead. If no lower LR matches, the gain is more than
   a shorter step (spikes caught, Adam's moments protected).

Noise: the pooled within-cell standard deviation of the eval loss across seeds, s_p; two cell
means differ "beyond noise" when their gap exceeds 2·s_p·√(2/n) (about a 95% two-sample bound
with n seeds per cell).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd
import torch
from rich.console import Console

from sweep.config.convert import child_config, flat_params
from sweep.config.schema import ClipConfig, Config
from sweep.errors import UserError
from sweep.experiments.study.space import QUANTILE_KEYS, open_parent_run, window_quantiles
from sweep.report.entangle import NONE, plot_entangle
from sweep.report.format import ui_command
from sweep.run.artifacts import json_text
from sweep.run.pipeline import RunHooks, RunSpec, run_training
from sweep.tracking.tracker import RunTracker, Store, redact


@dataclass(frozen=True)
class Cell:
    lr: float
    tau: str  # "none" or an anchor quantile name (p50, p90, …)
    max_norm: float  # NaN for "none"
    mean: float
    sd: float
    n: int


@dataclass(frozen=True)
class Verdict:
    kind: str  # step-length-cap | more-than-step | no-gain | unclipped-best | undecided
    line: str
    noise: float  # 2·s_p·√(2/n): the gap two cell means need to differ
    best_clipped: Cell | None
    same_lr_unclipped: Cell | None
    match: Cell | None  # the best unclipped cell at a lower LR

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def cell_table(df: pd.DataFrame) -> pd.DataFrame:
    """Mean, SD and count of ``eval_loss`` per (lr, tau) over seeds (finite losses only)."""
    import numpy as np

    ok = df[np.isfinite(df["eval_loss"].astype(float))]
    g = ok.groupby(["lr", "tau"], sort=True)
    out = g["eval_loss"].agg(["mean", "std", "count"]).reset_index()
    out["max_norm"] = g["max_norm"].first().values
    return out.rename(columns={"std": "sd", "count": "n"})


def _cell(row) -> Cell:
    sd = float(row["sd"]) if math.isfinite(float(row["sd"])) else math.nan
    return Cell(float(row["lr"]), str(row["tau"]), float(row["max_norm"]), float(row["mean"]), sd, int(row["n"]))


def entangle_verdict(df: pd.DataFrame) -> Verdict:
    """The one-line answer of the module docstring from trials with lr, tau, max_norm, seed, eval_loss."""
    cells = cell_table(df)
    if cells.empty:
        return Verdict("undecided", "no completed trial: no verdict", math.nan, None, None, None)
    var = cells.loc[cells["n"] > 1, "sd"] ** 2
    n = max(1, int(cells["n"].min()))
    noise = 2 * math.sqrt(var.mean()) * math.sqrt(2 / n) if len(var) else math.nan
    clipped, free = cells[cells["tau"] != NONE], cells[cells["tau"] == NONE]
    if clipped.empty or free.empty:
        return Verdict("undecided", "the grid needs clipped and unclipped cells", noise, None, None, None)
    best = _cell(clipped.sort_values(["mean", "lr"]).iloc[0])
    overall = _cell(cells.sort_values(["mean", "lr"]).iloc[0])
    same = free[free["lr"] == best.lr]
    same_cell = _cell(same.iloc[0]) if len(same) else None
    lower = free[free["lr"] < best.lr]
    match = _cell(lower.sort_values("mean").iloc[0]) if len(lower) else None
    where = f"clipped best lr={best.lr:.3g} τ={best.tau} ({best.max_norm:.3g}): eval {best.mean:.4f}"

    def verdict(kind: str, line: str, lower: Cell | None = match) -> Verdict:
        return Verdict(kind, line, noise, best, same_cell, lower)

    if not math.isfinite(noise):  # one seed per cell: no gap can be told from seed noise
        return verdict(
            "undecided",
            f"{where}; best cell lr={overall.lr:.3g} τ={overall.tau} ({overall.mean:.4f}); with 1 seed per "
            f"cell the noise between seeds is unknown: pass study.seeds=2 or more for a verdict",
        )
    noise_txt = f"noise ±{noise:.4f} ({n} seeds)"
    if overall.tau == NONE and best.mean - overall.mean > noise:
        return verdict(
            "unclipped-best",
            f"no clipping needed: the best cell is unclipped (lr={overall.lr:.3g}, eval "
            f"{overall.mean:.4f}) and beats the {where} beyond {noise_txt}",
        )
    if same_cell is not None and same_cell.mean - best.mean <= noise:
        return verdict(
            "no-gain",
            f"no gain from clipping beyond noise: {where} vs unclipped at the same lr "
            f"{same_cell.mean:.4f} ({noise_txt})",
        )
    if match is None:
        return verdict(
            "undecided", f"{where}; no unclipped run at a lower LR in the grid: add a smaller study.lr_factors", None
        )
    gap = match.mean - best.mean
    if gap <= noise:
        return verdict(
            "step-length-cap",
            f"clipping acts as a step-length cap: unclipped lr={match.lr:.3g} reaches "
            f"{match.mean:.4f}, matching the {where} (gap {gap:+.4f} within {noise_txt}): lower the LR "
            f"instead of clipping",
        )
    return verdict(
        "more-than-step",
        f"clipping does more than shorten the step: the {where} beats every unclipped "
        f"lower LR (best lr={match.lr:.3g}: {match.mean:.4f}, gap {gap:+.4f} > {noise_txt})",
    )


# ---------------------------------------------------------------- the study


def entangle_grid(cfg: Config, anchor: dict[str, float]) -> list[tuple[float, str, float, int]]:
    """(lr, tau name, max_norm, seed) for every cell × seed: unclipped first, then τ from high to low."""
    s = cfg.study
    taus = [(NONE, math.nan)] + sorted(((k, anchor[k]) for k in s.entangle_quantiles), key=lambda kv: -kv[1])
    return [(cfg.optim.lr * f, t, m, cfg.seed + k) for f in s.lr_factors for t, m in taus for k in range(s.seeds)]


def check_entangle(cfg: Config) -> None:
    """``study=entangle`` options; ``UserError`` naming the value and the fix."""
    s = cfg.study
    if not s.lr_factors or any(not f > 0 for f in s.lr_factors) or len(set(s.lr_factors)) != len(s.lr_factors):
        raise UserError(
            f"study.lr_factors={list(s.lr_factors)} must be distinct factors > 0 of optim.lr, e.g. [0.5,1.0,2.0]"
        )
    bad = [q for q in s.entangle_quantiles if q not in QUANTILE_KEYS]
    if not s.entangle_quantiles or bad:
        raise UserError(
            f"study.entangle_quantiles={list(s.entangle_quantiles)} must name window quantiles among "
            f"{', '.join(QUANTILE_KEYS)}, e.g. [p90,p50]"
        )
    if s.seeds < 1:
        raise UserError(f"study.seeds={s.seeds} must be >= 1 (2 or more to measure the noise)")


def _trial(
    cfg: Config, store: Store, parent: RunTracker, lr: float, tau: str, max_norm: float, seed: int
) -> dict[str, Any]:
    c = child_config(cfg, seed=seed)
    c.optim.lr = lr
    c.clip = ClipConfig(mode="none") if math.isnan(max_norm) else ClipConfig(mode="norm", max_norm=max_norm)
    spec = RunSpec(
        f"entangle-lr{lr:.3g}-{tau}-seed{seed}",
        parent_run_id=parent.run_id,
        tags={"sweep_role": "entangle_trial", "lr": f"{lr:.6g}", "tau": tau},
    )
    m = run_training(c, store, spec, RunHooks(announce=lambda line: None)).metrics
    return {
        "lr": lr,
        "tau": tau,
        "max_norm": max_norm,
        "seed": seed,
        "eval_loss": m["eval_loss"],
        "clip_ratio": m["clip_ratio"],
        "final_loss": m["final_loss"],
    }


def _log_parent(parent: RunTracker, cfg: Config, df: pd.DataFrame, verdict: Verdict, anchor: dict, wall: float) -> None:
    cells = cell_table(df)
    df.to_csv(parent.artifact_path("trials.csv"), index=False)
    cells.to_csv(parent.artifact_path("cells.csv"), index=False)
    parent.artifact_path("verdict.json").write_text(
        json_text({**verdict.as_dict(), "anchor": anchor, "rule": __doc__.split("answers in one line")[1].strip()})
    )
    plot_entangle(
        cells,
        verdict,
        parent.artifact_path("plots/entangle.png"),
        title=f"{cfg.model.name} on {cfg.data.name}, {cfg.steps} steps, {cfg.study.seeds} seeds",
    )
    metrics = {"entangle_noise": verdict.noise, "wall_s": wall}
    if verdict.best_clipped:
        metrics["best_clipped_eval_loss"] = verdict.best_clipped.mean
    if verdict.match:
        metrics["lower_lr_eval_loss"] = verdict.match.mean
    parent.log_metrics(metrics, step=len(df))
    parent.set_tags({"entangle_verdict": verdict.kind, "entangle_line": verdict.line})


def run_entangle(cfg: Config, store: Store, console: Console | None = None) -> Verdict:
    """The anchor window, the grid of child runs, then the verdict, tables and figure in the parent run."""
    console = console or Console()
    check_entangle(cfg)
    parent = open_parent_run(
        cfg, store, f"entangle-{cfg.model.name}-{cfg.steps}steps", "entangle", study_mode="entangle"
    )
    threads, t0 = torch.get_num_threads(), time.perf_counter()
    try:
        with parent:  # FINISHED, KILLED by Ctrl-C / SIGTERM (as the child that was training), else FAILED
            if cfg.study.threads:
                torch.set_num_threads(cfg.study.threads)
            parent.log_params(flat_params(cfg))
            anchor, _ = window_quantiles(cfg, "entangle", store, parent.run_id, console.print, None)
            grid = entangle_grid(cfg, anchor)
            rows = []
            for i, cell in enumerate(grid, start=1):
                rows.append(_trial(cfg, store, parent, *cell))
                r = rows[-1]
                console.print(
                    f"[{i}/{len(grid)}] lr={r['lr']:.3g} τ={r['tau']} seed {r['seed']}: eval "
                    f"{r['eval_loss']:.4f}, clipped {r['clip_ratio']:.0%}"
                )
            df = pd.DataFrame(rows)
            verdict = entangle_verdict(df)
            _log_parent(parent, cfg, df, verdict, anchor, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    console.print(f"[bold]LR check:[/] {verdict.line}")
    console.print(
        f"{len(grid)} runs in {time.perf_counter() - t0:.0f} s; MLflow parent run {parent.run_id}: "
        f"{ui_command(redact(store.uri), store.experiment_id)}"
    )
    return verdict
