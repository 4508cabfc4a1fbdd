"""Start-up cost of a tiny run against a bare ``import torch``, as whole-process CPU time.

    python bench/bench_startup.py [--runs 5] [-- OVERRIDE ...]

Runs, interleaved (A B A B ...) so machine noise hits both, in a fresh temporary folder each:
  (A) ``python -c "import torch"``
  (B) ``python -m sweep +experiment=train steps=2 model=linear data=synthetic`` (plus overrides),
      a run that opens the default MLflow store, trains two steps and writes its records.
Each figure is the user + system CPU seconds of the child process (``getrusage``), which on a
shared machine is steadier than wall time. Prints the medians and the ratio B / A (goal <= 2.5).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

RUN = ["-m", "sweep", "+experiment=train", "steps=2", "model=linear", "data=synthetic"]


def cpu_seconds(args: list[str], cwd: str, env: dict[str, str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=cwd, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="pairs of runs")
    ap.add_argument("overrides", nargs="*", help="extra overrides for the run (after --)")
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    env.pop("MLFLOW_TRACKING_URI", None)
    torch_cpu, run_cpu, run_wall = [], [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            torch_cpu.append(cpu_seconds(["-c", "import torch"], a, env)[0])
            cpu, wall = cpu_seconds([*RUN, *args.overrides], b, env)
            run_cpu.append(cpu)
            run_wall.append(wall)
    t, r = statistics.median(torch_cpu), statistics.median(run_cpu)
    print(f"import torch:           {t:6.2f} s CPU (median of {args.runs})")
    print(f"train steps=2 (linear): {r:6.2f} s CPU, {statistics.median(run_wall):6.2f} s wall")
    print(f"ratio run / import torch: {r / t:.2f}x (goal <= 2.5)")


if __name__ == "__main__":
    main()
