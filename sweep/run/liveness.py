"""Is a sweep worker alive? On its own host its lock says so at once.

A worker holds ``run.lock`` beside its parent run's checkpoint folder for its whole life (``filelock``:
an ``flock`` the OS releases when the process dies, SIGKILL included); its parent run carries the lock's
host and path (tags ``worker_host``, ``worker_lock``). The recovery (``sweep.experiments.study.workers``)
and whatever reports a study's trials (a worker's last line, ``python -m sweep.report``) ask the lock
the same way, so that a trial whose worker is provably dead is never called running.
"""

from __future__ import annotations

import socket
from pathlib import Path

DIED = "DIED"  # a trial's state in the tables: RUNNING in the study, but its worker of this host is dead


def lock_says(tags: dict[str, str] | None) -> bool | None:
    """Is the worker alive? True: it ran on this host and holds its lock; False: on this host with its lock
    free (the OS released it: the process is gone); None: this host cannot tell (another host, no lock)."""
    from filelock import FileLock, Timeout

    tags = tags or {}
    path = tags.get("worker_lock")
    if tags.get("worker_host") != socket.gethostname() or not path or not Path(path).exists():
        return None
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    lock.release()
    return False


def trial_state(state: str, worker_tags: dict[str, str] | None) -> str:
    """A trial's state for a table: DIED where the study says RUNNING but its worker's lock says dead."""
    return DIED if state == "RUNNING" and lock_says(worker_tags) is False else state


def died_line(numbers: list[int]) -> str:
    """What to do about the trials whose worker died: the next run of the sweep recovers them."""
    n = len(numbers)
    which = f"trial {numbers[0]}" if n == 1 else f"trials {', '.join(map(str, numbers))}"
    return (
        f"{n} trial{'s' if n > 1 else ''} whose worker died ({which}): re-run the sweep command to recover "
        f"{'it' if n == 1 else 'them'} (marked FAIL, {'its' if n == 1 else 'their'} parameters run again)"
    )
