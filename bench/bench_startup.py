"""Start-up cost of a tiny run against a bare ``import torch``, as whole-process CPU time.

    python bench/bench_startup.py [--runs 5] [-- OVERRIDE ...]

Runs, interleaved so machine noise hits every arm, in a fresh temporary folder each round:
  (A) ``python -c "import torch"``;
  (F) the floor of any tracked PyTorch run: import torch and MLflow, build an AdamW (torch's optimizer
      imports ``torch._dynamo`` on its first ``add_param_group``) and open the folder's sqlite store;
  (B) ``python -m sweep +experiment=train steps=2 model=linear data=synthetic`` (plus overrides) in
      the fresh folder: it creates the MLflow store, trains two steps, writes its records and report;
  (N) the same run again in that folder: the store exists, as in every run after a folder's first.
Each figure is the user + system CPU seconds of the child process (``getrusage``), which on a shared
machine is steadier than wall time. Prints the medians and the ratios to (A) (goal <= 2.5) and to (F).
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
FLOOR = (
    "import torch, mlflow\n"
    "torch.optim.AdamW(torch.nn.Linear(8, 1).parameters())\n"
    "mlflow.MlflowClient('sqlite:///mlruns/mlflow.db').search_experiments()\n"
)


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
    ap.add_argument("--runs", type=int, default=5, help="rounds of the four arms")
    ap.add_argument("overrides", nargs="*", help="extra overrides for the run (after --)")
    args = ap.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    env.pop("MLFLOW_TRACKING_URI", None)
    cpu: dict[str, list[float]] = {"A": [], "F": [], "B": [], "N": []}
    wall: dict[str, list[float]] = {k: [] for k in cpu}
    run = [*RUN, *args.overrides]
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            for arm, argv, cwd in (
                ("A", ["-c", "import torch"], a),
                ("B", run, b),
                ("N", run, b),
                ("F", ["-c", FLOOR], b),
            ):
                c, w = cpu_seconds(argv, cwd, env)
                cpu[arm].append(c)
                wall[arm].append(w)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    wmed = {k: statistics.median(v) for k, v in wall.items()}
    print(f"(A) import torch:                      {med['A']:6.2f} s CPU (median of {args.runs})")
    print(f"(F) torch + AdamW + MLflow store open: {med['F']:6.2f} s CPU")
    print(f"(B) train steps=2, new folder:         {med['B']:6.2f} s CPU, {wmed['B']:6.2f} s wall")
    print(f"(N) train steps=2, store exists:       {med['N']:6.2f} s CPU, {wmed['N']:6.2f} s wall")
    print(f"ratio B / A: {med['B'] / med['A']:.2f}x   N / A: {med['N'] / med['A']:.2f}x (goal <= 2.5)")
    print(
        f"ratio F / A: {med['F'] / med['A']:.2f}x   N / F: {med['N'] / med['F']:.2f}x (what the app adds to the floor)"
    )


if __name__ == "__main__":
    main()
