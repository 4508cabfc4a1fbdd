"""Opening the tracking store: the one path every run takes before MLflow touches it.

A sqlite store is inspected with the standard library first (MLflow would retry a junk file for
minutes, or add its tables to any database it is pointed at), created atomically under a file lock
(MLflow's first migration takes seconds; two processes racing in it, or a kill during it, used to
leave the store broken for good), and a store MLflow cannot use is refused with the command that
repairs it. An HTTP store must answer like an MLflow server; ``user:password@`` in its URL becomes
MLflow's basic-auth credentials.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import sqlite3
import sys
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from filelock import FileLock, Timeout

from sweep.errors import UserError
from sweep.secrets import redact
from sweep.tracking.busy import LOCK_WAIT_S, quiet_lock_errors, store_locked

DEFAULT_URI = "sqlite:///mlruns/mlflow.db"
SUPPORTED_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")
LOCK_TIMEOUT_S = 300  # another process creating the store holds the lock for 5–10 s
_FIX_URI = f"pass tracking.uri={DEFAULT_URI} (or another sqlite:///DIR/mlflow.db)"


def sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///") :])


def anchored(uri: str, base: Path) -> str:
    """``uri`` with a relative ``sqlite:///`` path made absolute against ``base``.

    ``base`` is where the user ran the command (Hydra's original cwd): with ``hydra.job.chdir=true``
    or ``-m`` the default ``sqlite:///mlruns/mlflow.db`` stays there, and the printed store is absolute.
    """
    db = sqlite_path(uri)
    if db is None or db.is_absolute() or str(db) in ("", "."):
        return uri
    return f"sqlite:///{os.path.normpath(Path(base).absolute() / db)}"


def check_uri(uri: str) -> str:
    """Refuse an unsupported, unwritable, broken or unreachable store with one actionable line.

    Returns the URI to hand to MLflow (an HTTP URL without its ``user:password@``).
    """
    scheme = urlsplit(uri).scheme.split("+")[0]
    if scheme not in SUPPORTED_SCHEMES:
        raise UserError(
            f"tracking.uri={redact(uri)!r} is not supported (scheme {scheme or 'none'!r}); use "
            f"{DEFAULT_URI}, postgresql://…, or http://127.0.0.1:5000 for an `mlflow server`"
        )
    db = sqlite_path(uri)
    if db is not None:
        prepare_sqlite(uri, db)
        return sqlite_url(db)
    if scheme in ("http", "https"):
        return check_server(uri)
    if scheme in ("postgresql", "mysql", "mssql"):
        check_database(uri)
    return uri


def sqlite_url(db: Path) -> str:
    """The URL SQLAlchemy (hence MLflow) reads as the file ``db``: its path percent-encoded, since
    SQLAlchemy decodes the path and cuts it at ``?`` (a folder ``a?b`` or ``a%20b`` is the file's own name)."""
    return "sqlite:///" + quote(str(db), safe="/")


@contextlib.contextmanager
def no_stray_folders(url: str) -> Iterator[None]:
    """Remove what MLflow creates for a percent-encoded ``sqlite_url``: it makes the parent folders of
    the URL's path taken literally (``a%3Fb/``) while SQLAlchemy opens the decoded one (``a?b/``)."""
    literal = Path(url.removeprefix("sqlite:///")).parent
    new = [p for p in (literal, *literal.parents) if not p.exists()]
    try:
        yield
    finally:
        for folder in new:  # deepest first; only folders left empty
            try:
                folder.rmdir()
            except OSError:
                break


def check_database(uri: str, timeout_s: int = 5) -> None:
    """One connection attempt (``timeout_s``) to a database server store, instead of MLflow's minutes of
    retries; ``UserError`` naming the server if it does not answer or the driver is missing."""
    import sqlalchemy
    from sqlalchemy.engine import make_url

    shown = redact(uri)
    try:
        url = make_url(uri)
        if url.drivername == "postgresql" and importlib.util.find_spec("psycopg") is None:
            url = url.set(drivername="postgresql+psycopg2")  # SQLAlchemy >= 2.1 maps postgresql:// to psycopg 3
        timeout = {"mssql": "timeout"}.get(url.get_backend_name(), "connect_timeout")
        engine = sqlalchemy.create_engine(url, connect_args={timeout: timeout_s}, poolclass=sqlalchemy.pool.NullPool)
    except (ImportError, sqlalchemy.exc.ArgumentError, ValueError) as e:
        raise UserError(
            f"tracking.uri={shown!r} cannot be used ({type(e).__name__}: {redact(' '.join(str(e).split()))[:160]}); "
            f"install its database driver, or {_FIX_URI}"
        ) from None
    try:
        with engine.connect():
            pass
    except Exception as e:  # sqlalchemy.exc.OperationalError/InterfaceError wrapping the driver's own
        reason = redact(" ".join(str(getattr(e, "orig", e)).split()))[:160]
        raise UserError(
            f"tracking.uri={shown!r} is unreachable ({reason}); start the database server or {_FIX_URI}"
        ) from None
    finally:
        engine.dispose()


def prepare_sqlite(uri: str, db: Path) -> None:
    """Create the store at ``db`` once (atomically, under ``db.lock``) or check the one there."""
    if not str(db) or str(db) == ".":
        raise UserError(f"tracking.uri={uri!r} names no database file; {_FIX_URI}")
    quiet_lock_errors()  # a store locked mid-run is the CLI's one line, not MLflow's logged traceback
    if db.is_dir():
        raise UserError(f"tracking.uri={uri!r}: {db} is a directory, not a database file; {_FIX_URI}")
    if db.exists() and not os.access(db, os.W_OK):
        raise UserError(f"tracking.uri={uri!r}: {db} is read-only; make it writable (`chmod u+w {db}`) or {_FIX_URI}")
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        open(f"{db}.lock", "a").close()  # FileLock would retry an unwritable folder until its timeout
        with FileLock(f"{db}.lock", timeout=LOCK_TIMEOUT_S):
            if not db.exists() or db.stat().st_size == 0:
                create_store(db)
                warn_orphans(db)
            else:
                verify_store(uri, db)
    except Timeout:
        raise UserError(
            f"tracking.uri={uri!r}: another process has held {db}.lock for {LOCK_TIMEOUT_S} s; "
            f"if none is running, delete {db}.lock"
        ) from None
    except OSError as e:
        raise UserError(
            f"tracking.uri={uri!r}: cannot write in {db.parent}/ ({e.strerror}); "
            f"pass tracking.uri=sqlite:///WRITABLE/DIR/mlflow.db"
        ) from None


def warn_orphans(db: Path) -> None:
    """A store created beside ``checkpoints/`` of runs it cannot know (its predecessor was deleted or
    moved): one line, since those runs cannot be resumed from this store."""
    found = sorted(db.parent.glob("checkpoints/*/checkpoint.pt"))
    if found:
        print(
            f"warning: created a new tracking store {db}, but {db.parent / 'checkpoints'} holds {len(found)} "
            f"checkpoint(s) of runs it does not know (was the previous {db.name} deleted or moved?): resume=true "
            f"cannot continue them; put the old {db.name} back to resume them",
            file=sys.stderr,
        )


def warn_far_artifacts(name: str, location: str, db: Path) -> None:
    """One line when experiment ``name`` of the sqlite store ``db`` keeps its artifacts on a local path outside
    ``db``'s folder: a copied or moved store (MLflow records the absolute path it was created with), whose new
    runs would write their ``steps.csv`` and checkpoints' artifacts into the old folder."""
    from mlflow.utils.file_utils import local_file_uri_to_path

    if not location.startswith("file:"):
        return
    path, home = Path(local_file_uri_to_path(location)), db.parent.resolve()
    if path == home or home in path.parents:
        return
    print(
        f"warning: experiment {name!r} of {db} keeps its artifacts in {path}, outside {home} (MLflow records the "
        f"path a store was created with; a copied or moved store keeps the old one): this run's artifacts go "
        f"there; to keep them beside this store, pass tracking.experiment=ANOTHER_NAME",
        file=sys.stderr,
    )


def create_store(db: Path) -> None:
    """Run MLflow's migrations on a temporary file, then rename it into place (a kill leaves no half store).
    Silently: MLflow's "Creating initial MLflow database tables" INFO lines are not the app's output."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    quiet = [logging.getLogger(name) for name in ("mlflow.store.db.utils", "alembic")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.WARNING)

    for stale in db.parent.glob(f".{db.name}.creating-*"):  # left by a process killed while creating
        stale.unlink()
    tmp = db.with_name(f".{db.name}.creating-{os.getpid()}")
    try:
        with no_stray_folders(sqlite_url(tmp)):
            store = SqlAlchemyStore(sqlite_url(tmp), (db.parent.resolve() / "artifacts").as_uri())
        store.engine.dispose()
        SqlAlchemyStore._engine_map.pop(sqlite_url(tmp), None)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, db)
    finally:
        tmp.unlink(missing_ok=True)
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def _tables(db: Path) -> tuple[set[str], str | None, int | None]:
    """Table names, alembic revision and run count of the sqlite file ``db``, read-only; where a process
    killed mid-write left a hot rollback journal (``mlflow.db-journal``), which a read-only connection
    cannot roll back ("attempt to write a readonly database"), through a read-write one that does
    (SQLite's own recovery, as MLflow's next write would do; ``mode=rw`` creates nothing)."""
    try:
        return _read_tables(db, "ro")
    except sqlite3.OperationalError as e:
        if "readonly" not in str(e):
            raise
        return _read_tables(db, "rw")


def _read_tables(db: Path, mode: str) -> tuple[set[str], str | None, int | None]:
    con = sqlite3.connect(f"{db.resolve().as_uri()}?mode={mode}", uri=True, timeout=LOCK_WAIT_S)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        rev = con.execute("SELECT version_num FROM alembic_version").fetchone() if "alembic_version" in tables else None
        runs = con.execute("SELECT count(*) FROM runs").fetchone()[0] if "runs" in tables else None
        return tables, rev[0] if rev else None, runs
    finally:
        con.close()


def mlflow_tables(db: Path) -> bool:
    """Whether the sqlite file ``db`` holds MLflow's tables (False for any other file)."""
    try:
        return "experiments" in _tables(db)[0]
    except sqlite3.DatabaseError:
        return False


def verify_store(uri: str, db: Path) -> None:
    """Refuse a file that is not a current MLflow store, naming the command that repairs it."""
    try:
        tables, rev, runs = _tables(db)
    except sqlite3.DatabaseError as e:
        if store_locked(e):  # a valid store another process holds: moving it aside would hide its runs
            raise UserError(
                f"tracking.uri={uri!r}: {db} stayed locked by another process for {LOCK_WAIT_S:.0f} s ({e}); "
                f"re-run once nothing else holds it (an open `sqlite3` shell or transaction, a backup)"
            ) from None
        raise UserError(
            f"tracking.uri={uri!r}: {db} is not an SQLite database ({e}); move it aside "
            f"(`mv {db} {db}.bad`) and re-run, or {_FIX_URI}"
        ) from None
    if "experiments" not in tables:
        what = "an Optuna study database" if "studies" in tables else "not an MLflow store"
        raise UserError(f"tracking.uri={uri!r}: {db} is {what} (MLflow would add its tables to it); {_FIX_URI}")
    from mlflow.store.db.utils import _get_latest_schema_revision  # the schema this MLflow expects

    head = _get_latest_schema_revision()
    if rev == head and not any(t.startswith("_alembic_tmp") for t in tables):
        return
    from sweep.commands import mlflow_command

    upgrade = f"{mlflow_command()} db upgrade sqlite:///{db.resolve()}"
    if not runs:
        raise UserError(
            f"tracking store {db} was left half-created (schema {rev}, expected {head}; no runs in "
            f"it), e.g. by a process killed while creating it: `mv {db} {db}.broken` and re-run"
        )
    if not _known_revision(rev):
        import mlflow

        raise UserError(
            f"tracking store {db} was written by a newer MLflow (schema {rev} is unknown to MLflow "
            f"{mlflow.__version__}): run with that MLflow version, or {_FIX_URI}"
        )
    raise UserError(
        f"tracking store {db} has an older MLflow schema ({rev}, expected {head}; {runs} runs): "
        f"back it up (`cp {db} {db}.bak`), then run `{upgrade}`"
    )


def _known_revision(rev: str | None) -> bool:
    from alembic.script import ScriptDirectory
    from mlflow.store.db.utils import _get_alembic_config

    try:
        return rev is not None and ScriptDirectory.from_config(_get_alembic_config("")).get_revision(rev) is not None
    except Exception:  # alembic raises its own errors for unknown ids
        return False


def check_server(uri: str) -> str:
    """The URL without userinfo (moved into MLflow's basic-auth variables) once it answers like MLflow."""
    parts = urlsplit(uri)
    headers = {}
    if parts.username is not None:
        user, password = unquote(parts.username), unquote(parts.password or "")
        os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"] = user, password
        headers["Authorization"] = "Basic " + b64encode(f"{user}:{password}".encode()).decode()
        uri = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    probe = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
    shown = redact(urlunsplit(parts))
    try:
        body = urllib.request.urlopen(urllib.request.Request(probe, headers=headers), timeout=5).read()
    except urllib.error.HTTPError as e:
        raise UserError(
            f"tracking.uri={shown!r} is not an MLflow tracking server (GET {urlsplit(probe).path} "
            f"answered {e.code} {e.reason}); start `mlflow server --host 127.0.0.1 --port PORT` "
            f"or drop tracking.uri to use {DEFAULT_URI}"
        ) from None
    except (urllib.error.URLError, OSError) as e:
        raise UserError(
            f"tracking.uri={shown!r} is unreachable ({getattr(e, 'reason', e)}); start "
            f"`mlflow server --host 127.0.0.1 --port PORT` or drop tracking.uri to use {DEFAULT_URI}"
        ) from None
    if not body.lstrip().startswith(b"{"):
        raise UserError(
            f"tracking.uri={shown!r} is not an MLflow tracking server (its API answered with no JSON); "
            f"check the port, or drop tracking.uri to use {DEFAULT_URI}"
        )
    return uri


def open_client(uri: str):
    """An ``MlflowClient`` on ``uri`` once ``check_uri`` accepts it."""
    from mlflow import MlflowClient

    url = check_uri(uri)
    if url == uri or sqlite_path(url) is None:
        return MlflowClient(tracking_uri=url)
    with no_stray_folders(url):
        return MlflowClient(tracking_uri=url)
