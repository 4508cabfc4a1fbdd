"""Checkpoints of a run: where they live, written atomically (never from non-finite parameters or
optimizer state), and which run a ``resume=`` continues.

Under torchrun a DDP checkpoint is rank 0's ``checkpoint.pt`` (a one-process checkpoint plus every
rank's RNG state). FSDP2 writes its model and optimizer shards with ``torch.distributed.checkpoint``
into ``shards-STEP/`` beside a small ``checkpoint.pt`` that names them, so the file that makes a
checkpoint resumable is always replaced last.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from clipamp_engine import AmpTrainState, total_norm
from sweep.commands import python_command
from sweep.distributed.launch import Launch
from sweep.errors import UserError, one_line
from sweep.run.diskspace import disk_full
from sweep.tracking.tracker import sqlite_path

CHECKPOINT_NAME = "checkpoint.pt"


def non_finite_state(state: AmpTrainState) -> str | None:
    """Name what is non-finite in the model parameters or optimizer state, else ``None``."""
    params = [p.detach() for p in state.model.parameters()]
    if params and not bool(torch.isfinite(total_norm(params, float("inf")))):  # sync: once per checkpoint
        return "model parameters"
    moments = [
        v
        for s in state.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 0
    ]
    if moments and not bool(torch.isfinite(total_norm(moments, float("inf")))):  # sync
        return "optimizer state"
    return None


def save_checkpoint(path: Path, state: AmpTrainState, **extra: Any) -> bool:
    """Write ``state`` (+ ``extra``) to ``path`` atomically; refuse (warn, keep the old file) if non-finite."""
    bad = non_finite_state(state)
    if bad is not None:
        _refuse(path, state, bad)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    _write({"engine": state.state_dict(), "rng": torch.get_rng_state(), "cuda_rng": cuda_rng_state(), **extra}, path)
    return True


def cuda_rng_state() -> torch.Tensor | None:
    """The current CUDA device's generator state (dropout masks on the GPU draw from it), or ``None``
    where CUDA was never used in this process."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def set_cuda_rng_state(saved: torch.Tensor | None) -> None:
    if saved is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved)


def _write(obj: Any, path: Path) -> None:
    """``torch.save`` to a temporary file renamed into place: a failed write keeps the old checkpoint and
    leaves no temporary file, whatever cut it short (a second Ctrl-C included); a full disk (torch reports
    it as a RuntimeError) is raised as ENOSPC."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(obj, tmp)
    except BaseException as e:
        full = isinstance(e, (RuntimeError, OSError)) and (
            shutil.disk_usage(path.parent).free < (1 << 16) or disk_full(e) is not None
        )
        tmp.unlink(missing_ok=True)
        if full:
            raise OSError(errno.ENOSPC, "No space left on device", str(path)) from e
        raise
    os.replace(tmp, path)


class CheckpointRefused(RuntimeWarning):
    """A checkpoint not written because the state holds inf/NaN (the previous one is kept)."""


def _refuse(path: Path, state: AmpTrainState, bad: str) -> None:
    warnings.warn(
        f"checkpoint at step {state.step_count} refused: {bad} hold inf/NaN; keeping the previous checkpoint {path}",
        CheckpointRefused,
        stacklevel=3,
    )


def load_checkpoint(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def save_run_checkpoint(path: Path, state: AmpTrainState, launch: Launch, **extra: Any) -> bool:
    """``save_checkpoint`` on every rank's behalf (call it on every rank): rank 0 writes the file;
    FSDP2 shards go through ``torch.distributed.checkpoint`` first."""
    if not launch.distributed:
        return save_checkpoint(path, state, **extra)
    bad = non_finite_state(state)  # on every rank: under FSDP2 the check is a collective
    if bad is not None:
        _refuse(path, state, bad)  # silent on ranks other than 0
        return False
    rng, cuda_rng = launch.gather(torch.get_rng_state()), launch.gather(cuda_rng_state())
    engine = state.state_dict()
    if launch.strategy == "fsdp2":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        shards = f"shards-{extra.get('step', state.step_count)}"
        model, optim = get_state_dict(state.model, state.optimizer)
        with _dcp_errors():
            dcp.save({"model": model, "optimizer": optim}, checkpoint_id=path.parent / shards)
        engine = {k: v for k, v in engine.items() if k not in ("model", "optimizer")}
        extra["shards"] = shards
    if launch.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        _write({"engine": engine, "rng": rng, "cuda_rng": cuda_rng, "strategy": launch.strategy, **extra}, path)
        for old in path.parent.glob("shards-*"):
            if old.name != extra.get("shards"):
                shutil.rmtree(old, ignore_errors=True)
    return True


@contextlib.contextmanager
def _dcp_errors():
    """``torch.distributed.checkpoint`` wraps a rank's failure in ``CheckpointException``, a
    ``BaseException``: as the ``OSError`` (a full disk) or ``RuntimeError`` the run's handlers turn
    into one line and a checkpoint kept."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        causes = [exc for exc, _ in e.failures.values()] or [e]  # each failing rank's own exception
        first = causes[0]
        text = (
            f"FSDP2 shards, rank {min(e.failures, default=0)}: {type(first).__name__}: {' '.join(str(first).split())}"
        )
        if any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in causes):
            raise OSError(errno.ENOSPC, text[:300]) from None
        raise RuntimeError(text[:300]) from None


def restore_run_checkpoint(path: Path, state: AmpTrainState, ckpt: dict[str, Any], launch: Launch) -> None:
    """Engine and this rank's RNG state from ``ckpt`` (read from ``path``); FSDP2 shards from beside it."""
    sharded = "shards" in ckpt
    if sharded != (launch.strategy == "fsdp2"):
        written = "FSDP2 (sharded)" if sharded else "one process or DDP"
        raise UserError(
            f"resume: the checkpoint at {path} was written by {written}; resume it with "
            f"dist.strategy={'fsdp2' if sharded else 'ddp (or one process)'}"
        )
    if sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optim = get_state_dict(state.model, state.optimizer)
        shards = {"model": model, "optimizer": optim}
        with _dcp_errors():
            dcp.load(shards, checkpoint_id=path.parent / ckpt["shards"])
        set_state_dict(
            state.model, state.optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"]
        )
    state.load_state_dict(ckpt["engine"])
    rng, cuda_rng = ckpt["rng"], ckpt.get("cuda_rng")  # (no cuda_rng: a checkpoint from before it was kept)
    if isinstance(rng, list):  # one state per rank (torchrun); a different world size reuses rank 0's
        rng = rng[launch.rank] if launch.rank < len(rng) else rng[0]
    if isinstance(cuda_rng, list):
        cuda_rng = cuda_rng[launch.rank] if launch.rank < len(cuda_rng) else cuda_rng[0]
    torch.set_rng_state(rng)
    set_cuda_rng_state(cuda_rng)


def remove_checkpoint(path: Path) -> None:
    """Drop a finished run's checkpoint and any shards beside it."""
    path.unlink(missing_ok=True)
    for shards in path.parent.glob("shards-*"):
        shutil.rmtree(shards, ignore_errors=True)


#: Keys a resume may change: they extend the run or change only how it is shown and tracked.
#: Anything else (clip, amp, seed, model, optim, data, forensics, faults, calibrate, device) changes
#: the maths of the remaining steps, so a resume that changes it is refused.
RESUME_MAY_CHANGE = (
    "steps",
    "resume",
    "progress",
    "progress_every",
    "checkpoint_every",
    "eval_every",
    "dist.timeout_s",
    "tracking.",
    "study.",
    "spike.",
)
#: ``dist.strategy`` values whose checkpoint is one process's (DDP's replicas each hold the whole
#: model and optimizer): a run started under one resumes under any other, in one process or under
#: torchrun, on the same global batches. FSDP2's sharded checkpoint resumes under fsdp2 only.
ONE_PROCESS_CHECKPOINT = frozenset({"auto", "none", "ddp"})


def _same_for_resume(key: str, run: str, now: str) -> bool:
    if key == "dist.strategy":
        return run == now or {run, now} <= ONE_PROCESS_CHECKPOINT
    return run == now or any(key == m or (m.endswith(".") and key.startswith(m)) for m in RESUME_MAY_CHANGE)


#: Config fields whose value is a dict, logged one param per entry (``clip.patterns.attn``): a resume
#: compares their whole contents, so an entry added, removed or renamed is a change too.
DICT_VALUED = ("clip.patterns", "model.config", "model.kwargs")


def config_differences(logged: dict[str, str], now: dict[str, str]) -> list[str]:
    """``key (run: a, now: b)`` for each logged param whose value changed, apart from ``RESUME_MAY_CHANGE``
    and a ``dist.strategy`` that keeps a one-process checkpoint (``ONE_PROCESS_CHECKPOINT``); for a
    ``DICT_VALUED`` field, its entries as a whole (a key only one side has is left out elsewhere:
    a config key added since the run was logged)."""

    def under(field: str, params: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in params.items() if k == field or k.startswith(field + ".")}

    changed = [
        f"{k} (run: {logged[k]}, now: {now[k]})"
        for k in sorted(now)
        if k in logged and not _same_for_resume(k, logged[k], now[k]) and not k.startswith(DICT_VALUED)
    ]
    for field in DICT_VALUED:
        run, current = under(field, logged), under(field, now)
        if run != current and (run or current):
            changed.append(f"{field} (run: {_entries(field, run)}, now: {_entries(field, current)})")
    return changed


def _entries(field: str, params: dict[str, str]) -> str:
    """A dict-valued field's logged entries as ``{a: 1, b: 2}`` (``null`` or ``{}`` as logged)."""
    if list(params) == [field]:
        return params[field]
    return "{" + ", ".join(f"{k.removeprefix(field + '.')}: {v}" for k, v in sorted(params.items())) + "}"


def _read_checkpoint(path: Path, run_id: str) -> dict[str, Any]:
    """The checkpoint's contents, or one ``UserError`` line if it is truncated, junk or incomplete."""
    try:
        ckpt = load_checkpoint(path)
        ok = isinstance(ckpt, dict) and isinstance(ckpt.get("step"), int) and "engine" in ckpt and "rng" in ckpt
        reason = "it holds no clipamp checkpoint"
    except Exception as e:  # truncated, empty or junk bytes: pickle/zip errors of every kind
        ok, reason = False, one_line(e, 120)
    if not ok:
        raise UserError(
            f"resume={run_id}: the checkpoint {path} cannot be read ({reason}); the run cannot "
            f"continue from it: start a new run (drop resume=)"
        )
    return ckpt


def checkpoint_path(uri: str, run_id: str) -> Path:
    """Local checkpoint of a run: beside a sqlite store, else under ./mlruns/checkpoints/."""
    db = sqlite_path(uri)
    root = db.parent / "checkpoints" if db is not None else Path("mlruns") / "checkpoints"
    return root / run_id / CHECKPOINT_NAME


def lock_run(uri: str, run_id: str):
    """Hold ``run.lock`` beside the run's checkpoint while it trains: a second process that tries to
    resume the same run is refused at once instead of writing the same steps twice."""
    from filelock import FileLock, Timeout

    path = checkpoint_path(uri, run_id).with_name("run.lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise UserError(
            f"resume={run_id}: the run is in use by another process (it holds {path}); wait for "
            f"it to end, or stop it (Ctrl-C) and resume again"
        ) from None
    return lock


def release_run(lock, finished: bool) -> None:
    """Release a run's lock; a finished run (nothing left to resume) also drops the file and its empty folder."""
    lock.release()
    if finished:
        path = Path(lock.lock_file)
        path.unlink(missing_ok=True)
        try:
            path.parent.rmdir()
        except OSError:  # not empty (another file kept there) or gone
            pass


def find_resumable(client, experiment_id: str, run_name: str, uri: str, resume: str) -> str:
    """The run id to resume: ``resume`` itself, or the latest run named ``run_name`` with a checkpoint. Refused in
    one line that suggests only what would continue a run of the experiment."""
    if resume.lower() not in ("true", "last"):
        try:
            client.get_run(resume)
        except Exception:
            lead = (
                f"resume={resume!r} is not a run id in this tracking store (a run id is 32 hex digits: "
                f"{python_command('sweep.report')} --wide lists them)"
            )
            if _latest_with_checkpoint(client, experiment_id, uri, f"attributes.run_name = '{run_name}'") is not None:
                raise UserError(f"{lead}; use resume=true for the latest run named {run_name!r}") from None
            raise UserError(f"{lead}; {_nothing_named(client, experiment_id, run_name, uri)}") from None
        return resume
    named = _latest_with_checkpoint(client, experiment_id, uri, f"attributes.run_name = '{run_name}'")
    if named is not None:
        return named.info.run_id
    raise UserError(f"resume=true: {_nothing_named(client, experiment_id, run_name, uri)}")


def _nothing_named(client, experiment_id: str, run_name: str, uri: str) -> str:
    """No run named ``run_name`` has a checkpoint: what to do instead (the latest run with one, if any)."""
    experiment = client.get_experiment(experiment_id).name
    other = _latest_with_checkpoint(client, experiment_id, uri)
    hint = (
        f"; the latest run with one is {other.info.run_name!r}: a run's name says its experiment, model and dtype, "
        f"so another amp.dtype or model looks for another name; resume={other.info.run_id} continues that run "
        "and names any setting that differs"
        if other is not None
        else ""
    )
    return (
        f"no run named {run_name!r} with a checkpoint in experiment {experiment!r}; "
        f"start a new run (drop resume=){' or pass resume=RUN_ID' if other is not None else ''}{hint}"
    )


def _latest_with_checkpoint(client, experiment_id: str, uri: str, filter_string: str = ""):
    """The most recently started of the experiment's last 50 runs (matching ``filter_string``) that has a checkpoint."""
    runs = client.search_runs(
        [experiment_id], filter_string=filter_string, order_by=["attributes.start_time DESC"], max_results=50
    )
    return next((run for run in runs if checkpoint_path(uri, run.info.run_id).exists()), None)


def refuse_other_task(logged: str | None, now: str, run_id: str) -> None:
    """The same config can build another task: files edited since the run began (another corpus, and with
    ``data=hf`` another trained tokenizer, whose ids the model's embedding does not mean). The run's ``task``
    tag says what it trained on; a resume that would go on with other data is refused."""
    if logged is not None and logged != now:
        raise UserError(
            f"resume={run_id}: the data or model differ from the run's, though the config is the same (files "
            f"changed?): the run trained {logged}; this command builds {now}; resume with the files the run "
            "began with, or start a new run (drop resume=)"
        )


def load_resumable(
    client,
    experiment_id: str,
    run_name: str,
    uri: str,
    resume: str,
    params: dict[str, str] | None = None,
    task: str | None = None,
) -> tuple[str, dict[str, Any]]:
    """``(run_id, checkpoint)`` of the run ``resume`` names, the checkpoint's ``steps`` the run's length (what
    ``sweep.run.resume_length`` checks a resume's ``steps=`` against); ``UserError`` if ``params`` (the config as
    logged) differ from the run's in a key outside ``RESUME_MAY_CHANGE``, or if ``task`` (what the command builds)
    is not what the run trained on (``refuse_other_task``)."""
    run_id = find_resumable(client, experiment_id, run_name, uri, resume)
    logged = client.get_run(run_id).data if params is not None or task is not None else None
    if params is not None:
        changed = config_differences(logged.params, params)
        if changed:
            raise UserError(
                f"resume={run_id}: the config differs from the run's in {'; '.join(changed)}; these "
                f"change the maths of the remaining steps: drop those overrides to resume, or start a "
                f"new run (drop resume=)"
            )
    if task is not None:  # after the config: a changed key is named there, more precisely
        refuse_other_task(logged.tags.get("task"), task, run_id)
    path = checkpoint_path(uri, run_id)
    if not path.exists():
        raise UserError(f"resume={run_id}: no checkpoint at {path}; the run cannot be resumed")
    ckpt = _read_checkpoint(path, run_id)
    if not isinstance(ckpt.get("steps"), int) and str(logged and logged.params.get("steps")).isdigit():
        ckpt["steps"] = int(logged.params["steps"])  # the run's length, from a checkpoint that does not hold it
    return run_id, ckpt
