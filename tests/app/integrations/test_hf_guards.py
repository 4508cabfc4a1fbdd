"""ClipampCallback in a few steps of a real ``transformers.Trainer``: a threshold that changes during the run,
the dtype the forward runs in, and the norm Trainer logs every N steps."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

pytest.importorskip("transformers")
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from sweep.integrations.hf_trainer import ClipampCallback
from sweep.recommend.readers import read_trainer_state

V, T = 64, 8
SCHEDULE = {1: 1.0, 2: 0.1, 3: 0.3, 4: 0.05}  # max_grad_norm of each step; the tiny model's norms are ~1–3


def tiny_llama(dtype=None):
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=T,
    )
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def fit(tmp_path, callbacks, *, steps: int = 4, model=None, **kw) -> Trainer:
    ids = torch.randint(0, V, (16, T), generator=torch.Generator().manual_seed(1))
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    options = {"per_device_train_batch_size": 2, "learning_rate": 1e-2, "logging_steps": 1, "max_grad_norm": 1.0}
    options |= {"report_to": [], "use_cpu": True, "save_strategy": "no", "disable_tqdm": True} | kw
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, **options)
    trainer = Trainer(model=model or tiny_llama(), args=args, train_dataset=ds, callbacks=callbacks)
    trainer.train()
    return trainer


class Schedule(TrainerCallback):
    """A schedule on the threshold: ``max_grad_norm`` of each step set at its ``on_step_begin``."""

    def __init__(self, taus: dict[int, float]) -> None:
        self.taus = taus

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 in self.taus:
            args.max_grad_norm = self.taus[state.global_step + 1]


def logged(trainer: Trainer, key: str) -> dict[int, float]:
    return {e["step"]: e[key] for e in trainer.state.log_history if key in e}


def test_a_schedule_set_before_the_callback_is_recorded_and_clipped_at(tmp_path):
    """A callback before ClipampCallback that schedules ``max_grad_norm``: the CSV's pre-clip norms are those
    Trainer logs in the same run without the callback, its ``max_norm`` the schedule, the parameters equal."""
    reference = fit(tmp_path / "ref", [Schedule(SCHEDULE)])
    csv = tmp_path / "steps.csv"
    ours = fit(tmp_path / "cb", [Schedule(SCHEDULE), ClipampCallback(tracking=None, csv_path=csv, verbose=False)])
    rows = pd.read_csv(csv)
    assert rows["grad_l2_pre_clip"].tolist() == pytest.approx(list(logged(reference, "grad_norm").values()), 1e-6)
    assert min(rows["grad_l2_pre_clip"]) > max(SCHEDULE.values())  # every step clipped: a clipped norm would show
    assert rows["max_norm"].tolist() == list(SCHEDULE.values())
    for a, b in zip(reference.model.parameters(), ours.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert ours.args.max_grad_norm == SCHEDULE[4] and type(ours.args.max_grad_norm) is float


class Late(TrainerCallback):
    """Sets ``max_grad_norm`` at step 3's ``on_step_begin``, placed after ClipampCallback."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 2:
            args.max_grad_norm = 0.3


def test_a_threshold_changed_after_the_callbacks_step_begin_is_refused_before_its_record(tmp_path, store):
    """Refused at step 3, with the steps before it recorded and the MLflow run ended as FAILED."""
    with pytest.raises(ValueError) as e:
        fit(tmp_path, [ClipampCallback(tracking=store, verbose=False), Late()])
    assert str(e.value) == (
        "clipamp: args.max_grad_norm was changed to 0.3 during step 3, after ClipampCallback.on_step_begin: Trainer "
        "clipped with the new value before the callback measured the gradients, so it would record clipped norms "
        "as pre-clip ones; change max_grad_norm in on_step_begin of a callback placed before ClipampCallback "
        "(Trainer(callbacks=[your_callback, ClipampCallback()])): the callback then records the norms before the "
        "clip and clips at your value"
    )
    client = MlflowClient(store)
    [run] = client.search_runs([x.experiment_id for x in client.search_experiments()])
    assert run.info.status == "FAILED"
    assert pd.read_csv(client.download_artifacts(run.info.run_id, "steps.csv", str(tmp_path)))["step"].tolist() == [
        1,
        2,
    ]


def test_a_schedule_with_apply_is_refused(tmp_path):
    csv = tmp_path / "steps.csv"
    with pytest.raises(ValueError) as e:
        fit(tmp_path, [Schedule(SCHEDULE), ClipampCallback(apply=True, tracking=None, csv_path=csv, verbose=False)])
    assert str(e.value) == (
        "clipamp: args.max_grad_norm was changed from 1.0 to 0.1 before step 2, and ClipampCallback(apply=True) "
        "clips at its own τ (your max_grad_norm only until the calibration window closes), so the new value would "
        "never be applied; drop the change, or use apply=False to clip at your schedule and record the norms "
        "under it"
    )
    assert pd.read_csv(csv)["step"].tolist() == [1]


@pytest.mark.parametrize(
    ("precision", "weights", "expected"),
    [("fp32", None, "fp32"), ("bf16", None, "bf16"), ("fp16", None, "fp32"), ("fp32", torch.bfloat16, "bf16")],
)
def test_the_dtype_tag_is_what_the_forward_computes_in(tmp_path, store, precision, weights, expected):
    """The ``dtype`` tag against what a hook inside the forward sees: autocast's dtype where it is on (``fp16`` on
    a CPU: off), else the weights' dtype (a model loaded in bf16 and trained so)."""
    seen = []
    model = tiny_llama(weights)
    model.model.embed_tokens.register_forward_pre_hook(
        lambda m, a: seen.append(
            torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else m.weight.dtype
        )
    )
    cb = ClipampCallback(tracking=store, verbose=False)
    fit(tmp_path, [cb], steps=1, model=model, **({} if precision == "fp32" else {precision: True}))
    ran = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[seen[0]]
    assert MlflowClient(store).get_run(cb.tracker.run_id).data.tags["dtype"] == ran == expected
    hooked = [name for name, m in model.named_modules() if m._forward_pre_hooks]
    assert hooked == ["model.embed_tokens"]  # the test's own: the callback's went at the first forward


def test_trainers_logged_grad_norm_is_its_logging_steps_own_norm(tmp_path):
    """What ``sweep.recommend`` says of a ``trainer_state.json`` logged every N steps: ``grad_norm`` is the pre-clip
    norm of the logging step itself (the CSV's row of that step), not a mean over the interval, as ``loss`` is."""
    csv = tmp_path / "steps.csv"
    trainer = fit(tmp_path, [ClipampCallback(tracking=None, csv_path=csv, verbose=False)], steps=6, logging_steps=3)
    rows = pd.read_csv(csv).set_index("step")
    norms, losses = logged(trainer, "grad_norm"), logged(trainer, "loss")
    assert list(norms) == [3, 6]
    assert norms == {s: pytest.approx(rows.loc[s, "grad_l2_pre_clip"], rel=1e-6) for s in norms}
    assert not math.isclose(norms[6], rows.loc[4:6, "grad_l2_pre_clip"].mean(), rel_tol=1e-3)
    assert losses[6] == pytest.approx(rows.loc[4:6, "loss"].mean(), rel=1e-5)


@pytest.mark.parametrize(
    ("strategy", "note"), [("steps", ""), ("epoch", ", not the log's interval: its norms are 4 steps apart")]
)
def test_recommend_says_the_interval_of_a_trainer_state_logged_each_epoch(tmp_path, strategy, note):
    """``logging_strategy="epoch"`` logs at each epoch's end (every 4 steps here) and the state keeps
    ``logging_steps=500``: the note says the log's own interval beside it."""
    n = 4 if strategy == "steps" else 500
    trainer = fit(tmp_path, [], steps=8, per_device_train_batch_size=4, logging_strategy=strategy, logging_steps=n)
    trainer.save_state()  # output_dir/trainer_state.json
    series = read_trainer_state(tmp_path / "out" / "trainer_state.json")
    assert list(series.steps) == [4, 8] and series.interval == 4
    assert f"Trainer logging_steps={n} (from the state){note}" in series.notes
