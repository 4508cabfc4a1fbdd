"""Cost of the default ``+experiment=calibrate``: whole-process CPU seconds, split into start-up and per step.

    python bench/bench_calibrate.py [--runs 2] [--steps 500] [--threads N] [--baseline DIR] [-- OVERRIDE ...]

Arms, run interleaved (one of each per round) in one temporary folder whose MLflow store a first
``steps=2`` run creates:
  now             ``python -m sweep +experiment=calibrate`` from this checkout;
  attention=sdpa  the same with ``model.attention=sdpa`` (the GPT's fused attention kernel on CPU too);
  baseline        (``--baseline DIR``) the same command from another checkout, e.g. an older commit
                  (``git worktree add /tmp/base COMMIT``), so before and after share the machine's state.
Per arm it also runs ``+experiment=train steps=2`` (same model and data: the start-up, i.e. imports,
config, the corpus, the model, the store, the report) and prints
``per step = (calibrate - start-up) / steps``. Figures are user + system CPU seconds of the child
(``getrusage``), steadier than wall time on a shared machine; medians over rounds. ``--threads N`` sets
``OMP_NUM_THREADS`` (torch's intra-op threads) for every run: with other jobs on the cores, one thread
keeps spinning threads out of the CPU figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when run by path from elsewhere

from bench_startup import cpu_seconds as child_seconds

CALIBRATE = ["-m", "sweep", "+experiment=calibrate"]
STARTUP = ["-m", "sweep", "+experiment=train", "steps=2"]


def cpu_seconds(args: list[str], cwd: str, repo: str, threads: int | None = None) -> float:
    """CPU seconds of one child run from checkout ``repo`` (``threads``: its ``OMP_NUM_THREADS``)."""
    env = {**os.environ, "PYTHONPATH": repo, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    return child_seconds(args, cwd, env)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="rounds")
    ap.add_argument("--steps", type=int, default=500, help="the calibrate's steps (its default: 500)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every run (default: torch's own choice)")
    ap.add_argument("--baseline", help="another checkout to run the same commands from")
    ap.add_argument("overrides", nargs="*", help="extra overrides for every run (after --)")
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    arms = {"now": (repo, []), "attention=sdpa": (repo, ["model.attention=sdpa"])}
    if args.baseline:
        arms["baseline"] = (os.path.abspath(args.baseline), [])
    extra = [f"steps={args.steps}", *args.overrides]
    total: dict[str, list[float]] = {a: [] for a in arms}
    start: dict[str, list[float]] = {a: [] for a in arms}
    with tempfile.TemporaryDirectory() as folder:
        cpu_seconds(STARTUP, folder, repo)  # creates the store: every arm then opens an existing one
        for _ in range(args.runs):
            for arm, (where, own) in arms.items():
                total[arm].append(cpu_seconds([*CALIBRATE, *extra, *own], folder, where, args.threads))
                start[arm].append(cpu_seconds([*STARTUP, *args.overrides, *own], folder, where, args.threads))
    threads = f", OMP_NUM_THREADS={args.threads}" if args.threads else ""
    print(f"+experiment=calibrate steps={args.steps}{threads}, CPU seconds (median of {args.runs} rounds)")
    print(f"{'arm':16} {'total':>8} {'start-up':>9} {'per step':>9} {'total / now':>12}")
    now = statistics.median(total["now"])
    for arm in arms:
        t, s = statistics.median(total[arm]), statistics.median(start[arm])
        print(f"{arm:16} {t:8.1f} {s:9.2f} {(t - s) / args.steps:9.4f} {t / now:11.2f}x")


if __name__ == "__main__":
    main()
