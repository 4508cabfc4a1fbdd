"""``ClipampAccelerate`` across ``accelerator.save_state`` / ``load_state``: a loop killed after its
checkpoint and resumed from it (a new process's objects) calibrates and records as the loop that never
stopped."""

from __future__ import annotations

import math

import pytest
import torch
from mlflow import MlflowClient

accelerate = pytest.importorskip("accelerate")

from sweep.integrations.accelerate import ClipampAccelerate  # noqa: E402
from sweep.integrations.resume import ResumeWarning  # noqa: E402
from tests.app.integrations.test_dropin_accelerate import backward  # noqa: E402
from tests.engine.nanogpt_shaped import NanoGPTShaped, batches, configure_optimizers  # noqa: E402

SIZE = dict(vocab=32, block=8, d=16, n_layer=1, n_head=2)
STEPS, SAVE, KILL, TAU, ACCUMULATION = 12, 6, 8, 0.25, 2
OPTIONS = dict(window=4, quantile=0.95)


def loop(root, make_clipamp, *, kill=False, load=False, register=True):
    """A bf16 loop of STEPS optimizer steps (accumulation 2) clipping at TAU, with ``make_clipamp(accelerator)``
    as its clip call (``None``: ``accelerator.clip_grad_norm_``). ``kill``: ``save_state`` after step SAVE,
    stopped after step KILL. ``load``: resumed from that checkpoint (new objects, the first SAVE steps'
    batches skipped). Returns (model, the ClipampAccelerate)."""
    from accelerate import Accelerator

    accelerate.state.AcceleratorState._reset_state(True)
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=ACCUMULATION, cpu=True)
    torch.manual_seed(0)
    model = NanoGPTShaped(**SIZE)
    optimizer = configure_optimizers(model)
    data = batches(ACCUMULATION * STEPS, batch=4, block=SIZE["block"], vocab=SIZE["vocab"])
    model, optimizer = accelerator.prepare(model, optimizer)
    clipamp = make_clipamp(accelerator)
    if clipamp is not None and register:
        accelerator.register_for_checkpointing(clipamp)
    step = 0
    if load:
        accelerator.load_state(str(root / "ckpt"))
        step, data = SAVE, data[ACCUMULATION * SAVE :]
    for x, y in data:
        with accelerator.accumulate(model):
            loss = backward(accelerator, model, x, y)
            if accelerator.sync_gradients:
                (clipamp or accelerator).clip_grad_norm_(model.parameters(), TAU)
            optimizer.step()
            optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if clipamp is not None:
                    clipamp.step_end(loss)
                if kill and step == SAVE:
                    accelerator.save_state(str(root / "ckpt"))
                if kill and step == KILL:
                    return model, clipamp  # killed: end() never called
    if clipamp is not None:
        clipamp.end()
    return model, clipamp


def same_parameters(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def window(clipamp: ClipampAccelerate):
    s = clipamp.summary
    return s.start_step, s.end_step, s.recommended_max_norm, repr(clipamp.policy.checks())


@pytest.mark.slow  # three accelerate loops: uninterrupted, stopped, resumed
@pytest.mark.parametrize("apply", [False, True])
def test_a_resumed_loop_calibrates_and_records_as_the_loop_that_never_stopped(tmp_path, apply):
    """Window, τ, checks, every steps.csv row (1–6 kept, the killed loop's 7–8 replaced) and the parameters
    equal the uninterrupted loop's."""

    def make(csv):
        return lambda acc: ClipampAccelerate(
            acc, total_steps=STEPS, apply=apply, tracking=None, csv_path=csv, verbose=False, **OPTIONS
        )

    ref_model, ref = loop(tmp_path / "ref", make(tmp_path / "ref.csv"))
    csv = tmp_path / "steps.csv"
    loop(tmp_path, make(csv), kill=True)
    assert len(csv.read_text().splitlines()) == 1 + KILL
    model, resumed = loop(tmp_path, make(csv), load=True)
    assert SAVE < ref.summary.end_step  # the checkpoint was taken before the window closed
    assert window(resumed) == window(ref)
    assert csv.read_text() == (tmp_path / "ref.csv").read_text()
    assert same_parameters(ref_model, model)


@pytest.mark.slow  # an accelerate loop stopped and resumed
def test_a_resumed_loop_continues_its_mlflow_run(tmp_path, store):
    """One run, FINISHED, each step's metrics once."""

    def make(acc):
        return ClipampAccelerate(acc, total_steps=STEPS, apply=True, tracking=store, verbose=False, **OPTIONS)

    loop(tmp_path, make, kill=True)
    _, clipamp = loop(tmp_path, make, load=True)
    client = MlflowClient(store)
    [run] = client.search_runs([clipamp.recorder.tracker.experiment_id])
    assert run.info.run_id == clipamp.recorder.tracker.run_id and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "grad_l2_pre_clip")
    assert sorted(m.step for m in history) == list(range(1, STEPS + 1))
    assert all(math.isfinite(m.value) for m in history)


def test_other_calibration_options_are_refused(tmp_path):
    """A resume asking window=5 of a checkpoint calibrated with window=4 stops at its first clip call,
    the killed loop's CSV as it was."""
    csv = tmp_path / "steps.csv"

    def options(**o):
        def make(acc):
            return ClipampAccelerate(
                acc, total_steps=STEPS, tracking=None, csv_path=csv, verbose=False, **{**OPTIONS, **o}
            )

        return make

    loop(tmp_path, options(), kill=True)
    before = csv.read_bytes()
    message = (
        r"the checkpoint at step 6 was calibrated with other options \(window=4 there, window=5 here\): "
        r"resume with the checkpoint's calibration options, or train from the start"
    )
    with pytest.raises(ValueError, match=message):
        loop(tmp_path, options(window=5), load=True)
    assert csv.read_bytes() == before


def test_a_load_state_that_does_not_restore_it_is_said(tmp_path):
    """A loop that never registers it saves and loads without its state: the load says so in one line,
    and the records start afresh."""
    csv = tmp_path / "steps.csv"

    def make(acc):
        return ClipampAccelerate(acc, total_steps=STEPS, tracking=None, csv_path=csv, verbose=False, **OPTIONS)

    loop(tmp_path, make, kill=True, register=False)
    message = (
        r"^clipamp: accelerator.load_state\('.*ckpt'\) does not restore ClipampAccelerate \(not registered for "
        r"checkpointing\): the calibration and the records start afresh at step 1, not from the checkpoint; call "
        r"accelerator.register_for_checkpointing\(clipamp\) before save_state and load_state$"
    )
    with pytest.warns(ResumeWarning, match=message):
        _, clipamp = loop(tmp_path, make, load=True, register=False)
    assert [r["step"] for r in clipamp.recorder.records.rows] == list(range(1, STEPS - SAVE + 1))
