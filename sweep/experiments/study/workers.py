"""Sweep workers on one study: which are alive, what a dead one leaves, and one set-up at a time.

Liveness: a worker holds ``run.lock`` beside its parent run's checkpoint folder for its whole life
(``filelock``: an ``flock`` the OS releases when the process dies, SIGKILL included). Its parent run
carries the lock's host and path (tags ``worker_host``, ``worker_lock``) and each of its trials names
the parent (user attr ``parent_run_id``). A worker on this host whose lock can be taken is provably
dead: its RUNNING trials are failed and re-enqueued once (Optuna's
``RetryHeartbeatStaleTrialCallback``) and its RUNNING runs (parent, anchor window, trial) end KILLED,
at once. A worker on this host that holds its lock is alive, whatever its heartbeat says. A worker on
another host cannot be probed: Optuna's heartbeat rule judges it (``fail_stale_trials``' rule: silent
for ``study.grace_period`` s).

Set-up: recovery, the anchor window, the dtype trials enqueued first and the sampler's seed run under
a lock on the study (beside a sqlite Optuna database; for a server storage, in the host's temporary
folder, so it orders the workers of one host): workers started together run one anchor window, enqueue
each dtype once and seed their samplers differently (``cfg.seed`` + the trials already in the study).
"""

from __future__ import annotations

import copy
import hashlib
import re
import socket
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import optuna
from filelock import FileLock, Timeout
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.trial import TrialState

from sweep.report.unfinished import steps_done
from sweep.results.study import KILLED_OUTCOME
from sweep.run.checkpoint import lock_run
from sweep.run.liveness import lock_says
from sweep.tracking.tracker import RunTracker, Store, redact, sqlite_path


def hold_worker(store: Store, parent: RunTracker) -> FileLock:
    """This worker's liveness lock (held until it ends), its host and path recorded on the parent run."""
    lock = lock_run(store.uri, parent.run_id)
    parent.set_tags({"worker_host": socket.gethostname(), "worker_lock": str(Path(lock.lock_file).resolve())})
    return lock


@contextmanager
def study_lock(storage_url: str, name: str, say, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
    """One worker at a time through the study's set-up (recovery, anchor window, enqueued trials);
    ``waiting()`` is called every second while another worker holds it (it may raise: a signal to stop)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]
    db = sqlite_path(storage_url)
    if db is not None:
        path = db.with_name(f"{db.name}.{slug}.lock")
    else:
        digest = hashlib.sha1(f"{redact(storage_url)} {name}".encode()).hexdigest()[:12]
        path = Path(tempfile.gettempdir()) / f"clipamp-study-{slug}-{digest}.lock"
    lock = FileLock(path)
    try:
        lock.acquire(timeout=1)
    except Timeout:
        say(f"waiting for another worker to set up study {name!r} (recovery, anchor window, queued trials) …")
        while not lock.is_locked:
            waiting()
            try:
                lock.acquire(timeout=1)
            except Timeout:
                pass
    try:
        yield
    finally:
        lock.release()


def recover_dead_workers(study, store: Store, say) -> list[int]:
    """FAIL (and re-enqueue once) the trials of dead workers, end their runs KILLED; one line saying what.

    Dead: provably (a worker of this host whose lock is free), or silent past the grace period (Optuna's
    heartbeat rule, for workers this host cannot probe). A worker of this host that holds its lock is alive
    whatever its heartbeat says. Only the trials this call fails are blamed: a trial that its own worker
    ends meanwhile, FAIL included, leaves that worker's runs alone."""
    client, name = store.client, study.study_name
    parents = client.search_runs(
        [store.experiment_id],
        filter_string=(f"tags.study = '{name}' and tags.sweep_role = 'parent' and attributes.status = 'RUNNING'"),
    )
    says = {r.info.run_id: lock_says(r.data.tags) for r in parents}
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    parent_of = {t.number: t.user_attrs.get("parent_run_id") for t in running}
    for run_id in {p for p in parent_of.values() if p and p not in says}:
        says[run_id] = _ended(client, run_id, name)
    run_of = lambda t: _trial_run(client, store.experiment_id, parent_of[t.number], t.number)  # noqa: E731
    failed = _fail([t for t in running if says.get(parent_of[t.number]) is False], study, run_of)
    stale_ids = _stale_trial_ids(study)
    silent = [t for t in running if t._trial_id in stale_ids and says.get(parent_of[t.number]) is not True]
    stale = _fail([t for t in silent if t.number not in failed], study, run_of)
    dead = {run_id for run_id, alive in says.items() if alive is False} | {parent_of[n] for n in stale if parent_of[n]}
    killed = [_kill(client, store.experiment_id, name, run_id) for run_id in sorted(dead)]
    trials = sorted(failed + stale)
    if trials or any(killed):
        runs = [r for group in killed for r in group]
        what = f"trials {trials} marked FAIL and re-enqueued" if trials else "no trial of theirs was running"
        say(f"recovered {len(dead)} dead sweep worker(s): {what}; runs ended KILLED: {', '.join(runs) or 'none'}")
    others = [t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))]
    if others:
        say(
            f"trials {others} are running in other live workers (or in workers on other hosts, failed after "
            f"study.grace_period s without a heartbeat)"
        )
    return trials


def _ended(client, parent_run_id: str, study_name: str) -> bool | None:
    """False (dead) when the worker's parent run of this study has ended: its worker ends it only after its
    trials (a worker the study's database left stopped with one RUNNING), so that trial is nobody's; else None."""
    try:
        run = client.get_run(parent_run_id)
    except Exception:  # not in this store: this host cannot tell
        return None
    return False if run.info.status != "RUNNING" and run.data.tags.get("study") == study_name else None


def _stale_trial_ids(study) -> set[int]:
    """The RUNNING trials silent past ``grace_period``: the rule of Optuna's ``fail_stale_trials``, asked of
    the storage so that the trials this host can vouch for are left out and only those failed here are named."""
    storage = study._storage
    if not is_heartbeat_enabled(storage):
        return set()
    return set(storage._get_stale_trial_ids(study._study_id))


#: User attrs the recovery gives a dead worker's trial (what its run holds), not passed on to its retry.
DEAD_ATTRS = ("outcome", "run_id", "steps_run")


def _trial_run(client, experiment_id: str, parent_run_id: str | None, number: int) -> dict[str, object]:
    """What a dead worker's trial run holds, as ``sweep.report`` reads it: its run id and the steps it did."""
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_run_id}' and tags.trial = '{number}'"
    )
    if not parent_run_id or not runs:
        return {"outcome": KILLED_OUTCOME}
    run = runs[0].info
    steps = steps_done(client, runs[0])
    killed = {"outcome": KILLED_OUTCOME} if run.status in ("RUNNING", "KILLED") else {}  # FAILED: a failed trial
    return {**killed, "run_id": run.run_id, "steps_run": float(steps)}


def _fail(trials: list, study, run_of: Callable[[object], dict[str, object]]) -> list[int]:
    """FAIL these RUNNING trials (unless another worker did first), recording what their runs hold (``run_of``:
    KILLED with the steps they ran, as ``sweep.report`` shows them), and re-enqueue each once."""
    storage, done = study._storage, []
    retry = storage.get_heartbeat_stale_trial_callback()
    for t in trials:
        try:
            for key, value in run_of(t).items():
                storage.set_trial_user_attr(t._trial_id, key, value)
            if not storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:  # another worker recovered it first
            continue
        done.append(t.number)
        if retry is not None:  # the retry runs the parameters again: none of the dead run's figures
            frozen = copy.deepcopy(storage.get_trial(t._trial_id))
            frozen.user_attrs = {k: v for k, v in frozen.user_attrs.items() if k not in DEAD_ATTRS}
            retry(study, frozen)
    return done


def _kill(client, experiment_id: str, study_name: str, parent_run_id: str) -> list[str]:
    """End a dead worker's RUNNING runs KILLED (tag ``outcome=worker died``): its children, then itself."""
    children = client.search_runs(
        [experiment_id],
        filter_string=(f"tags.`mlflow.parentRunId` = '{parent_run_id}' and attributes.status = 'RUNNING'"),
    )
    names = []
    for run in children:
        client.set_tag(run.info.run_id, "outcome", "worker died")
        client.set_terminated(run.info.run_id, status="KILLED")
        names.append(run.info.run_name)
    try:
        parent = client.get_run(parent_run_id)
    except Exception:  # not in this experiment's store
        return names
    if parent.info.status == "RUNNING" and parent.data.tags.get("study") == study_name:
        client.set_tag(parent_run_id, "outcome", "worker died")
        client.set_terminated(parent_run_id, status="KILLED")
        names.append(f"{parent.info.run_name} (parent)")
    return names
