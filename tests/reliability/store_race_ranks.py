"""Run under ``torchrun``: every rank opens the same fresh sqlite store at once (a gloo barrier
releases them together), once per folder ``ROOT/rep<i>``, and logs one run in it; each rank writes
its outcomes to ``ROOT/outcomes-<rank>.json``. ``--without-lock`` is the control: the store is left
to MLflow to create, as before the one store-opening path existed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from sweep.distributed.rank_exit import run_then_leave
from sweep.tracking import store as store_module
from tests.reliability.helpers import open_and_log


def main(root: Path, reps: int, without_lock: bool) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if without_lock:
        store_module.prepare_sqlite = lambda uri, db: db.parent.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for i in range(reps):
        dist.barrier()
        try:
            open_and_log(f"sqlite:///{root}/rep{i}/mlruns/mlflow.db", f"rank{rank}")
            outcomes.append("ok")
        except BaseException as e:  # every failure is the test's finding
            outcomes.append(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    (root / f"outcomes-{rank}.json").write_text(json.dumps(outcomes))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # as the app's ranks end
    run_then_leave(lambda: main(Path(sys.argv[1]), int(sys.argv[2]), "--without-lock" in sys.argv))
