"""Window efficiency: τ from a 50-step calibration window vs a 500-step one, on the default task.

    python bench/bench_window.py [--steps 600] [--csv steps.csv] [--figure docs/window_efficiency.png]

Trains the default task (``+experiment=train clip=none``: no clipping, so every window measures the
same unclipped trace) for ``--steps`` steps, or reads an existing ``steps.csv``. Both windows start
where ``calibrate.start=auto`` would put them (``clipamp_engine.placement``); a window from step 1
(``calibrate.start=0``) is shown for contrast. Prints τ = Quantile_q of each window with its
order-statistic 95% interval and the ratio τ(50)/τ(500) (goal: within 15%). When the goal is missed
it says why: the τ of consecutive 50-step windows across the 500 (drift shows as a trend that
their intervals cannot explain).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clipamp_engine.calibration import min_window, quantile_ci  # noqa: E402
from clipamp_engine.placement import auto_window_start  # noqa: E402


def train_trace(steps: int, workdir: Path) -> Path:
    """Run the default task without clipping; return its steps.csv."""
    cmd = [sys.executable, "-m", "sweep", "+experiment=train", "clip=none", f"steps={steps}", "progress=false",
           "tracking.plots=false", f"tracking.uri=sqlite:///{workdir}/mlflow.db", "checkpoint_every=0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, check=True).stdout
    return Path(re.search(r"steps\.csv: (\S+)", out).group(1))


def read_trace(path: Path) -> list[tuple[int, float, float]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return [(int(r["step"]), float(r["lr"]),
             float(r["grad_l2_pre_clip"]) if r["skipped"] != "True" else math.inf) for r in rows]


def window_ci(trace, start: int, length: int, q: float):
    norms = [n for s, _, n in trace if start <= s < start + length and math.isfinite(n)]
    if len(norms) < length * 0.9:
        raise SystemExit(f"error: the trace has {len(trace)} steps; a {length}-step window from step {start} "
                         f"needs ≥ {start + length - 1}: raise --steps")
    return quantile_ci(norms, q)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--csv", type=Path, default=None, help="reuse this steps.csv instead of training")
    ap.add_argument("--quantile", type=float, default=0.95)
    ap.add_argument("--short", type=int, default=50)
    ap.add_argument("--long", type=int, default=500)
    ap.add_argument("--figure", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.csv is None:
        work = Path(tempfile.mkdtemp(prefix="clipamp-window-"))
        args.csv = train_trace(args.steps, work)
        print(f"trace: {args.csv}")
    trace = read_trace(args.csv)
    placed = auto_window_start(trace, latest=len(trace) - args.long + 1)
    s = placed.start
    print(f"auto start: step {s} ({placed.rule}: {placed.reason})")
    q = args.quantile
    short, long_ = window_ci(trace, s, args.short, q), window_ci(trace, s, args.long, q)
    step1 = window_ci(trace, 1, args.short, q)
    ratio = short.estimate / long_.estimate
    for name, ci in ((f"{args.short} steps from {s}", short), (f"{args.long} steps from {s}", long_),
                     (f"{args.short} steps from 1 (start=0)", step1)):
        bounds = f"[{ci.low:.4g}, {ci.high:.4g}]" if ci.bounded else f"[{ci.low:.4g}, no upper bound]"
        print(f"τ=p{q * 100:g} of {name:28s}: {ci.estimate:.4g}  95% CI {bounds}  (n={ci.n})")
    ok = abs(ratio - 1) <= 0.15
    print(f"τ({args.short}) / τ({args.long}) = {ratio:.3f}: {'within' if ok else 'NOT within'} 15%"
          f" (start=0 instead: {step1.estimate / long_.estimate:.3f})")
    pieces = [window_ci(trace, a, args.short, q) for a in range(s, s + args.long - args.short + 1, args.short)]
    separated = [i for i, p in enumerate(pieces) if not p.overlaps(long_)]
    print(f"τ of consecutive {args.short}-step windows: " + ", ".join(f"{p.estimate:.3g}" for p in pieces))
    if not ok:
        why = (f"drift: {len(separated)} of {len(pieces)} consecutive {args.short}-step windows have intervals "
               f"that exclude the {args.long}-step τ" if separated else
               f"noise: every {args.short}-step window's interval holds the {args.long}-step τ; a "
               f"{args.short}-step window is too short for p{q * 100:g} (interval width {short.rel_width:.0%})")
        print(f"why: {why}")
    if args.figure:
        plot(trace, s, args, short, long_, step1, pieces)
        print(f"figure: {args.figure}")
    return 0


def plot(trace, s, args, short, long_, step1, pieces) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [t[0] for t in trace]
    norms = [t[2] for t in trace]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 2]})
    a.semilogy(steps, norms, lw=0.7, color="0.3", label="pre-clip ‖g‖ (no clipping)")
    a.axvspan(s, s + args.long - 1, color="tab:blue", alpha=0.08, label=f"{args.long}-step window (auto start)")
    a.axvspan(s, s + args.short - 1, color="tab:orange", alpha=0.25, label=f"{args.short}-step window")
    a.axhline(long_.estimate, color="tab:blue", ls="--", lw=1, label=f"τ({args.long}) = {long_.estimate:.3g}")
    a.axhline(short.estimate, color="tab:orange", ls="--", lw=1, label=f"τ({args.short}) = {short.estimate:.3g}")
    a.axhline(step1.estimate, color="tab:red", ls=":", lw=1, label=f"τ, {args.short} steps from step 1 = {step1.estimate:.3g}")
    a.set_xlabel("step")
    a.set_ylabel("‖g‖")
    a.legend(fontsize=7)
    xs = [s + i * args.short for i in range(len(pieces))]
    tops = [max(n for st, _, n in trace if a <= st < a + args.short and math.isfinite(n)) for a in xs]
    b.errorbar(xs, [p.estimate for p in pieces],
               yerr=[[p.estimate - p.low if math.isfinite(p.low) else 0 for p in pieces],
                     [p.high - p.estimate if math.isfinite(p.high) else t - p.estimate for p, t in zip(pieces, tops)]],
               fmt="o", color="tab:orange", capsize=3,
               label=f"τ of each {args.short}-step window, 95% CI\n(n < {min_window(args.quantile)}: no upper "
                     f"bound; bar to the window max)")
    b.axhspan(long_.low, long_.high, color="tab:blue", alpha=0.15, label=f"τ({args.long}) 95% CI")
    b.axhline(long_.estimate, color="tab:blue", ls="--", lw=1)
    b.set_xlabel("window start step")
    b.set_ylabel(f"τ = p{args.quantile * 100:g}")
    b.legend(fontsize=6, loc="upper left")
    fig.suptitle(f"Window efficiency on the default task: τ({args.short}) / τ({args.long}) = "
                 f"{short.estimate / long_.estimate:.2f}")
    fig.tight_layout()
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.figure, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
