"""A password holding ``@`` or equal to part of its key is hidden whole everywhere (terminal, the
server's tags and params, config.yaml); ``--cfg job --resolve`` prints ``***``; a torchrun trial's
temporary job file never holds it."""

from __future__ import annotations

import time

import pytest
from mlflow import MlflowClient

from sweep.secrets import hide_argv, redact_text, seal, unseal
from tests.app.helpers import TINY, run_cli
from tests.app.run.test_mlflow_server import server  # noqa: F401  (fixture)
from tests.reliability.helpers import finish, start_cli


@pytest.mark.parametrize(
    "text,shown",
    [
        ("http://alice:p@ssS3cret6@host:5000/x", "http://alice:***@host:5000/x"),
        ("tracking.uri=http://alice:r@host", "tracking.uri=http://alice:***@host"),
        (r"postgresql\://bob\:p@ss\:w@db\:5432/o", r"postgresql\://bob\:***@db\:5432/o"),
        (
            "see 'https://u:a@b@h/p?token=T0k' and ssh://git@host:22/x",
            "see 'https://u:***@h/p?token=***' and ssh://git@host:22/x",
        ),
    ],
)
def test_userinfo_is_parsed_up_to_the_last_at(text, shown):
    assert redact_text(text) == shown


def test_a_password_inside_the_key_leaves_the_key_alone():
    env: dict[str, str] = {}
    assert hide_argv(["tracking.uri=http://alice:r@host"], env) == [
        "tracking.uri=http://alice:${oc.env:CLIPAMP_SECRET_0}@host"
    ]
    assert env == {"CLIPAMP_SECRET_0": "r"}
    assert (
        hide_argv(["--cfg", "job", "tracking.uri=http://alice:r@host"], env)[2] == "tracking.uri=http://alice:***@host"
    )


def test_seal_keeps_the_password_out_of_the_text_and_unseal_restores_it():
    env: dict[str, str] = {}
    text = '{"uri": "http://alice:p@ssS3cret6@h:1", "config": "storage: postgresql://b:S2@d/o?password=S3"}'
    sealed = seal(text, env)
    assert not any(s in sealed for s in ("S3cret6", "S2", "S3")) and unseal(sealed, env) == text


@pytest.mark.slow
@pytest.mark.parametrize("password", ["r", "p@ssS3cret6"])
def test_cfg_resolve_prints_no_password_and_parses(tmp_path, password):
    res = run_cli(
        "+experiment=train",
        f"tracking.uri=http://alice:{password}@127.0.0.1:1",
        "--cfg",
        "job",
        "--resolve",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert "uri: http://alice:***@127.0.0.1:1" in res.stdout and f"alice:{password}@" not in res.stdout + res.stderr


def _grep(secret: bytes, *roots) -> list[str]:
    return [str(f) for root in roots for f in root.rglob("*") if f.is_file() and secret in f.read_bytes()]


@pytest.mark.slow
def test_at_sign_password_reaches_no_tag_param_file_or_terminal(tmp_path, server):  # noqa: F811
    uri, root = server
    secret_uri = uri.replace("http://", "http://alice:p@ssS3cret6@")
    res = run_cli("+experiment=train", *TINY, "steps=3", f"tracking.uri={secret_uri}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "S3cret6" not in res.stdout + res.stderr
    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id], max_results=1)[0]
    assert run.data.tags["tracking_uri"] == uri.replace("http://", "http://alice:***@")
    assert "S3cret6" not in str(run.data.tags) + str(run.data.params)
    assert not _grep(b"S3cret6", root, tmp_path)  # the server's database and artifacts (config.yaml), the run folder


@pytest.mark.slow
def test_torchrun_trial_job_file_holds_no_password(tmp_path, server):  # noqa: F811
    """``study.nproc_per_trial=2``: the job file a SIGKILLed worker would leave behind is read while it exists."""
    uri, root = server
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), tmp.mkdir()
    secret_uri = uri.replace("http://", "http://alice:p@ssS3cret6@")
    proc = start_cli(
        "+experiment=sweep",
        *TINY,
        "steps=4",
        "study.n_trials=1",
        "study.nproc_per_trial=2",
        "study.pruner=none",
        "study.anchor=null",
        "study.dtypes=[fp32]",
        f"tracking.uri={secret_uri}",
        cwd=work,
        env={"TMPDIR": str(tmp)},
    )
    seen = []
    while proc.poll() is None:
        seen += [(f, f.read_bytes()) for f in tmp.glob("clipamp-trial-*/job.json") if f not in dict(seen)]
        time.sleep(0.05)
    res = finish(proc)
    assert res.returncode == 0, res.stderr[-2000:]
    assert seen and all(b"S3cret6" not in data and b"<clipamp-sealed-" in data for _, data in seen)
    assert "S3cret6" not in res.stdout + res.stderr and not _grep(b"S3cret6", work, tmp, root)
