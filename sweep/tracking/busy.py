"""A sqlite store another process holds locked: one line naming it, not a traceback or a wrong fix.

SQLite lets one writer at a time. MLflow's sessions wait ``LOCK_WAIT_S`` (its ``PRAGMA busy_timeout``)
for a lock another process holds (a `sqlite3` shell with an open transaction, a backup, another
program's long write), then raise "database is locked": at start the store's check used to call such
a store "not an SQLite database" and say to move it aside, and mid-run the run ended in MLflow's
traceback. The store's own checks wait as long, and a lock held longer is one line naming the store
and how to go on.
"""

from __future__ import annotations

import logging

LOCK_WAIT_S = 20.0  # mlflow.store.db.utils sets PRAGMA busy_timeout = 20000 on each session
_HELD = f"stayed locked by another process for over {LOCK_WAIT_S:.0f} s"  # what both lines say of the store
_quiet = False


def quiet_lock_errors() -> None:
    """MLflow logs a locked store's error with its traceback before raising it; the app says it in one line."""
    global _quiet
    if not _quiet:
        logging.getLogger("mlflow.store.db.utils").addFilter(
            lambda record: not (record.exc_info and store_locked(record.exc_info[1]))
        )
        _quiet = True


def store_locked(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it came from) is sqlite's "database is locked"."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if "database is locked" in str(exc) or "database table is locked" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def locked_line(store: str, run: str | None) -> str:
    """The one line for a store that stayed locked mid-run; ``run`` is the experiment (``cfg.run``)."""
    how = {
        "sweep": "re-run the same command (it recovers the trial)",
        "spike": "re-run the same command",
    }.get(run or "", "continue with the same command plus resume=true (or re-run it if no checkpoint was written)")
    return (
        f"the tracking store {store} {_HELD} (sqlite: database is locked), so the run stopped; steps.csv and "
        "the last checkpoint are kept: once "
        f"nothing else holds the store (an open `sqlite3` shell or transaction, a backup), {how}"
    )


def locked_reason(exc: BaseException) -> str | None:
    """A sweep trial's failure reason when the store stayed locked: the condition, not MLflow's message, which
    quotes SQLAlchemy's statement and parameters (hundreds of characters in the trial's table line)."""
    if not store_locked(exc):
        return None
    return f"the tracking store {_HELD} (database is locked)"
