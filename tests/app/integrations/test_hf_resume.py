"""``ClipampCallback`` across ``Trainer.train(resume_from_checkpoint=…)``: the run that was stopped after its
checkpoint and resumed from it is the run that never stopped — window, τ, ``steps.csv``, parameters, MLflow run."""

from __future__ import annotations

import io
import json
import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments

from clipamp_engine.clip.calibrated import CalibratedClip
from clipamp_engine.records import SkipLog, StepLog
from sweep.integrations.hf_trainer import ClipampCallback
from sweep.integrations.resume import ResumeWarning, from_json, to_json
from sweep.run.loop import STEP_METRICS
from sweep.run.summary import summary_metrics

from .test_hf_trainer import dataset, tiny_llama

pytestmark = pytest.mark.slow  # each test trains a transformers.Trainer, stops it and resumes it

STEPS, SAVE, KILL, TAU = 12, 6, 8, 0.3  # checkpoint at step 6; the run is killed after step 8


def trainer(out, callbacks, *, save: bool = True, **kw) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        max_grad_norm=kw.pop("max_grad_norm", TAU),
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="steps" if save else "no",
        save_steps=SAVE,
        disable_tqdm=True,
        seed=0,
        **kw,
    )
    return Trainer(model=tiny_llama(0), args=args, train_dataset=dataset(), callbacks=callbacks)


class KillAfter(TrainerCallback):
    """``KeyboardInterrupt`` after optimizer step ``at`` (the callback's record of it written, and with
    ``flush``, its per-step metrics sent): a run killed between two checkpoints."""

    def __init__(self, at: int, flush=None) -> None:
        self.at, self.flush = at, flush

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            if self.flush is not None:
                self.flush.tracker.flush()
            raise KeyboardInterrupt


OPTIONS = dict(window=4, quantile=0.95, candidates=(0.1, 0.5))


def callback(apply: bool, **kw) -> ClipampCallback:
    return ClipampCallback(apply=apply, verbose=False, **{"tracking": None, **OPTIONS, **kw})


def killed_then_resumed(out, make_callback, *, resume_kw=None, before_resume=None):
    """Train until killed after step KILL (checkpoint at SAVE), then resume a fresh Trainer and callback
    from checkpoint-SAVE; the resumed Trainer, the callback it ran with and the one passed to it."""
    first = make_callback()
    with pytest.raises(KeyboardInterrupt):
        trainer(out, [first, KillAfter(KILL, first if first.recorder.tracking else None)]).train()
    first.recorder.writer.close()  # what the kill's process exit does (its MLflow run stays RUNNING)
    if before_resume is not None:
        before_resume()
    cb = make_callback()
    t = trainer(out, [cb], **(resume_kw or {}))
    t.train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE}"))
    [ran] = [c for c in t.callback_handler.callbacks if isinstance(c, ClipampCallback)]
    return t, ran, cb


def summary(cb: ClipampCallback) -> dict[str, float]:
    """The end-of-run summary metrics of the callback's records."""
    cfg = SimpleNamespace(calibrate=SimpleNamespace(quantile=cb.policy.quantile))
    return summary_metrics(cfg, cb.recorder.records, cb.policy.summaries)


def window(cb: ClipampCallback):
    s = cb.summary
    return s.start_step, s.end_step, s.recommended_max_norm, repr(cb.policy.checks())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: each ``apply``'s run of STEPS steps, never stopped (its Trainer, callback, CSV text)."""
    runs = {}
    for apply in (False, True):
        root = tmp_path_factory.mktemp(f"ref{apply}")
        cb = callback(apply, csv_path=root / "steps.csv")
        t = trainer(root / "out", [cb], save=False)
        t.train()
        runs[apply] = (t, cb, (root / "steps.csv").read_text())
    return runs


@pytest.mark.parametrize("apply,rebuilt", [(False, False), (True, False), (True, True)])
def test_a_resumed_run_is_the_run_that_never_stopped(tmp_path, uninterrupted, apply, rebuilt):
    """Window, τ, checks, every steps.csv row (rows 1–6 kept, the killed run's 7–8 replaced), the summary
    and the parameters equal the uninterrupted run's. ``rebuilt``: Trainer builds the callback it resumes
    with from the saved arguments (``restore_callback_states_from_checkpoint=True``), all of them."""
    ref, ref_cb, ref_csv = uninterrupted[apply]
    csv = tmp_path / "steps.csv"
    t, cb, passed = killed_then_resumed(
        tmp_path / "out",
        lambda: callback(apply, csv_path=csv),
        resume_kw={"restore_callback_states_from_checkpoint": rebuilt},
    )
    assert ref_cb.summary.end_step > SAVE  # the checkpoint was taken inside the window or before it
    assert window(cb) == window(ref_cb)
    assert csv.read_text() == ref_csv
    for (name, p), q in zip(ref.model.named_parameters(), t.model.parameters()):
        assert torch.equal(p, q), name
    assert repr(summary(cb)) == repr(summary(ref_cb))  # over all 12 steps (repr: NaN equals NaN)
    assert t.args.max_grad_norm == TAU
    assert (cb is not passed) == rebuilt
    assert cb.init_args == passed.init_args and to_json(cb.recorder.options) == to_json(passed.recorder.options)


def test_a_resumed_run_continues_its_mlflow_run(tmp_path, store, uninterrupted):
    """One run, FINISHED, holding each step's metrics once, equal to the uninterrupted run's (the killed run
    had sent steps 1–8; the resume sends nothing twice), and its steps.csv equal to the uninterrupted one."""
    _, ref_cb, ref_csv = uninterrupted[True]
    _, cb, _ = killed_then_resumed(tmp_path / "out", lambda: callback(True, tracking=store))
    client = MlflowClient(store)
    [run] = client.search_runs([cb.tracker.experiment_id])
    assert run.info.run_id == cb.tracker.run_id and run.info.status == "FINISHED"
    ref = pd.read_csv(io.StringIO(ref_csv))
    ref_metrics = [ref_cb.recorder.records.step_metrics(i) for i in range(STEPS)]
    for key in (*STEP_METRICS, "clip_ratio_rolling"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        expected = [(s, m[key]) for s, m in zip(ref["step"], ref_metrics) if math.isfinite(m[key])]
        assert history == expected, key
    steps_csv = client.download_artifacts(run.info.run_id, "steps.csv", str(tmp_path))
    assert open(steps_csv).read() == ref_csv
    for key, value in summary(ref_cb).items():
        if math.isfinite(value):
            assert run.data.metrics[key] == value, key


def test_a_finished_run_resumed_from_an_earlier_checkpoint_continues_in_a_new_mlflow_run(tmp_path, store):
    """A run that finished at step 12 resumed from checkpoint-6 with another clip τ: MLflow cannot drop
    the run's steps 7–12, so a new run, tagged with the one it continues, holds steps 1–6 then the resume's,
    each once and equal to its steps.csv; the finished run is left as it was."""
    out, client = tmp_path / "out", MlflowClient(store)
    first = callback(True, tracking=store)
    trainer(out, [first]).train()
    parent = first.tracker.run_id
    before = sorted((m.step, m.value) for m in client.get_metric_history(parent, "grad_l2_pre_clip"))
    cb = callback(True, tracking=store)
    trainer(out, [cb], max_grad_norm=TAU / 10).train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE}"))
    run = client.get_run(cb.tracker.run_id)
    assert run.info.run_id != parent and run.info.status == "FINISHED"
    assert (run.data.tags["resumed.from_run"], run.data.tags["resumed.from_step"]) == (parent, str(SAVE))
    rows = pd.read_csv(client.download_artifacts(run.info.run_id, "steps.csv", str(tmp_path)))
    assert list(rows["step"]) == list(range(1, STEPS + 1))
    for key in STEP_METRICS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(s, v) for s, v in zip(rows["step"], rows[key]) if math.isfinite(v)], key
    assert sorted((m.step, m.value) for m in client.get_metric_history(parent, "grad_l2_pre_clip")) == before
    assert rows["grad_l2_pre_clip"][SAVE + 1] != before[SAVE + 1][1]  # step 8: after a step clipped at the new τ


def test_a_missing_steps_csv_is_said_and_a_new_one_starts(tmp_path, uninterrupted):
    """Without the killed run's CSV the records start afresh at step 7 (one warning line says so); the
    calibration, from the checkpoint, is the uninterrupted run's all the same."""
    _, ref_cb, ref_csv = uninterrupted[True]
    csv = tmp_path / "steps.csv"
    with pytest.warns(ResumeWarning) as caught:
        _, cb, _ = killed_then_resumed(tmp_path / "out", lambda: callback(True, csv_path=csv), before_resume=csv.unlink)
    [w] = [w for w in caught if w.category is ResumeWarning]
    assert str(w.message) == (
        f"clipamp: resuming at step 6: {csv} is missing, so steps 1–6 are not in this run's records: a new "
        f"steps.csv ({csv}) starts at step 7 and the summary covers those steps; the calibration continues "
        "from the checkpoint"
    )
    lines = ref_csv.splitlines(keepends=True)
    assert csv.read_text() == lines[0] + "".join(lines[1 + SAVE :])
    assert window(cb) == window(ref_cb)


def test_a_deleted_mlflow_run_is_said_and_a_new_one_starts(tmp_path, store):
    client = MlflowClient(store)

    def delete():
        [run] = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
        client.delete_run(run.info.run_id)
        delete.run_id = run.info.run_id

    with pytest.warns(ResumeWarning, match=r"resuming at step 6: its MLflow run \w+ was deleted from sqlite:///") as w:
        _, cb, _ = killed_then_resumed(tmp_path / "out", lambda: callback(True, tracking=store), before_resume=delete)
    assert delete.run_id in str(next(x for x in w if x.category is ResumeWarning).message)
    assert cb.tracker.run_id != delete.run_id
    assert client.get_run(cb.tracker.run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(cb.tracker.run_id, "grad_l2_pre_clip")]
    assert sorted(steps) == list(range(SAVE + 1, STEPS + 1))


def test_other_calibration_options_are_refused_and_change_nothing(tmp_path):
    """The checkpoint's windows were measured with window=4: a resume asking window=5 is refused before
    any step, its CSV as the killed run left it and max_grad_norm as the user set it."""
    out, csv = tmp_path / "out", tmp_path / "steps.csv"
    first = callback(True, csv_path=csv)
    with pytest.raises(KeyboardInterrupt):
        trainer(out, [first, KillAfter(KILL)]).train()
    before = csv.read_bytes()
    t = trainer(out, [callback(True, csv_path=csv, window=5)])
    message = (
        r"the checkpoint at step 6 was calibrated with other options \(window=4 there, window=5 here\): "
        r"resume with the checkpoint's calibration options, or train from the start"
    )
    with pytest.raises(ValueError, match=message):
        t.train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE}"))
    assert csv.read_bytes() == before
    assert t.args.max_grad_norm == TAU


def test_a_checkpoint_saved_without_the_callback_is_said(tmp_path):
    out, csv = tmp_path / "out", tmp_path / "steps.csv"
    with pytest.raises(KeyboardInterrupt):
        trainer(out, [KillAfter(KILL)]).train()
    cb = callback(False, csv_path=csv)
    message = (
        r"clipamp: resuming at step 6: the checkpoint holds no ClipampCallback state \(it was saved without the "
        r"callback\): the calibration and the records start afresh at step 7"
    )
    with pytest.warns(ResumeWarning, match=message):
        trainer(out, [cb]).train(resume_from_checkpoint=str(out / f"checkpoint-{SAVE}"))
    assert [r["step"] for r in cb.recorder.records.rows] == list(range(SAVE + 1, STEPS + 1))


def test_the_saved_state_is_strict_json_and_restores_the_policy_exactly(tmp_path):
    """NaN and inf (an unbounded interval, a skipped step's norm) and the float keys of the candidates'
    clip ratios come back as they were, through a TrainerState's JSON file; no NaN token in it."""
    policy = CalibratedClip(window=3, start=1, every=4, quantile=0.99, candidates=(0.5, 1.0), total_steps=20)
    for step, norm in enumerate([2.0, 1.0, 1.5, math.inf, 1.2, 0.8, 1.1, 3.0, math.nan, 0.9], 1):
        common = dict(step=step, lr=1e-3, grad_l2_pre_clip=norm, loss=1.0, scaler_scale=1.0)
        if math.isfinite(norm):
            policy.observe(StepLog(grad_l2_post_clip=norm, clipped=False, **common))
        else:
            policy.observe(SkipLog(grad_l2_post_clip=math.nan, clipped=False, skip_reason="nonfinite_grad", **common))
    state = policy.state_dict()
    assert state["calibrator"] is not None and len(state["summaries"]) == 2  # a window open, two closed
    assert not math.isfinite(policy.summaries[0].tau_ci.high)  # 3 norms do not bound Quantile_0.99
    path = tmp_path / "trainer_state.json"
    TrainerState(
        stateful_callbacks={"ClipampCallback": {"args": {}, "attributes": {"p": to_json(state)}}}
    ).save_to_json(path)
    text = path.read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    back = from_json(TrainerState.load_from_json(path).stateful_callbacks["ClipampCallback"]["attributes"]["p"])
    restored = CalibratedClip(window=3, start=1, every=4, quantile=0.99, candidates=(0.5, 1.0), total_steps=20)
    restored.load_state_dict(back)
    assert repr(restored.state_dict()) == repr(state)
    assert repr(restored.summaries) == repr(policy.summaries) and restored.threshold == policy.threshold
    assert [s.predicted_clip_ratio for s in restored.summaries] == [s.predicted_clip_ratio for s in policy.summaries]


def test_a_checkpoint_with_several_callback_states_is_said():
    """Two ClipampCallbacks saved in one checkpoint: which state is whose cannot be told."""
    one, two = callback(False), callback(True)
    state = TrainerState(global_step=6, stateful_callbacks={"ClipampCallback": [one.state(), two.state()]})
    message = (
        r"^clipamp: resuming at step 6: the checkpoint holds the states of several ClipampCallbacks: the "
        r"calibration and the records start afresh at step 7$"
    )
    with pytest.warns(ResumeWarning, match=message):
        assert callback(False)._saved(state) is None
