"""A trainer integration's ``steps.csv`` gives, through ``python -m sweep.recommend steps.csv``, the τ the
integration calibrated live: the settings it used sit beside the CSV (``steps.clipamp.yaml``), and a
user's own ``config.yaml`` there is neither read nor touched."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow import MlflowClient

from sweep.integrations.recorder import StepRecorder
from sweep.recommend import cli

STEPS, WARMUP = 60, 5
#: A user's own config beside the CSV: another calibrate section, which is not the integration's run's.
USER_CONFIG = b"# mine\ncalibrate:\n  window: 7\n  quantile: 0.5\nmodel: tiny\n"


def recommend(path, *flags):
    ns = cli.parser().parse_args([str(path), *flags])
    return cli.recommend(ns.paths[0], cli.options_from(ns), ns)


def norm(step: int) -> float:
    """A transient that decays into noise around 1: the window's start=auto placement has work to do."""
    g = torch.Generator().manual_seed(step)
    return 3.0 * math.exp(-step / 6) + math.exp(0.3 * float(torch.randn((), generator=g)))


def lr(step: int) -> float:
    return 1e-3 * min(1.0, step / WARMUP)


class Probe(torch.nn.Module):
    """One weight whose gradient is the step's chosen norm."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))


def assert_same_tau(csv, tau, settings="steps.clipamp.yaml"):
    """``recommend`` on ``csv`` replays the integration's calibration: its τ, exactly, from its settings."""
    rec = recommend(csv)
    assert tau is not None and rec.tau == tau
    assert not [n for n in rec.notes if "no run config" in n]
    assert f"the run's config {csv.parent / settings} (calibrate.*)" in " ".join(rec.notes)


def through_the_hf_callback(csv, seed=0, **calibrate):
    """``ClipampCallback`` in Trainer's hook order, without the Trainer (``tests/app/integrations/
    test_hf_trainer.py`` drives a real one): the callback's τ."""
    pytest.importorskip("transformers")
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from sweep.integrations.hf_trainer import ClipampCallback

    model = Probe()
    opt = torch.optim.SGD(model.parameters(), lr=lr(1))
    args = TrainingArguments(output_dir=str(csv.parent / "out"), max_grad_norm=0.0, use_cpu=True, report_to=[])
    state, control = TrainerState(max_steps=STEPS, is_world_process_zero=True), TrainerControl()
    cb = ClipampCallback(tracking=None, csv_path=csv, verbose=False, **calibrate)
    cb.on_train_begin(args, state, control, model=model)
    for step in range(1, STEPS + 1):
        cb.on_step_begin(args, state, control)
        model.w.grad = torch.tensor([norm(step + seed)])
        for group in opt.param_groups:
            group["lr"] = lr(step)
        cb.on_pre_optimizer_step(args, state, control, optimizer=opt)
        opt.step()
        cb.on_optimizer_step(args, state, control, optimizer=opt)
        state.global_step = step
        cb.on_step_end(args, state, control)
        opt.zero_grad(set_to_none=True)
    cb.on_train_end(args, state, control, model=model)
    return cb.recorder.tau


def test_the_hf_callbacks_csv_gives_its_tau_and_leaves_a_users_config_alone(tmp_path):
    csv = tmp_path / "steps.csv"
    (tmp_path / "config.yaml").write_bytes(USER_CONFIG)
    tau = through_the_hf_callback(csv, window=12, quantile=0.9)
    assert (tmp_path / "config.yaml").read_bytes() == USER_CONFIG
    assert_same_tau(csv, tau)
    assert recommend(csv).options.window == 12


def through_accelerate(csv, *, total_steps, steps=STEPS, tracking=None, **calibrate):
    """``ClipampAccelerate`` in an accelerate loop (fp32, no accumulation) on the chosen norms: its τ (and with
    ``tracking``, its MLflow run id)."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from sweep.integrations.accelerate import ClipampAccelerate

    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = Accelerator(cpu=True)
    model = Probe()
    opt = torch.optim.SGD(model.parameters(), lr=lr(1))
    model, opt = accelerator.prepare(model, opt)
    clipamp = ClipampAccelerate(
        accelerator, total_steps=total_steps, tracking=tracking, csv_path=csv, verbose=False, **calibrate
    )
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr(step)
        model.w.grad = torch.tensor([norm(step)])
        clipamp.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        clipamp.step_end(0.0)
    run_id = clipamp.recorder.tracker.run_id if tracking else None
    clipamp.end()
    return (clipamp.recorder.tau, run_id) if tracking else clipamp.recorder.tau


@pytest.mark.parametrize("total_steps", [STEPS, 2 * STEPS, None])
def test_accelerates_csv_gives_its_tau_whatever_it_knew_of_the_runs_length(tmp_path, total_steps):
    """A run that knew its length, one stopped before it (the window was placed for the longer run), and
    one that knew none (the window waits for the warm-up with no end in view): recommend places it so."""
    csv = tmp_path / "steps.csv"
    (tmp_path / "config.yaml").write_bytes(USER_CONFIG)
    tau = through_accelerate(csv, total_steps=total_steps, window=10, validate=30, quantile=0.8)
    assert (tmp_path / "config.yaml").read_bytes() == USER_CONFIG
    assert_same_tau(csv, tau)


@pytest.mark.parametrize("total_steps", [2 * STEPS, None])
def test_its_mlflow_run_gives_its_tau_whatever_it_knew_of_the_runs_length(tmp_path, store, total_steps):
    """``runs:/ID`` of the same runs: the run's length as its calibration knew it is a param (``total_steps``)."""
    tau, run_id = through_accelerate(
        tmp_path / "steps.csv", total_steps=total_steps, tracking=store, window=10, validate=30, quantile=0.8
    )
    assert MlflowClient(store).get_run(run_id).data.params["total_steps"] == str(total_steps)
    assert recommend(f"runs:/{run_id}", "--tracking-uri", store).tau == tau


def test_a_resumed_run_keeps_its_settings_beside_its_csv(tmp_path):
    """A resume continues the CSV and rewrites the settings beside it: the τ of the run that never stopped."""
    csv = tmp_path / "steps.csv"

    def train(rec, *, upto, resume=None):
        rec.begin(total_steps=STEPS, user_tau=None, default_csv=csv, resume=resume)
        p, saved = torch.nn.Parameter(torch.zeros(1)), None
        for step in range(rec.step + 1, upto + 1):
            p.grad = torch.tensor([norm(step)])
            rec.record(step, lr(step), rec.measure([p], step, host_clips=False))
            if step == 20:
                saved = json.loads(json.dumps(rec.checkpoint_state()))
        return saved

    def recorder():
        return StepRecorder(calibrate={"window": 10, "quantile": 0.8}, tracking=None, csv_path=csv, verbose=False)

    saved = train(recorder(), upto=30)  # killed at step 30, checkpoint at 20
    (tmp_path / "steps.clipamp.yaml").unlink()
    rec = recorder()
    train(rec, upto=STEPS, resume=saved)
    rec.end(STEPS)
    whole = recorder()
    train(whole, upto=STEPS)
    whole.end(STEPS)
    assert rec.tau == whole.tau
    assert_same_tau(csv, rec.tau)


@pytest.mark.parametrize(
    "first, then, saved_at",
    [
        (60, 200, 20),  # longer, resumed before the window was placed (the 60-step run's deadline: step 41)
        (60, 200, 45),  # longer, resumed after the 60-step run's deadline placed it at step 41
        (200, 40, 25),  # shorter, resumed past the 40-step run's deadline (step 21): placed at once
    ],
)
def test_a_run_resumed_with_another_length_gives_the_tau_it_adopted(tmp_path, first, then, saved_at):
    """Trainer's resume_from_checkpoint with another max_steps: the settings beside the CSV say which steps were
    calibrated for which length, and recommend replays them so: its τ, window and quantile are the live run's."""
    resumed_with_another_length(tmp_path, first, then, saved_at, tracking=None)


def test_its_mlflow_run_gives_the_tau_it_adopted_too(tmp_path, store):
    """The same through MLflow: the run's param total_steps is its first length; its tags give the rest."""
    rec = resumed_with_another_length(tmp_path, 60, 200, 45, tracking=store)
    run_id = rec.tracker.run_id
    assert MlflowClient(store).get_run(run_id).data.params["total_steps"] == "60"
    assert recommend(f"runs:/{run_id}", "--tracking-uri", store).tau == rec.tau


def resumed_with_another_length(tmp_path, first, then, saved_at, tracking):
    """A recorder run of ``first`` steps, killed 5 steps after its checkpoint at ``saved_at``, resumed for ``then``
    steps; recommend on its CSV gives the τ, window and quantile it adopted; the resumed recorder."""
    csv = tmp_path / "steps.csv"

    def recorder():
        return StepRecorder(calibrate={"window": 10, "quantile": 0.8}, tracking=tracking, csv_path=csv, verbose=False)

    def train(rec, total, upto, resume=None):
        params = {f"calibrate.{k}": v for k, v in rec.calibration_options().items()}  # as the integrations log them
        rec.begin(total_steps=total, user_tau=None, default_csv=csv, resume=resume, params=params)
        p, saved = torch.nn.Parameter(torch.zeros(1)), None
        for step in range(rec.step + 1, upto + 1):
            p.grad = torch.tensor([norm(step)])
            rec.record(step, lr(step), rec.measure([p], step, host_clips=False))
            saved = json.loads(json.dumps(rec.checkpoint_state())) if step == saved_at else saved
        return saved

    saved = train(recorder(), first, saved_at + 5)  # killed 5 steps after its checkpoint
    rec = recorder()
    train(rec, then, then, resume=saved)
    rec.end(then)
    got = recommend(rec.writer.path)
    live, replayed = rec.policy.summaries[0], got.clip.summaries[0]
    assert (replayed.start_step, replayed.end_step) == (live.start_step, live.end_step)
    assert got.tau == rec.tau
    norms = [norm(s) for s in range(live.start_step, live.end_step + 1)]
    assert rec.tau == pytest.approx(float(np.quantile(np.float32(norms), 0.8)), rel=1e-6)
    if saved_at == 20:  # undecided at the checkpoint: placed as a run of `then` steps from the start places it
        whole = recorder()
        train(whole, then, then)
        assert rec.tau == whole.tau and rec.policy.placement == whole.policy.placement
    return rec


def test_a_file_of_that_name_that_is_not_clipamps_is_left_alone(tmp_path):
    csv = tmp_path / "steps.csv"
    (tmp_path / "steps.clipamp.yaml").write_bytes(USER_CONFIG)
    with pytest.warns(UserWarning, match="steps.clipamp.yaml exists and is not clipamp's: left as it is") as w:
        through_accelerate(csv, total_steps=STEPS, window=10)
    assert (tmp_path / "steps.clipamp.yaml").read_bytes() == USER_CONFIG
    said = str(w[0].message)  # what to pass the command instead: its flags, not the app's overrides
    assert "as its flags (--window, --start, --every, --validate, --quantile)" in said and "calibrate." not in said


@pytest.mark.slow  # a real transformers.Trainer
def test_a_real_trainers_mlflow_artifact_csv_gives_the_tau_of_the_callback_and_its_run(tmp_path, store):
    """Trainer + ClipampCallback logging to MLflow: recommend on the run's artifact steps.csv, on runs:/ID
    and the callback agree exactly."""
    pytest.importorskip("transformers")
    from sweep.integrations.hf_trainer import ClipampCallback
    from tests.app.integrations.test_hf_trainer import trainer

    cb = ClipampCallback(window=8, quantile=0.9, tracking=store, verbose=False)
    trainer(tmp_path, [cb], steps=20, max_grad_norm=1.0).train()
    run = MlflowClient(store).get_run(cb.recorder.tracker.run_id)
    assert_same_tau(Path(run.info.artifact_uri.removeprefix("file://")) / "steps.csv", cb.recorder.tau)
    assert recommend(f"runs:/{run.info.run_id}", "--tracking-uri", store).tau == cb.recorder.tau


@pytest.mark.parametrize("tracking", [None, "store"])
def test_a_run_stopped_inside_its_first_window_gives_the_tau_its_end_took(tmp_path, request, tracking):
    """An early stop inside the first window: the integration's end summarises the window so far; recommend on
    its CSV (and its MLflow run) does the same, with a note, instead of "no calibration window closed"."""
    uri = request.getfixturevalue("store") if tracking else None
    out = through_accelerate(
        tmp_path / "steps.csv", total_steps=STEPS, steps=20, tracking=uri, window=30, start=5, quantile=0.9
    )
    tau, run_id = out if tracking else (out, None)
    assert tau is not None
    source = f"runs:/{run_id}" if tracking else tmp_path / "steps.csv"
    rec = recommend(source, *(["--tracking-uri", uri] if tracking else []))
    assert rec.tau == tau
    assert any("inside its first window (steps 6–35): τ is that window's so far (15 norms" in n for n in rec.notes)
