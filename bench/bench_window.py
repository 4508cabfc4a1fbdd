"""Window efficiency: τ from a 50-step calibration window vs a 500-step one, on the default task.

    python bench/bench_window.py [--steps 620] [--seeds 0] [--short 50] [--long 500] [--quantile 0.95]
                                 [--csv steps.csv ...] [--figure PATH] [--keep]

Trains the default task (``+experiment=train clip=none``: no clipping, so every window measures the
same unclipped trace) for ``--steps`` steps, or reads an existing ``steps.csv``. Both windows start
where ``calibrate.start=auto`` would put them (``clipamp_engine.placement``); a window from step 1
(``calibrate.start=0``) is shown for contrast. Prints τ = Quantile_q of each window with its
order-statistic 95% interval and the ratio τ(50)/τ(500) (goal: within 15%). When the goal is missed
it says why: drift (the two halves of the 500-step window have separate τ intervals, the rule
``CalibratedClip.drift`` applies to windows) or noise (the short window's interval is wide; with the
window length a ±15% interval would need). With several ``--seeds`` (the run's ``seed=``:
initialisation and batch order) or ``--csv`` traces and several ``--short`` lengths it ends with
each length's ratios across traces; the figure is the first trace's, for the first length. The
training runs' folder (``clipamp-window-*`` in the temp folder) is removed at the end, failed runs
included, unless ``--keep`` is given.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clipamp_engine.calibration import DEFAULT_QUANTILE, min_window, quantile_ci, quantile_label, window_for_width  # noqa: E402
from clipamp_engine.placement import auto_window_start  # noqa: E402


def train_trace(steps: int, workdir: Path, seed: int = 0) -> Path:
    """Run the default task without clipping; return its steps.csv."""
    cmd = [
        sys.executable,
        "-m",
        "sweep",
        "+experiment=train",
        "clip=none",
        f"steps={steps}",
        f"seed={seed}",
        "progress=false",
        "tracking.plots=false",
        f"tracking.uri=sqlite:///{workdir}/mlflow.db",
        "checkpoint_every=0",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, check=True).stdout
    return Path(re.search(r"steps\.csv: (\S+)", out).group(1))


def read_trace(path: Path) -> list[tuple[int, float, float]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [
        (int(r["step"]), float(r["lr"]), float(r["grad_l2_pre_clip"]) if r["skipped"] != "True" else math.inf)
        for r in rows
    ]


def window_ci(trace, start: int, length: int, q: float):
    norms = [n for s, _, n in trace if start <= s < start + length and math.isfinite(n)]
    if len(norms) < length * 0.9:
        raise SystemExit(
            f"error: the trace has {len(trace)} steps; a {length}-step window from step {start} "
            f"needs ≥ {start + length - 1}: raise --steps"
        )
    return quantile_ci(norms, q)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=620)
    ap.add_argument("--csv", type=Path, nargs="+", default=None, help="reuse these steps.csv instead of training")
    ap.add_argument("--quantile", type=float, default=DEFAULT_QUANTILE)
    ap.add_argument("--short", type=int, nargs="+", default=[50], help="short window length(s)")
    ap.add_argument("--long", type=int, default=500)
    ap.add_argument("--figure", type=Path, default=None, help="drawn for the first trace and short length")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="one trace per seed (ignored with --csv)")
    ap.add_argument("--keep", action="store_true", help="keep the training runs' folder (steps.csv, MLflow store)")
    args = ap.parse_args(argv)
    if args.csv is not None:
        return compare(args)
    work = Path(tempfile.mkdtemp(prefix="clipamp-window-"))
    try:
        args.csv = [train_trace(args.steps, work, seed) for seed in args.seeds]
        return compare(args)
    finally:
        if args.keep:
            print(f"\ntraining runs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def compare(args) -> int:
    """Each trace's windows (:func:`measure`), then each short length's ratios across the traces."""
    ratios: dict[int, list[float]] = {n: [] for n in args.short}
    for i, path in enumerate(args.csv):
        print(f"\ntrace {i + 1} of {len(args.csv)}: {path}")
        trace = read_trace(path)
        for j, n in enumerate(args.short):
            ratios[n].append(measure(trace, n, args, args.figure if i == j == 0 else None))
    if len(args.csv) > 1:
        print()
        for n, rs in ratios.items():
            inside = sum(abs(r - 1) <= 0.15 for r in rs)
            print(
                f"τ({n}) / τ({args.long}) over {len(rs)} traces: "
                + ", ".join(f"{r:.3f}" for r in rs)
                + f"; {inside} of {len(rs)} within 15%"
            )
    return 0


def measure(trace, short_len: int, args, figure: Path | None) -> float:
    """Print one trace's comparison (and draw it to ``figure``); return τ(short) / τ(long)."""
    placed = auto_window_start(trace, latest=len(trace) - args.long + 1)
    s = placed.start
    print(f"auto start: step {s} ({placed.rule}: {placed.reason})")
    q = args.quantile
    short, long_ = window_ci(trace, s, short_len, q), window_ci(trace, s, args.long, q)
    step1 = window_ci(trace, 1, short_len, q)
    ratio = short.estimate / long_.estimate
    for name, ci in (
        (f"{short_len} steps from {s}", short),
        (f"{args.long} steps from {s}", long_),
        (f"{short_len} steps from 1 (start=0)", step1),
    ):
        bounds = f"[{ci.low:.4g}, {ci.high:.4g}]" if ci.bounded else f"[{ci.low:.4g}, no upper bound]"
        print(f"τ={quantile_label(q)} of {name:28s}: {ci.estimate:.4g}  95% CI {bounds}  (n={ci.n})")
    ok = abs(ratio - 1) <= 0.15
    print(
        f"τ({short_len}) / τ({args.long}) = {ratio:.3f}: {'within' if ok else 'NOT within'} 15%"
        f" (start=0 instead: {step1.estimate / long_.estimate:.3f})"
    )
    pieces = [window_ci(trace, a, short_len, q) for a in range(s, s + args.long - short_len + 1, short_len)]
    print(f"τ of consecutive {short_len}-step windows: " + ", ".join(f"{p.estimate:.3g}" for p in pieces))
    half = args.long // 2
    first, second = window_ci(trace, s, half, q), window_ci(trace, s + half, half, q)
    if not ok:
        needed = window_for_width(long_.n, long_.rel_width, 0.30, minimum=1)  # the 1/√n law, down or up
        why = (
            f"drift: the {args.long}-step window's halves have separate intervals, τ {first.estimate:.3g} "
            f"[{first.low:.3g}, {first.high:.3g}] then {second.estimate:.3g} [{second.low:.3g}, {second.high:.3g}]"
            if not first.overlaps(second)
            else f"noise: the halves of the {args.long}-step window agree (their intervals overlap); "
            + (
                f"a {short_len}-step window's interval is {short.rel_width:.0%} wide"
                if short.bounded
                else f"{short_len} norms cannot bound {quantile_label(q)} from above (it needs ≥ {min_window(q)})"
            )
            + f"; a ±15% interval needs ≈ {needed} norms "
            f"(extrapolated from the {args.long}-step interval, {long_.rel_width:.0%} wide)"
        )
        print(f"why: {why}")
    if figure:
        plot(trace, s, short_len, args, short, long_, step1, pieces, figure)
        print(f"figure: {figure}")
    return ratio


def plot(trace, s, short_len, args, short, long_, step1, pieces, figure: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [t[0] for t in trace]
    norms = [t[2] for t in trace]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    a.semilogy(steps, norms, lw=0.7, color="0.3", label="pre-clip ‖g‖ (no clipping)")
    a.axvspan(s, s + args.long - 1, color="tab:blue", alpha=0.08, label=f"{args.long}-step window (auto start)")
    a.axvspan(s, s + short_len - 1, color="tab:orange", alpha=0.25, label=f"{short_len}-step window")
    a.axhline(long_.estimate, color="tab:blue", ls="--", lw=1, label=f"τ({args.long}) = {long_.estimate:.3g}")
    a.axhline(short.estimate, color="tab:orange", ls="--", lw=1, label=f"τ({short_len}) = {short.estimate:.3g}")
    a.axhline(
        step1.estimate, color="tab:red", ls=":", lw=1, label=f"τ, {short_len} steps from step 1 = {step1.estimate:.3g}"
    )
    a.set_xlabel("step")
    a.set_ylabel("‖g‖")
    a.legend(fontsize=7)
    xs = [s + i * short_len for i in range(len(pieces))]
    tops = [max(n for st, _, n in trace if a <= st < a + short_len and math.isfinite(n)) for a in xs]
    b.errorbar(
        xs,
        [p.estimate for p in pieces],
        yerr=[
            [p.estimate - p.low if math.isfinite(p.low) else 0 for p in pieces],
            [p.high - p.estimate if math.isfinite(p.high) else t - p.estimate for p, t in zip(pieces, tops)],
        ],
        fmt="o",
        color="tab:orange",
        capsize=3,
        label=f"τ of each {short_len}-step window, 95% CI\n(n < {min_window(args.quantile)}: no upper "
        f"bound; bar to the window max)",
    )
    b.axhspan(long_.low, long_.high, color="tab:blue", alpha=0.15, label=f"τ({args.long}) 95% CI")
    b.axhline(long_.estimate, color="tab:blue", ls="--", lw=1)
    b.set_xlabel("window start step")
    b.set_ylabel(f"τ = {quantile_label(args.quantile)}")
    b.legend(fontsize=6, loc="upper left")
    fig.suptitle(
        f"Window efficiency on the default task: τ({short_len}) / τ({args.long}) = "
        f"{short.estimate / long_.estimate:.2f}"
    )
    fig.tight_layout()
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
