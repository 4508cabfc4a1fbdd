"""Issue 12 items 6 and 14: a resume that cannot continue the run faithfully is refused in one line,
and the KILLED run, its checkpoint and its steps.csv stay as they were."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from mlflow import MlflowClient

from sweep.app import run
from sweep.errors import UserError
from tests.app.helpers import TINY, compose_cfg, run_cli, store_in

pytestmark = pytest.mark.slow  # one real run killed by SIGTERM, shared by the module

RUN = ["+experiment=train", *TINY, "seed=1", "optim.schedule=constant", "optim.warmup_steps=5"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, store_template):
    """A train run stopped by SIGTERM after >= 8 steps: (folder, uri, run id, csv, checkpoint)."""
    tmp = tmp_path_factory.mktemp("killed")
    uri = store_in(tmp, store_template)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sweep", *RUN, f"tracking.uri={uri}", "steps=100000", "checkpoint_every=0"],
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    csv = None
    for line in proc.stdout:
        if line.startswith("steps.csv: "):
            csv = __import__("pathlib").Path(line.split(": ", 1)[1].strip())
            break
    import time

    while not (csv.exists() and csv.read_text().count("\n") > 8):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=300)
    run_id = csv.parts[-3]
    ckpt = tmp / "mlruns" / "checkpoints" / run_id / "checkpoint.pt"
    assert proc.returncode == 130 and ckpt.exists()
    return tmp, uri, run_id, csv, ckpt


def _resume(killed, *overrides: str) -> str:
    """Resume in-process with ``overrides``; the ``UserError`` line it raises."""
    tmp, uri, run_id, csv, ckpt = killed
    before = (csv.read_bytes(), ckpt.read_bytes())
    rows = csv.read_text().count("\n") - 1
    with pytest.raises(UserError) as e:
        run(compose_cfg(*RUN, f"tracking.uri={uri}", f"steps={rows + 5}", f"resume={run_id}", *overrides))
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "KILLED"
    assert (csv.read_bytes(), ckpt.read_bytes()) == before  # nothing touched
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize(
    "override,shown",
    [
        ("clip.max_norm=2.0", "clip.max_norm (run: 1.0, now: 2.0)"),
        ("amp.dtype=fp32", "amp.dtype (run: bf16, now: fp32)"),
        ("seed=7", "seed (run: 1, now: 7)"),
        ("model.d_model=64", "model.d_model (run: 32, now: 64)"),
        ("forensics.update_norm=true", "forensics.update_norm (run: False, now: True)"),
        ("optim.lr=0.01", "optim.lr (run: 0.003, now: 0.01)"),
        ("data.seq_len=16", "data.seq_len (run: 32, now: 16)"),
    ],
)
def test_changed_config_is_refused_naming_the_key(killed, override, shown):
    msg = _resume(killed, override)
    assert f"the config differs from the run's in {shown}" in msg and "drop those overrides" in msg, msg


def test_cli_refusal_is_one_line_exit_2(killed):
    tmp, uri, run_id, csv, ckpt = killed
    p = run_cli(*RUN, f"tracking.uri={uri}", "steps=100", "resume=true", "clip.max_norm=2.0", cwd=tmp)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert errors == [
        f"error: resume={run_id}: the config differs from the run's in clip.max_norm (run: 1.0, "
        f"now: 2.0); these change the maths of the remaining steps: drop those overrides to resume, "
        f"or start a new run (drop resume=)"
    ]
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"


@pytest.mark.parametrize(
    "damage,shown",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:200]), "cannot be read"),
        (lambda p: p.write_bytes(b""), "cannot be read"),
        (lambda p: p.write_bytes(b"junk" * 100), "cannot be read"),
    ],
)
def test_corrupt_checkpoint_is_one_line(killed, damage, shown):
    ckpt = killed[4]
    saved = ckpt.read_bytes()
    try:
        damage(ckpt)
        with pytest.raises(UserError) as e:
            tmp, uri, run_id, csv, _ = killed
            run(compose_cfg(*RUN, f"tracking.uri={uri}", "steps=100", "resume=true"))
        assert f"the checkpoint {ckpt} {shown}" in str(e.value) and "start a new run (drop resume=)" in str(e.value)
        assert MlflowClient(killed[1]).get_run(killed[2]).info.status == "KILLED"
    finally:
        ckpt.write_bytes(saved)


@pytest.mark.parametrize(
    "edit,shown",
    [
        (lambda t: t.replace("\n3,", "\nthree,", 1), "is not a readable steps CSV"),
        (lambda t: t.replace("\n3,", "\n3,x", 1), "has an unreadable row"),
        (lambda t: "\n".join(l for l in t.split("\n") if not l.startswith("4,")), "does not hold steps 1–"),
    ],
)
def test_corrupt_csv_is_one_line(killed, edit, shown):
    tmp, uri, run_id, csv, ckpt = killed
    saved = csv.read_text()
    try:
        csv.write_text(edit(saved))
        with pytest.raises(UserError) as e:
            run(compose_cfg(*RUN, f"tracking.uri={uri}", "steps=100", "resume=true"))
        assert shown in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"
        assert ckpt.exists()
    finally:
        csv.write_text(saved)


def test_steps_may_extend_and_the_resume_finishes(killed):
    """Last: ``steps=`` (and the display keys) may change; the run then finishes with every row once."""
    tmp, uri, run_id, csv, ckpt = killed
    rows = csv.read_text().count("\n") - 1
    run(
        compose_cfg(
            *RUN, f"tracking.uri={uri}", f"steps={rows + 3}", "resume=true", "progress=false", "checkpoint_every=50"
        )
    )
    steps = [int(l.split(",", 1)[0]) for l in csv.read_text().splitlines()[1:]]
    assert steps == list(range(1, rows + 4))
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED" and not ckpt.exists()
    assert not ckpt.parent.exists()  # the lock file of a finished run is removed with its folder
