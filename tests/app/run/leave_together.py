"""Run under ``torchrun --nproc_per_node=2``: ``Launch.run`` on two gloo ranks, rank 0 slower.

``python leave_together.py OUT MODE``: MODE ``ok`` (rank 0's work takes 3 s longer) or ``fail`` (rank
0's work raises after 3 s). Each rank writes ``OUT/rank-N.txt``: when its work ended and when
``Launch.run`` returned (``time.time()``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from sweep.distributed.launch import start
from sweep.distributed.rank_exit import run_then_leave


def main(out: Path, mode: str) -> None:
    launch = start("ddp", "train", 4, "cpu", 60.0)
    ended = [0.0]

    def work() -> str:
        if launch.is_main:
            time.sleep(3)
            if mode == "fail":
                ended[0] = time.time()
                raise RuntimeError("rank 0 failed in its end-of-run phase")
        ended[0] = time.time()
        return "done"

    try:
        launch.run(work)
    finally:
        (out / f"rank-{launch.rank}.txt").write_text(f"{ended[0]} {time.time()}")


if __name__ == "__main__":
    run_then_leave(lambda: main(Path(sys.argv[1]), sys.argv[2]))  # as the app's ranks end
