"""The app under torchrun (2 gloo ranks on CPU) against one process on the same global batches.

The end-to-end tests launch ``torchrun --nproc_per_node=2 -m sweep`` as a user would. In fp32 a
2-rank run must reproduce the one-process run step by step (pre-clip norm, loss, τ), keep one
``steps.csv`` and one MLflow run, and continue after SIGTERM to the launcher with ``resume=true``
as if never interrupted (DDP: rank 0's checkpoint; FSDP2: sharded, torch.distributed.checkpoint).
On 2 cores this is a correctness check, not a speed-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from sweep.distributed.launch import Launch, resolve_strategy
from sweep.errors import UserError
from sweep.tasks.build import Batch
from tests.app.helpers import TINY, csv_of, store_in

#: PYTHONFAULTHANDLER: a rank that aborts prints every thread's Python stack, which says in what phase it died
ENV = {
    **{k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"},
    "PYTHONUNBUFFERED": "1",
    "PYTHONFAULTHANDLER": "1",
}
STEPS = 48  # room for SIGTERM to reach the ranks through torchrun before the run ends
# fp32 so that 2 ranks and 1 process agree to rounding; a constant LR so that a resumed run (whose
# first launch had steps=100000) follows the same schedule as an uninterrupted one
RUN = [
    "+experiment=calibrate",
    *TINY,
    "calibrate.window=6",
    "calibrate.start=0",
    "amp.dtype=fp32",
    "optim.schedule=constant",
    "optim.warmup_steps=3",
    "checkpoint_every=0",
]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "sweep"]


# -- launch rules (no processes) --------------------------------------------------------------


@pytest.fixture
def torchrun_env(monkeypatch):
    def set_world(world: int | None):
        for key in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE"):
            monkeypatch.delenv(key, raising=False)
        if world is not None:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
            monkeypatch.setenv("WORLD_SIZE", str(world))

    return set_world


@pytest.mark.parametrize(
    "world, strategy, run, expected",
    [
        (None, "auto", "calibrate", ("none", 1)),
        (None, "none", "sweep", ("none", 1)),
        (1, "auto", "train", ("none", 1)),
        (2, "auto", "calibrate", ("ddp", 2)),
        (2, "fsdp2", "train", ("fsdp2", 2)),
        (2, "auto", "spike", ("ddp", 2)),
    ],
)
def test_strategy_follows_the_launcher(torchrun_env, world, strategy, run, expected):
    torchrun_env(world)
    assert resolve_strategy(strategy, run, 4) == expected


@pytest.mark.parametrize(
    "world, strategy, run, batch, message",
    [
        (None, "ddp", "train", 4, "dist.strategy=ddp needs several processes: launch with `torchrun"),
        (2, "none", "train", 4, "torchrun started 2 processes but dist.strategy=none would run 2 identical jobs"),
        (2, "auto", "sweep", 4, "+experiment=sweep runs in one process: launch it without torchrun"),
        (2, "fsdp2", "spike", 4, "+experiment=spike under torchrun runs with dist.strategy=ddp, not fsdp2"),
        (2, "ddp", "train", 5, "data.batch_size=5 does not split over 2 ranks: use a multiple of 2"),
        (2, "ddp", "train:dpsgd", 4, "clip=dpsgd computes per-example gradients outside backward, which ddp never"),
        (2, "fsdp2", "train:per_group", 4, "clip=per_group needs whole (unsharded) parameters, which FSDP2 does not"),
        (2, "fsdp2", "train:update", 4, "clip=update needs whole (unsharded) parameters"),
    ],
)
def test_impossible_combinations_are_one_line_errors(torchrun_env, world, strategy, run, batch, message):
    """Refused before any store is opened (``start`` calls it first), the clip modes the engine refuses too."""
    torchrun_env(world)
    run, _, clip = run.partition(":")
    with pytest.raises(UserError) as e:
        resolve_strategy(strategy, run, batch, clip or "norm")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "forensics, off",
    [
        (["forensics.top_k=2"], "forensics.top_k=0"),
        (["forensics.update_norm=true", "forensics.top_k=3"], "forensics.update_norm=false forensics.top_k=0"),
    ],
)
def test_forensics_under_fsdp2_is_refused_before_the_run(torchrun_env, forensics, off):
    """The engine refuses forensics under FSDP2 (whole parameters); the app says so at launch, naming the
    overrides to turn it off, instead of after a run was opened."""
    torchrun_env(2)
    with pytest.raises(UserError) as e:
        resolve_strategy("fsdp2", "train", 4, "norm", forensics)
    assert str(e.value) == (
        f"forensics ({' '.join(forensics)}) needs whole (unsharded) parameters, which FSDP2 does not keep: "
        f"turn it off ({off}) or use dist.strategy=ddp"
    )
    assert resolve_strategy("ddp", "train", 4, "norm", forensics) == ("ddp", 2)
    assert resolve_strategy("fsdp2", "train", 4, "norm", []) == ("fsdp2", 2)


def test_forensics_on_names_the_overrides_that_turn_it_on():
    from sweep.config import forensics_on
    from sweep.config.schema import ForensicsConfig

    assert forensics_on(ForensicsConfig()) == []
    assert forensics_on(ForensicsConfig(top_k=2)) == ["forensics.top_k=2"]
    assert forensics_on(ForensicsConfig(param_norm=True, zero_grads=True)) == [
        "forensics.param_norm=true",
        "forensics.zero_grads=true",
    ]


def test_ranks_share_each_global_batch_in_order():
    batch = Batch(torch.arange(12).view(6, 2), torch.arange(6), "src")
    shares = [next(Launch("ddp", rank, 3).share(iter([batch]))) for rank in range(3)]
    assert torch.equal(torch.cat([s.inputs for s in shares]), batch.inputs)
    assert torch.equal(torch.cat([s.targets for s in shares]), batch.targets)
    assert {s.data_source for s in shares} == {"src"}
    assert next(Launch().share(iter([batch]))) is batch


# -- end to end ---------------------------------------------------------------------------------


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _kill_and_resume(
    tmp: Path, *extra: str, resume_in_one_process: str | None = None
) -> tuple[pd.DataFrame, str, subprocess.CompletedProcess]:
    """Start under torchrun, SIGTERM the launcher after a few steps, resume to STEPS: under torchrun,
    or in one process with ``dist.strategy=resume_in_one_process``."""
    csv = _killed(tmp, *extra)
    if resume_in_one_process is None:
        resumed = _run([*TORCHRUN, *RUN, f"steps={STEPS}", "resume=true", *extra], tmp)
    else:
        again = [*RUN, f"steps={STEPS}", "resume=true", f"dist.strategy={resume_in_one_process}"]
        resumed = _run([sys.executable, "-m", "sweep", *again], tmp)
    return pd.read_csv(csv), csv.parts[-3], resumed


def _killed(tmp: Path, *extra: str) -> Path:
    """A torchrun run stopped by SIGTERM to the launcher after a few steps, its checkpoint kept: its steps.csv."""
    proc = subprocess.Popen(
        [*TORCHRUN, *RUN, "steps=100000", *extra],
        cwd=tmp,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    csv = None
    for line in proc.stdout:
        if line.startswith("steps.csv: "):
            csv = Path(line.split(": ", 1)[1].strip())
            break
    assert csv is not None, proc.stderr.read()[-3000:]
    deadline = time.time() + 300
    while not (csv.exists() and csv.read_text().count("\n") > 4) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    interrupted = [l for l in err.splitlines() if l.startswith("interrupted (SIGTERM at step ")]
    assert len(interrupted) == 1, err[-3000:]  # rank 0 alone reports, after a checkpoint at a common step
    stopped = int(interrupted[0].split(" at step ")[1].split(")")[0])
    assert stopped < STEPS, "the run was too fast to interrupt before the end"
    assert [l for l in err.splitlines() if l.startswith("error:")] == []
    return csv


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, store_template) -> pd.DataFrame:
    tmp = tmp_path_factory.mktemp("one")
    store_in(tmp, store_template)  # its default store, migrated already
    return pd.read_csv(csv_of(_run([sys.executable, "-m", "sweep", *RUN, f"steps={STEPS}"], tmp).stdout))


#: 2 ranks sum each gradient in another order than one process: every step agrees to rtol 1e-5 over the
#: first 16 steps, after which training amplifies those ~1e-7 roundings (measured: 1.5e-5 on the pre-clip
#: norm at step 41 of 48, loss still 2e-7), so later steps are held to rtol 1e-4.
EXACT_STEPS = 16


def _assert_same_run(rows: pd.DataFrame, ref: pd.DataFrame) -> None:
    assert rows["step"].tolist() == list(range(1, STEPS + 1)) == ref["step"].tolist()
    assert rows["skipped"].tolist() == ref["skipped"].tolist()
    assert rows["token_count"].tolist() == ref["token_count"].tolist()  # global, not one rank's share
    for col in ("grad_l2_pre_clip", "grad_l2_post_clip", "loss", "max_norm"):
        got, want = torch.tensor(rows[col].fillna(0).to_numpy()), torch.tensor(ref[col].fillna(0).to_numpy())
        torch.testing.assert_close(got[:EXACT_STEPS], want[:EXACT_STEPS], rtol=1e-5, atol=1e-6, msg=col)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=col)


@pytest.mark.slow
def test_calibrate_under_torchrun_is_the_one_process_run(tmp_path, one_process):
    # a fresh directory: rank 0 alone creates and migrates the MLflow store
    res = _run([*TORCHRUN, *RUN, f"steps={STEPS}"], tmp_path)
    assert res.stdout.count("steps.csv: ") == 1 and res.stdout.count("Recommended clip.max_norm=") == 1
    rows = pd.read_csv(csv_of(res.stdout))
    _assert_same_run(rows, one_process)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    window = rows[rows["phase"] == "calibrate"]["grad_l2_pre_clip"]  # quantiles of the global norms
    assert runs[0].data.metrics["grad_norm_p95"] == pytest.approx(window.quantile(0.95), rel=1e-6)
    assert runs[0].data.metrics["recommended_max_norm"] == pytest.approx(rows["max_norm"].iloc[-1], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_sigterm_to_torchrun_then_resume_continues_like_one_process(tmp_path, store, one_process, strategy):
    rows, run_id, resumed = _kill_and_resume(tmp_path, f"dist.strategy={strategy}")
    assert "resumed run " + run_id in resumed.stdout
    _assert_same_run(rows, one_process)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    assert client.get_run(run_id).info.status == "FINISHED"
    assert not (tmp_path / "mlruns" / "checkpoints" / run_id / "checkpoint.pt").exists()
    assert not list((tmp_path / "mlruns" / "checkpoints" / run_id).glob("shards-*"))


@pytest.mark.slow
def test_a_ddp_run_resumes_in_one_process(tmp_path, store, one_process):
    """A DDP checkpoint is a one-process checkpoint: started with an explicit dist.strategy=ddp, the
    run continues in one process (dist.strategy=none) and ends as the one-process run."""
    rows, run_id, resumed = _kill_and_resume(tmp_path, "dist.strategy=ddp", resume_in_one_process="none")
    assert "resumed run " + run_id in resumed.stdout
    _assert_same_run(rows, one_process)
    assert MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db").get_run(run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_fsdp2_shards_that_cannot_be_read_are_one_line_and_the_run_stays_killed(tmp_path, store):
    """torch.distributed.checkpoint raises CheckpointException, a BaseException: without its conversion a
    resume over missing shards ended in a traceback."""
    import shutil

    csv = _killed(tmp_path, "dist.strategy=fsdp2")
    run_id = csv.parts[-3]
    (shards,) = (tmp_path / "mlruns" / "checkpoints" / run_id).glob("shards-*")
    for f in shards.iterdir():  # the shard files gone, the folder and checkpoint.pt kept
        f.unlink() if f.is_file() else shutil.rmtree(f)
    res = subprocess.run(
        [*TORCHRUN, *RUN, f"steps={STEPS}", "resume=true", "dist.strategy=fsdp2"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0, res.stderr[-3000:]
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert errors, res.stderr[-3000:]
    assert (
        f"resume={run_id}: the checkpoint does not fit this model and config (RuntimeError: FSDP2 shards, rank 0:"
        in errors[0]
    )
    assert "Traceback" not in res.stderr.split("error:")[0] and "Traceback" not in errors[0]  # ours: none
    assert MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db").get_run(run_id).info.status == "KILLED"
    assert (tmp_path / "mlruns" / "checkpoints" / run_id / "checkpoint.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, error",
    [
        (
            ["+experiment=sweep"],
            "+experiment=sweep runs in one process: launch it without torchrun "
            "(under torchrun: +experiment=calibrate, train or spike)",
        ),
        (
            ["+experiment=train", "dist.strategy=fsdp2", "forensics.top_k=2"],
            "forensics (forensics.top_k=2) needs whole (unsharded) parameters, which FSDP2 does not keep: "
            "turn it off (forensics.top_k=0) or use dist.strategy=ddp",
        ),
    ],
)
def test_a_user_mistake_under_torchrun_is_one_line(tmp_path, args, error):
    res = subprocess.run([*TORCHRUN, *args, *TINY], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0, res.stderr[-3000:]
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert errors == [f"error: {error}"]
    assert "(exitcode: 2)" in res.stderr  # the rank's exit status for a user mistake
    assert "steps.csv" not in res.stdout
    assert "Traceback" not in res.stderr.split("error:")[0]  # no traceback from our ranks before it
    assert not (tmp_path / "mlruns").exists()  # refused before any store was opened


@pytest.mark.slow
def test_ranks_that_composed_different_configs_are_refused_before_the_store(tmp_path):
    """``seed=${oc.env:RANK}``: each rank trained on its own seed's batches while the run logged rank 0's
    seed=0 and exited 0 (the step-6 norm 20% off the one-process run's); now one line names the key."""
    res = subprocess.run(
        [*TORCHRUN, *RUN, "steps=8", "seed=${oc.env:RANK}"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0, res.stderr[-3000:]
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert errors == [
        "error: the ranks composed different configs (seed: rank 0 0, rank 1 1): every rank must train with the "
        "same values (an override read from $RANK or $LOCAL_RANK differs by rank); pass the same values to every rank"
    ]
    assert not (tmp_path / "mlruns").exists()
