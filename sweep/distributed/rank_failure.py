"""A rank that fails under torchrun: one line, printed once, by rank 0, with what the run kept.

A rank that raises records its failure in torchrun's key-value store (the c10d store the process
group was built on; it outlives the group) before it leaves; its peers' collectives then break
("Connection closed by peer"), and rank 0 reads the record to say which rank failed and why. A rank
that dies without a word (SIGKILL, the OOM killer) leaves no record: rank 0 names it from the
process ids every rank recorded at start (same host only) and the run ends KILLED, resumable from
its last checkpoint. A failing rank other than 0 prints the line itself only if rank 0's process is
gone (then torchrun's summary is the only other witness).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from sweep.errors import one_line


def peer_failed(e: BaseException) -> bool:
    """Whether ``e`` is a collective broken by another rank's exit (that rank's record says why)."""
    return (
        isinstance(e, dist.DistError)
        or timed_out(e)
        or any(s in str(e) for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))
    )


def timed_out(e: BaseException) -> bool:
    """Whether ``e`` is a collective that waited ``dist.timeout_s`` for a rank that never answered (gloo's
    "Timed out waiting …ms for recv", NCCL's watchdog): a peer that hangs or was stopped, not this rank."""
    return any(s in str(e) for s in ("Timed out waiting", "Watchdog caught collective operation timeout"))


class RankFailed(Exception):
    """A run under torchrun broke: ``rank`` (None: unknown) failed with ``cause`` (None: it died silently).

    ``status`` is the MLflow status the run ends with: FAILED for an error (a bug, as in one process),
    KILLED for a rank killed from outside (like SIGTERM: nothing wrong with the run itself).
    """

    def __init__(
        self, rank: int | None, world: int, cause: str | None, own: bool, store: Any = None, hung: str | None = None
    ) -> None:
        self.rank, self.world, self.cause, self.own, self.store = rank, world, cause, own, store
        self.hung = hung  # a collective timed out: the error this rank got while waiting
        self.suffix = ""  # rank 0: what the run kept and how to continue it
        super().__init__(self.line())

    @property
    def status(self) -> str:
        return "FAILED" if self.cause is not None or self.hung is not None else "KILLED"

    def line(self) -> str:
        if self.cause is not None:
            return f"rank {self.rank} of {self.world} failed: {self.cause}{self.suffix}"
        who = f"rank {self.rank}" if self.rank is not None else "another rank"
        if self.hung is not None:
            return (
                f"{who} of {self.world} stopped answering: a collective waited dist.timeout_s for it and timed out "
                f"({self.hung}); a hung or stopped process (a deadlock, SIGSTOP, a stuck filesystem){self.suffix}"
            )
        return (
            f"{who} of {self.world} died without an error (killed by a signal, e.g. the OOM killer; "
            f"torchrun's summary gives its exit code){self.suffix}"
        )

    def kept(self, last_step: int | None, checkpoint_step: int | None) -> RankFailed:
        """Rank 0: add how the run ended, the steps in steps.csv and the way to continue to the line."""
        rows = f"steps 1–{last_step}" if last_step else "no step"
        resume = (
            f"resume=true continues from the checkpoint at step {checkpoint_step}"
            if checkpoint_step
            else "no checkpoint was written yet (checkpoint_every=): start a new run"
        )
        self.suffix = f"; the run ended {self.status}, steps.csv keeps {rows}; {resume}"
        self.args = (self.line(),)
        return self

    def report(self, rank: int) -> str | None:
        """The line this process prints: rank 0's (recorded as ``reported`` in the store); a failing rank's
        own only when rank 0 is gone (same host) without having reported (every rank raising the same error:
        rank 0 prints and exits first); rank 1's when rank 0 itself died silently (no other rank records the
        run); None on the other ranks (their own gloo connections keep rank 0 waiting until they exit)."""
        if rank == 0:
            _store_call(self.store, "set", "reported", "0")
            return self.line()
        if self.own and _dead_rank(self.store, rank, [0]) == 0 and not _store_call(self.store, "check", ["reported"]):
            return self.line()
        if rank == 1 and self.rank == 0 and self.cause is None:
            return (
                f"rank 0 of {self.world} died without an error (killed by a signal, e.g. the OOM killer; "
                "torchrun's summary gives its exit code); it recorded the run, which stays RUNNING in MLflow: "
                "steps.csv keeps every step it wrote, resume=true continues from the last checkpoint"
            )
        return None


def register(store: Any, rank: int) -> None:
    """Record this rank's host and process id (read by rank 0 if the rank dies silently)."""
    store.set(f"pid/{rank}", f"{socket.gethostname()}:{os.getpid()}")


def diagnose(e: BaseException, store: Any, rank: int, world: int) -> RankFailed:
    """What broke the run, as this rank sees it; records this rank's own failure for the others.

    From here on SIGTERM (torchrun stopping the remaining ranks) no longer ends this process: it
    reports first (torchrun waits 30 s before SIGKILL).
    """
    _ignore_sigterm()
    if not peer_failed(e):
        _store_call(store, "set", f"failed/{rank}", one_line(e))
        return RankFailed(rank, world, one_line(e), own=True, store=store)
    for r in range(world):
        if r != rank and _store_call(store, "check", [f"failed/{r}"]):
            cause = _store_call(store, "get", f"failed/{r}")
            if cause:
                return RankFailed(r, world, cause.decode(), own=False, store=store)
    if timed_out(e):  # alive but silent: no process to find gone
        return RankFailed(None, world, None, own=False, store=store, hung=one_line(e, 160))
    return RankFailed(_dead_rank(store, rank, range(world)), world, None, own=False, store=store)


def _dead_rank(store: Any, rank: int, ranks: Iterable[int], wait_s: float = 3.0) -> int | None:
    """The first of ``ranks`` (other than ``rank``) on this host whose process is gone or exiting, else None.

    A killed process closes its sockets before it turns into a zombie: poll for ``wait_s`` seconds.
    """
    host, peers = socket.gethostname(), {}
    for r in ranks:
        record = _store_call(store, "get", f"pid/{r}") if r != rank else None
        if record:
            peer_host, pid = record.decode().rsplit(":", 1)
            if peer_host == host:
                peers[r] = int(pid)
    deadline = time.monotonic() + wait_s
    while peers:
        dead = [r for r, pid in peers.items() if not _alive(pid)]
        if dead or time.monotonic() > deadline:
            return dead[0] if dead else None
        time.sleep(0.05)
    return None


def _alive(pid: int) -> bool:
    """Linux: the process exists and is not a zombie; elsewhere assumed alive (the rank stays unnamed)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X", "x")
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except (OSError, IndexError):
        return True


def _store_call(store: Any, method: str, *args: Any) -> Any:
    """``store.method(*args)``, or None if the store is gone or the wait timed out (best effort)."""
    if store is None:
        return None
    try:
        out = getattr(store, method)(*args)
        return True if out is None else out
    except Exception:  # the store's host is gone, a wait timed out: report what we know
        return None


def _ignore_sigterm() -> None:
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread
        pass
