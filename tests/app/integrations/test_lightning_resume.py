"""The Lightning ``ClipampCallback`` across ``fit(ckpt_path=…)``: a fit killed after its checkpoint and
resumed from it calibrates and records as the fit that never stopped."""

from __future__ import annotations

import math

import pytest
import torch
from mlflow import MlflowClient

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from sweep.integrations.lightning import ClipampCallback  # noqa: E402
from sweep.integrations.resume import ResumeWarning  # noqa: E402
from sweep.run.loop import STEP_METRICS  # noqa: E402
from sweep.run.summary import read_rows  # noqa: E402

from .test_dropin_lightning import LitGPT, _loader  # noqa: E402

pytestmark = pytest.mark.slow  # each test runs a Lightning fit, stops it and resumes it

STEPS, SAVE, KILL, TAU = 12, 6, 8, 0.25  # an epoch is 6 steps: the checkpoint is at its end
OPTIONS = dict(window=4, quantile=0.95)


class KillAfter(L.Callback):
    """An error after optimizer step ``at`` (its record written): a fit killed between two checkpoints."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            raise RuntimeError(f"killed after step {self.at}")


def fit(root, callbacks, *, ckpt_path=None, kill=False):
    """A bf16 fit of STEPS steps clipping at TAU; ``kill``: checkpoints every SAVE steps, killed after KILL."""
    torch.manual_seed(0)
    module = LitGPT()
    extra = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=SAVE, save_top_k=-1), KillAfter(KILL)]
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        gradient_clip_val=TAU,
        callbacks=[*callbacks, *(extra if kill else [])],
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=kill,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if kill:
        with pytest.raises(RuntimeError, match=f"killed after step {KILL}"):
            trainer.fit(module, _loader(SAVE, 1))
    else:
        trainer.fit(module, _loader(SAVE, 1), ckpt_path=ckpt_path)
    return module


def killed_then_resumed(root, make_callbacks):
    """The module of a fit killed after step KILL and resumed (fresh module, Trainer and callbacks) from
    its checkpoint at step SAVE; the callbacks the resumed fit ran with."""
    fit(root, make_callbacks(), kill=True)
    [ckpt] = (root / "ckpt").glob(f"*step={SAVE}.ckpt")
    callbacks = make_callbacks()
    return fit(root, callbacks, ckpt_path=ckpt), callbacks


def same_parameters(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.fixture(scope="module")
def resume_is_exact(tmp_path_factory) -> bool:
    """The control: whether Lightning alone (no callback) resumes this fit bit for bit."""
    root = tmp_path_factory.mktemp("control")
    resumed, _ = killed_then_resumed(root / "resumed", lambda: [])
    return same_parameters(fit(root / "ref", []), resumed)


def window(cb: ClipampCallback):
    s = cb.summary
    return s.start_step, s.end_step, s.recommended_max_norm, repr(cb.policy.checks())


@pytest.mark.parametrize("apply", [False, True])
def test_a_resumed_fit_calibrates_and_records_as_the_fit_that_never_stopped(tmp_path, resume_is_exact, apply):
    """Window, τ, checks and every steps.csv row (1–6 kept, the killed fit's 7–8 replaced) equal the
    uninterrupted fit's; so do the parameters wherever Lightning's own resume is exact (the control)."""
    ref_cb = ClipampCallback(apply=apply, tracking=None, csv_path=tmp_path / "ref.csv", verbose=False, **OPTIONS)
    ref = fit(tmp_path / "ref", [ref_cb])
    csv = tmp_path / "steps.csv"
    module, [cb] = killed_then_resumed(
        tmp_path / "run",
        lambda: [ClipampCallback(apply=apply, tracking=None, csv_path=csv, verbose=False, **OPTIONS)],
    )
    assert SAVE < ref_cb.summary.end_step  # the checkpoint was taken before the window closed
    assert window(cb) == window(ref_cb)
    assert csv.read_text() == (tmp_path / "ref.csv").read_text()
    if resume_is_exact:
        assert same_parameters(ref, module)


def test_a_fit_resumed_after_an_error_continues_in_a_new_mlflow_run_equal_to_its_csv(tmp_path, store):
    """The error ended the fit's run FAILED with every step it took (steps 7–8 past the checkpoint, which MLflow
    cannot remove): the resumed fit records in a new run, FINISHED, tagged with the failed one, that holds each
    step once, equal to its steps.csv (steps 1–6 the failed fit's, 7–12 the resume's)."""
    module, [cb] = killed_then_resumed(
        tmp_path / "run", lambda: [ClipampCallback(apply=True, tracking=store, verbose=False, **OPTIONS)]
    )
    client = MlflowClient(store)
    runs = {r.info.run_id: r for r in client.search_runs([cb.recorder.tracker.experiment_id])}
    run = runs.pop(cb.recorder.tracker.run_id)
    [failed] = runs.values()
    assert (failed.info.status, run.info.status) == ("FAILED", "FINISHED")
    assert (run.data.tags["resumed.from_run"], run.data.tags["resumed.from_step"]) == (failed.info.run_id, str(SAVE))
    failed_steps = sorted(m.step for m in client.get_metric_history(failed.info.run_id, "grad_l2_pre_clip"))
    assert failed_steps == list(range(1, KILL + 1))
    rows = read_rows(cb.recorder.writer.path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for key in STEP_METRICS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(r["step"], float(r[key])) for r in rows if math.isfinite(r[key])], key


def test_other_calibration_options_are_refused(tmp_path):
    """A resume asking window=5 of a checkpoint calibrated with window=4 stops before any step, the
    killed fit's CSV as it was."""
    csv = tmp_path / "steps.csv"
    fit(tmp_path, [ClipampCallback(tracking=None, csv_path=csv, verbose=False, **OPTIONS)], kill=True)
    before = csv.read_bytes()
    [ckpt] = (tmp_path / "ckpt").glob(f"*step={SAVE}.ckpt")
    cb = ClipampCallback(tracking=None, csv_path=csv, verbose=False, **{**OPTIONS, "window": 5})
    message = (
        r"the checkpoint at step 6 was calibrated with other options \(window=4 there, window=5 here\): "
        r"resume with the checkpoint's calibration options, or train from the start"
    )
    with pytest.raises(ValueError, match=message):
        fit(tmp_path, [cb], ckpt_path=ckpt)
    assert csv.read_bytes() == before


def test_a_checkpoint_saved_without_the_callback_is_said(tmp_path):
    fit(tmp_path, [], kill=True)
    [ckpt] = (tmp_path / "ckpt").glob(f"*step={SAVE}.ckpt")
    cb = ClipampCallback(tracking=None, csv_path=tmp_path / "steps.csv", verbose=False, **OPTIONS)
    message = (
        r"^clipamp: resuming at step 6: the checkpoint holds no ClipampCallback state \(it was saved without the "
        r"callback\): the calibration and the records start afresh at step 7$"
    )
    with pytest.warns(ResumeWarning, match=message):
        fit(tmp_path, [cb], ckpt_path=ckpt)
    assert [r["step"] for r in cb.recorder.records.rows] == list(range(SAVE + 1, STEPS + 1))


@pytest.mark.parametrize("tracked", [False, True])
def test_fit_again_on_the_same_trainer_continues_the_record(tmp_path, store, tracked):
    """``trainer.fit_loop.max_epochs = 2; trainer.fit(...)`` after a 1-epoch fit (Lightning goes on at step 7):
    one steps.csv (one MLflow run) with steps 1–12, the first fit's rows as it wrote them, and the window the
    first fit closed checked on the steps after it, as one 12-step record would be."""
    csv = tmp_path / "steps.csv"
    cb = ClipampCallback(tracking=store if tracked else None, csv_path=csv, verbose=False, **OPTIONS)
    torch.manual_seed(0)
    module = LitGPT()
    kw = dict(accelerator="cpu", devices=1, precision="bf16-mixed", gradient_clip_val=TAU, logger=False)
    kw.update(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(max_epochs=1, callbacks=[cb], default_root_dir=str(tmp_path), **kw)
    trainer.fit(module, _loader(SAVE, 1))
    first = [dict(r) for r in cb.recorder.records.rows]
    assert trainer.global_step == SAVE and cb.summary.end_step == 4  # window 1–4: start=auto for 6 steps
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, _loader(SAVE, 1))
    rows = read_rows(cb.recorder.writer.path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[:SAVE] == first  # not overwritten by the second fit
    [summary], [check] = cb.policy.summaries, cb.policy.checks()
    held_out = [r["grad_l2_pre_clip"] for r in rows[summary.end_step :]]
    assert check.steps == len(held_out) == STEPS - 4  # checked on steps 5–12, across the two fits
    assert check.clipped == sum(summary.recommended_max_norm / (n + 1e-6) < 1 for n in held_out)
    if tracked:
        client = MlflowClient(store)
        run = client.get_run(cb.recorder.tracker.run_id)
        assert run.info.status == "FINISHED" and len(client.search_runs([run.info.experiment_id])) == 1
        history = client.get_metric_history(run.info.run_id, "grad_l2_pre_clip")
        assert sorted(m.step for m in history) == list(range(1, STEPS + 1))


def test_a_fit_after_the_tuners_lr_find_calibrates_as_one_without_it(tmp_path, recwarn):
    """``Tuner(trainer).lr_find`` saves a checkpoint before its trial steps and restores it (the callback's state
    at step 0 included): the fit after it records and calibrates as the same fit without lr_find, unwarned."""
    from lightning.pytorch.tuner import Tuner

    def run(name, tune):
        cb = ClipampCallback(tracking=None, csv_path=tmp_path / f"{name}.csv", verbose=False, **OPTIONS)
        torch.manual_seed(0)
        module = LitGPT()
        module.lr = 1e-3
        kw = dict(accelerator="cpu", devices=1, precision="bf16-mixed", gradient_clip_val=TAU, logger=False)
        kw.update(enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer = L.Trainer(max_steps=STEPS, callbacks=[cb], default_root_dir=str(tmp_path / name), **kw)
        if tune:
            Tuner(trainer).lr_find(module, _loader(STEPS, 1), num_training=5, update_attr=False)
        trainer.fit(module, _loader(STEPS, 1))
        return cb

    ref, cb = run("ref", False), run("tuned", True)
    assert not [w for w in recwarn if issubclass(w.category, ResumeWarning)]
    assert window(cb) == window(ref)
    assert (tmp_path / "tuned.csv").read_text() == (tmp_path / "ref.csv").read_text()
