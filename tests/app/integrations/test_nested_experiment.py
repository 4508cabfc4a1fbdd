"""Under an active MLflow run (``report_to="mlflow"``, accelerate's tracker, ``mlflow.start_run()``) the
clipamp run is its child in its experiment: MLflow's UI nests a child under its parent only within one
experiment. ``experiment=`` still names another; without an active run the experiment is ``clipamp``."""

from __future__ import annotations

import mlflow
import mlflow.tracking.fluent
import pytest
import torch
import torch.nn.functional as F
from mlflow import MlflowClient

from sweep.integrations.recorder import StepRecorder
from sweep.integrations.resume import ResumeWarning
from sweep.tracking.ui import KIND_TAG, VIEW_TAG

STEPS = 6


@pytest.fixture
def uri(store, monkeypatch):
    """``store`` as MLflow's tracking URI (``$MLFLOW_TRACKING_URI``), its in-process globals restored after."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setattr(mlflow.tracking.fluent, "_active_experiment_id", None)
    yield store
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(None)


def record(tmp_path, resume=None, **kw) -> StepRecorder:
    """A recorder (``tracking="auto"``) through ``STEPS`` steps of constant norms, ended."""
    rec = StepRecorder(calibrate={"window": 3, "start": 0}, verbose=False, **kw)
    rec.begin(total_steps=STEPS, user_tau=None, default_csv=tmp_path / "steps.csv", resume=resume)
    p = torch.nn.Parameter(torch.zeros(4))
    for step in range(rec.step + 1, STEPS + 1):
        p.grad = torch.ones(4)
        rec.record(step, 1e-3, rec.measure([p], step, host_clips=False))
    rec.end(STEPS)
    return rec


def where(uri: str, run_id: str) -> tuple[str, str | None]:
    """The run's experiment name and its ``mlflow.parentRunId``."""
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    return client.get_experiment(run.info.experiment_id).name, run.data.tags.get("mlflow.parentRunId")


def test_a_child_of_an_active_run_is_in_its_experiment_which_is_left_as_it_was(tmp_path, uri):
    mine = MlflowClient(uri).create_experiment("mine", tags={"team": "a"})
    with mlflow.start_run(experiment_id=mine) as parent:
        rec = record(tmp_path)
    assert where(uri, rec.tracker.run_id) == ("mine", parent.info.run_id)
    assert MlflowClient(uri).get_experiment(mine).tags == {"team": "a"}  # no clipamp UI tags on the user's
    assert MlflowClient(uri).get_experiment_by_name("clipamp") is None


def test_an_explicit_experiment_is_honoured_under_an_active_run(tmp_path, uri):
    with mlflow.start_run(experiment_id=MlflowClient(uri).create_experiment("mine")) as parent:
        rec = record(tmp_path, experiment="x")
    assert where(uri, rec.tracker.run_id) == ("x", parent.info.run_id)
    assert {KIND_TAG, VIEW_TAG} <= set(MlflowClient(uri).get_experiment_by_name("x").tags)  # clipamp's own


def test_a_users_experiment_named_explicitly_keeps_its_own_tags(tmp_path, uri):
    """experiment="mine" that exists is the user's (its description, a GenAI kind): no clipamp UI tags are
    written over it, with or without an active run; one clipamp creates gets them."""
    own = {"mlflow.note.content": "my project", KIND_TAG: "genai_development", "team": "a"}
    mine = MlflowClient(uri).create_experiment("mine", tags=own)
    rec = record(tmp_path, experiment="mine")
    assert where(uri, rec.tracker.run_id) == ("mine", None)
    with mlflow.start_run(experiment_id=MlflowClient(uri).create_experiment("parent")):
        record(tmp_path / "nested", experiment="mine")
    assert MlflowClient(uri).get_experiment(mine).tags == own
    record(tmp_path / "new", experiment="new")
    assert {KIND_TAG, VIEW_TAG} <= set(MlflowClient(uri).get_experiment_by_name("new").tags)


def test_without_an_active_run_the_experiment_is_clipamp(tmp_path, uri):
    rec = record(tmp_path)
    assert where(uri, rec.tracker.run_id) == ("clipamp", None)


def test_a_resume_whose_run_is_gone_starts_a_new_child_in_the_active_runs_experiment(tmp_path, uri):
    mine = MlflowClient(uri).create_experiment("mine")
    with mlflow.start_run(experiment_id=mine):
        first = record(tmp_path)
    state = first.checkpoint_state()
    assert where(uri, first.tracker.run_id)[0] == "mine"
    with mlflow.start_run(experiment_id=mine) as parent:
        same = record(tmp_path, resume=state)  # the checkpoint's run continues
    assert same.tracker.run_id == first.tracker.run_id
    MlflowClient(uri).delete_run(first.tracker.run_id)
    with mlflow.start_run(experiment_id=mine) as parent, pytest.warns(ResumeWarning, match="was deleted"):
        fresh = record(tmp_path / "again", resume=state)
    assert where(uri, fresh.tracker.run_id) == ("mine", parent.info.run_id)


def test_accelerates_mlflow_tracker_is_the_parent_in_its_experiment(tmp_path, uri):
    accelerate = pytest.importorskip("accelerate")
    from sweep.integrations.accelerate import ClipampAccelerate

    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = accelerate.Accelerator(cpu=True, log_with="mlflow")
    accelerator.init_trackers("my-project")
    parent = mlflow.active_run().info.run_id
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    clipamp = ClipampAccelerate(accelerator, total_steps=STEPS, window=3, start=0, verbose=False)
    x = torch.randn(8, 4)
    for _ in range(STEPS):
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        accelerator.backward(loss)
        clipamp.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        clipamp.step_end(loss)
    clipamp.end()
    accelerator.end_training()
    assert where(uri, clipamp.recorder.tracker.run_id) == ("my-project", parent)
    assert where(uri, parent)[0] == "my-project"


@pytest.mark.slow  # a transformers.Trainer
def test_a_trainer_reporting_to_mlflow_is_the_parent_in_its_experiment(tmp_path, uri, monkeypatch):
    pytest.importorskip("transformers")
    from sweep.integrations.hf_trainer import ClipampCallback
    from tests.app.integrations.test_hf_trainer import trainer

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "mine")
    cb = ClipampCallback(window=3, start=0, verbose=False)
    trainer(tmp_path, [cb], steps=STEPS, max_grad_norm=1.0, report_to=["mlflow"]).train()
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("mine")
    runs = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
    trainers = [i for i, r in runs.items() if "mlflow.parentRunId" not in r.data.tags]
    assert len(runs) == 2 and len(trainers) == 1 and "max_steps" in runs[trainers[0]].data.params  # Trainer's run
    assert where(uri, cb.recorder.tracker.run_id) == ("mine", trainers[0])
    assert client.get_experiment_by_name("clipamp") is None
