"""A demo of the safe step: a small ``nn.Linear`` regression for 20 steps with an injected inf.

    python -m clipamp_engine.demo [--bf16] [--spike] [--csv PATH] [--max-skip-rate X]

One line per step, beginning ``STEP`` or ``SKIP``; at least one ``SKIP`` (the inf written into a
gradient at ``--inject-step``). ``--spike`` multiplies one batch's targets by 1e8 (a bad batch)
to show what clipping does with a finite spike. ``--csv`` replaces an earlier demo CSV
at that path. Exit 0, 1 when the skip rate over the last min(100, ``--steps``) steps exceeds
``--max-skip-rate`` (checked once that many steps have run), or 2 with one ``error:`` line for a
bad argument.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from .csvlog import CANONICAL_COLUMNS, StepCSVWriter
from .monitors import SkipRateExceeded, SkipRateMonitor
from .step import AmpTrainState


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m clipamp_engine.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--bf16", action="store_true", help="autocast to bf16 (no loss scaling) instead of fp16")
    p.add_argument("--spike", action="store_true", help="multiply the targets of one batch by 1e8")
    p.add_argument("--csv", metavar="PATH", help="write the canonical per-step CSV here")
    p.add_argument(
        "--max-skip-rate",
        type=float,
        metavar="X",
        help="fail when the skip rate over the last min(100, --steps) steps exceeds X",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--inject-step", type=int, help="step whose gradient gets an inf (default 5; 0: none)")
    p.add_argument("--spike-step", type=int, help="the batch --spike corrupts (default 12)")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p


def _line(log) -> str:
    tag = "SKIP" if log.skipped else "STEP"
    text = (
        f"{tag} {log.step:3d}  lr={log.lr:.2e}  pre={log.grad_l2_pre_clip:.4g}  "
        f"post={log.grad_l2_post_clip:.4g}  loss={log.loss:.4g}  scale={log.scaler_scale:g}"
    )
    return text + (f"  reason={log.skip_reason}" if log.skipped else ("  clipped" if log.clipped else ""))


def _check(args: argparse.Namespace) -> str | None:
    """The first bad argument as one line (what is allowed, the fix), else ``None``."""
    if args.steps < 1:
        return f"--steps {args.steps} must be >= 1, e.g. --steps 20"
    if not (math.isfinite(args.max_norm) and args.max_norm > 0):
        return f"--max-norm {args.max_norm} must be a finite number > 0, e.g. --max-norm 1.0"
    for flag, value, low in (("--inject-step", args.inject_step, 0), ("--spike-step", args.spike_step, 1)):
        if value is not None and not low <= value <= args.steps:  # a default past a short run is no fault
            return f"{flag} {value} must be in [{low}, --steps {args.steps}], or the run never reaches it"
    if args.max_skip_rate is not None and not 0.0 <= args.max_skip_rate <= 1.0:
        return f"--max-skip-rate {args.max_skip_rate} must be in [0, 1], e.g. --max-skip-rate 0.2"
    return None


def _open_csv(path: str) -> StepCSVWriter | str:
    """A fresh steps CSV at ``path`` (a previous demo CSV there is replaced), or the one-line error."""
    p = Path(path)
    try:
        if p.is_file() and p.stat().st_size:
            with open(p, encoding="utf-8", errors="replace") as f:
                header = f.readline().strip().split(",")
            if tuple(header[: len(CANONICAL_COLUMNS)]) != CANONICAL_COLUMNS:
                return f"--csv {path} exists and is not a clipamp steps CSV: pass a new path"
            p.unlink()
        return StepCSVWriter(p)
    except OSError as e:
        return f"--csv {path}: cannot write there ({e.strerror or type(e).__name__}): pass a path in a writable folder"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _check(args)
    writer = _open_csv(args.csv) if args.csv and problem is None else None
    if isinstance(writer, str):
        problem, writer = writer, None
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model = torch.nn.Linear(16, 1)
    true_w = torch.randn(16, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fail_window = min(100, args.steps)
    state = AmpTrainState(
        model,
        optimizer,
        F.mse_loss,
        dtype="bf16" if args.bf16 else "fp16",
        max_norm=args.max_norm,
        skip_monitor=SkipRateMonitor(fail_window=fail_window, fail_above=args.max_skip_rate),
    )
    inject_step = 5 if args.inject_step is None else args.inject_step
    spike_step = 12 if args.spike_step is None else args.spike_step
    pending = {}
    model.weight.register_hook(lambda g: g + pending.pop("inf") if "inf" in pending else g)
    try:
        for step in range(1, args.steps + 1):
            x = torch.randn(32, 16)
            y = x @ true_w + 0.1 * torch.randn(32, 1)
            if args.spike and step == spike_step:
                y = y * 1e8
            if step == inject_step:
                pending["inf"] = float("inf")
            try:
                log = state.step(x, y)
            except SkipRateExceeded as e:
                print(_line(e.record))
                writer and writer.write(e.record)
                print(f"FAIL {e}", file=sys.stderr)
                return 1
            print(_line(log))
            if writer:
                writer.write(log)
    finally:
        if writer:
            writer.close()
    m = state.skip_monitor.long
    print(
        f"done: {m.total} steps, {m.hits} skipped ({m.hits / m.total:.0%}), "
        f"clipped {state.clip_monitor.hits}, final scale {state.scaler.get_scale():g}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
