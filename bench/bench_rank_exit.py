"""How often a finished gloo rank aborts at exit, with and without interpreter teardown.

Each trial starts two processes that form a gloo group, run DDP steps on a small MLP, meet at a
barrier and call ``destroy_process_group``; rank 0 then stays alive a moment longer, as rank 0 of
the app does while it ends its run. Arm ``teardown`` lets Python exit as usual; arm ``leave`` ends
through ``sweep.distributed.rank_exit.run_then_leave``, as the app's ranks do. The arms alternate,
so both see the same machine load. Nothing of clipamp runs in the ``teardown`` arm.

    python bench/bench_rank_exit.py --trials 50
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(arm: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    def work() -> None:
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)))
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(20):
            model(torch.randn(8, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            time.sleep(1.0)

    if arm == "leave":
        from sweep.distributed.rank_exit import run_then_leave

        run_then_leave(work)
    work()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(arm: str) -> list[str]:
    """The two ranks' outcomes: ``ok``, or the status and the first stderr line of a failed rank."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, __file__, "--worker", arm]
    procs = [
        subprocess.Popen(cmd, env={**env, "RANK": str(r)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    outcomes = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        first = next(iter(err.splitlines()), "")
        outcomes.append("ok" if p.returncode == 0 else f"exit {p.returncode}: {first}")
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50, help="trials per arm (default 50)")
    parser.add_argument("--worker", choices=["teardown", "leave"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    failed: dict[str, list[str]] = {"teardown": [], "leave": []}
    for i in range(args.trials):
        for arm in failed:
            failed[arm] += [f"trial {i + 1} rank {r}: {o}" for r, o in enumerate(trial(arm)) if o != "ok"]
    for arm, lines in failed.items():
        print(f"{arm:9s} {len(lines)} failed ranks in {2 * args.trials}")
        for line in lines:
            print(f"  {line}")


if __name__ == "__main__":
    main()
