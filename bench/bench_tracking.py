"""Tracking overhead on the default task: the app's recorded loop vs bare ``AmpTrainState.step``.

    python bench/bench_tracking.py [--steps 60] [--rounds 4]

Both arms train the default byte-level GPT (bf16) on the same batches. The tracked arm is the
app's ``run_steps``: the canonical CSV row per step, per-step metrics buffered and sent to a
sqlite MLflow store with ``log_batch``, the in-memory records. Rounds alternate A/B; the figure is
the median of the per-round paired ratios (goal: overhead ≤ 5% of step time).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from mlflow import MlflowClient

from clipamp_engine import StepCSVWriter
from sweep.config.schema import Config
from sweep.run.build import build_state
from sweep.run.loop import APP_COLUMNS, RunRecords, run_steps
from sweep.tasks.build import build_task
from sweep.tracking.tracker import RunTracker, ensure_experiment


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    cfg = Config(run="train")
    torch.manual_seed(0)
    task = build_task(cfg.model, cfg.data, seed=0)
    batches = [next(task.train_batches) for _ in range(16)]
    state = build_state(cfg, task.model, task.loss_fn, total_steps=10**6)
    tmp = Path(tempfile.mkdtemp())
    uri = f"sqlite:///{tmp}/mlflow.db"
    client = MlflowClient(uri)
    exp = ensure_experiment(client, "bench", uri)

    def cycle():
        while True:
            yield from batches

    def bare(n: int) -> float:
        it = cycle()
        t = time.perf_counter()
        for _ in range(n):
            b = next(it)
            state.step(b.inputs, b.targets)
        return (time.perf_counter() - t) / n

    def tracked(n: int) -> float:
        tracker = RunTracker(client, exp, "bench", flush_every=cfg.tracking.flush_every)
        writer = StepCSVWriter(tracker.artifact_path("steps.csv"), APP_COLUMNS)
        start = state.step_count
        t = time.perf_counter()
        with writer:
            run_steps(
                state,
                cycle(),
                range(start + 1, start + n + 1),
                writer=writer,
                tracker=tracker,
                records=RunRecords(),
                progress=False,
            )
        elapsed = (time.perf_counter() - t) / n
        tracker.end()
        return elapsed

    bare(3), tracked(3)
    a, b = [], []
    for r in range(args.rounds):
        if r % 2 == 0:
            a.append(bare(args.steps)), b.append(tracked(args.steps))
        else:
            b.append(tracked(args.steps)), a.append(bare(args.steps))
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"default task: {task.description}, bf16, {args.rounds} rounds x {args.steps} steps")
    print(f"bare AmpTrainState.step : {ma * 1e3:7.2f} ms/step  ({', '.join(f'{x * 1e3:.1f}' for x in a)})")
    print(f"tracked (CSV + MLflow)  : {mb * 1e3:7.2f} ms/step  ({', '.join(f'{x * 1e3:.1f}' for x in b)})")
    paired = statistics.median(y / x for x, y in zip(a, b))  # each round's pair ran back to back
    print(
        f"tracking overhead: {(paired - 1) * 100:+.1f}% of step time, median of per-round pairs "
        f"(ratio of medians {(mb / ma - 1) * 100:+.1f}%; goal <= 5%)"
    )


if __name__ == "__main__":
    main()
