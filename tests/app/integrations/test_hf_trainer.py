"""ClipampCallback inside a real, unmodified ``transformers.Trainer.train()`` on a tiny Llama."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

pytest.importorskip("transformers")
from datasets import Dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from sweep.integrations.hf_trainer import ClipampCallback

pytestmark = pytest.mark.slow  # each test trains a transformers.Trainer

V, T, REAL = 96, 16, 12  # vocab, sequence length, real (non -100) labels per row


def tiny_config(**kw):
    return AutoConfig.for_model(
        "llama",
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **kw,
    )


def tiny_llama(seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config())


def dataset(n: int = 64) -> Dataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (n, T), generator=g)
    labels = ids.clone()
    labels[:, REAL + 1 :] = -100  # REAL predicted tokens per row after the causal shift
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def args_for(tmp_path, steps: int, **kw) -> TrainingArguments:
    """Two micro-batches of 4 per step, a log line per step, on the CPU, nothing saved."""
    defaults = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "logging_steps": 1}
    defaults |= {"report_to": [], "use_cpu": True, "save_strategy": "no", "disable_tqdm": True}
    return TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, **(defaults | kw))


def trainer(tmp_path, callbacks, *, steps: int, max_grad_norm: float, seed: int = 0, **kw) -> Trainer:
    args = args_for(tmp_path, steps, learning_rate=3e-3, max_grad_norm=max_grad_norm, seed=seed, **kw)
    return Trainer(model=tiny_llama(seed), args=args, train_dataset=dataset(), callbacks=callbacks)


def test_records_trainers_own_norms_calibrates_and_applies(tmp_path, store):
    tau0, window, steps = 0.3, 4, 8
    cb = ClipampCallback(window=window, start=0, quantile=0.95, apply=True, tracking=store)
    t = trainer(tmp_path, [cb], steps=steps, max_grad_norm=tau0)
    t.train()
    assert t.args.max_grad_norm == tau0  # restored
    logged = [h for h in t.state.log_history if "grad_norm" in h]
    run_id = cb.tracker.run_id
    df = pd.read_csv(MlflowClient(store).download_artifacts(run_id, "steps.csv", str(tmp_path)))
    assert df["step"].tolist() == [h["step"] for h in logged] == list(range(1, steps + 1))
    # the pre-clip norm is the grad_norm Trainer logs; the loss is Trainer's (token mean over 2 micro-batches)
    np.testing.assert_allclose(df["grad_l2_pre_clip"], [h["grad_norm"] for h in logged], rtol=1e-6)
    np.testing.assert_allclose(df["loss"], [h["loss"] for h in logged], rtol=1e-5)
    assert (df["token_count"] == 2 * 4 * REAL).all()
    # window: clipped at the user's max_grad_norm like torch's clip_grad_norm_; then at the calibrated tau
    tau = np.quantile(df["grad_l2_pre_clip"][:window], 0.95)
    assert cb.summary.recommended_max_norm == pytest.approx(tau, rel=1e-9)
    expected_tau = [tau0] * window + [tau] * (steps - window)
    np.testing.assert_allclose(df["max_norm"], expected_tau, rtol=1e-9)
    pre = df["grad_l2_pre_clip"].to_numpy()
    np.testing.assert_allclose(
        df["grad_l2_post_clip"], pre * np.minimum(1, np.array(expected_tau) / (pre + 1e-6)), rtol=1e-5
    )
    assert list(df["phase"]) == ["calibrate"] * window + ["validate"] * (steps - window)
    m = MlflowClient(store).get_run(run_id).data.metrics
    assert m["recommended_max_norm"] == pytest.approx(tau, rel=1e-9)
    assert m["grad_norm_p95"] == pytest.approx(tau, rel=1e-9)
    assert m["clip_ratio"] == pytest.approx((pre[window:] > tau).mean())
    assert len(MlflowClient(store).get_metric_history(run_id, "grad_l2_pre_clip")) == steps


def test_clipping_is_trainers_own(tmp_path):
    """The callback's clip is Trainer's: the same parameters, bit for bit, after the same steps."""
    ours = trainer(
        tmp_path / "a", [ClipampCallback(window=6, start=0, tracking=None, verbose=False)], steps=3, max_grad_norm=0.3
    )
    ref = trainer(tmp_path / "b", [], steps=3, max_grad_norm=0.3)
    ours.train(), ref.train()
    for (n, p), (_, q) in zip(ours.model.named_parameters(), ref.model.named_parameters()):
        assert torch.equal(p, q), n
    moved = any(not torch.equal(p, q) for p, q in zip(ours.model.parameters(), tiny_llama().parameters()))
    assert moved


class SwitchMaxGradNorm(TrainerCallback):
    """A plain Trainer whose own max_grad_norm becomes ``tau`` after step ``at`` (the reference for apply=True)."""

    def __init__(self, at: int, tau: float) -> None:
        self.at, self.tau = at, tau

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            args.max_grad_norm = self.tau


def test_apply_equals_trainer_clipping_at_the_recommended_tau(tmp_path):
    """apply=True (CalibratedClip's τ: the user's max_grad_norm in the window, the window's Quantile_0.95
    after it) trains exactly (bit for bit) as Trainer clipping at max_grad_norm, then at that τ."""
    cb = ClipampCallback(
        window=3, start=0, quantile=0.95, apply=True, tracking=None, csv_path=tmp_path / "steps.csv", verbose=False
    )
    ours = trainer(tmp_path / "a", [cb], steps=6, max_grad_norm=0.3)
    ours.train()
    df = pd.read_csv(tmp_path / "steps.csv")
    tau = cb.summary.recommended_max_norm
    assert tau == pytest.approx(np.quantile(df["grad_l2_pre_clip"][:3], 0.95), rel=1e-9)
    assert (df["grad_l2_pre_clip"][3:] > tau).any()  # the calibrated τ clips some steps after the window
    ref = trainer(tmp_path / "b", [SwitchMaxGradNorm(3, tau)], steps=6, max_grad_norm=0.3)
    ref.train()
    for (n, p), (_, q) in zip(ours.model.named_parameters(), ref.model.named_parameters()):
        assert torch.equal(p, q), n


class NaNGradAt(TrainerCallback):
    """A NaN in one gradient during the backward of optimizer step ``at`` (1-based)."""

    def __init__(self, at: int) -> None:
        self.at, self.step, self.before = at, 0, None

    def on_train_begin(self, args, state, control, model=None, **kw):
        p = model.model.layers[0].mlp.up_proj.weight
        p.register_hook(lambda g: g.clone().index_fill_(0, torch.tensor([0]), math.nan) if self.step == self.at else g)

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.step = state.global_step + 1
        if self.step == self.at:
            self.before = [p.detach().clone() for p in model.parameters()]
            self.model = model

    def on_step_end(self, args, state, control, **kw):
        if self.step == self.at:
            self.unchanged = all(torch.equal(a, b) for a, b in zip(self.before, self.model.parameters()))


def test_nonfinite_gradient_is_skipped_not_applied(tmp_path):
    nan = NaNGradAt(3)
    cb = ClipampCallback(
        window=2, start=0, skip_nonfinite=True, tracking=None, csv_path=tmp_path / "steps.csv", verbose=False
    )
    t = trainer(tmp_path, [nan, cb], steps=5, max_grad_norm=1.0)
    t.train()
    df = pd.read_csv(tmp_path / "steps.csv")
    assert df["skipped"].tolist() == [False, False, True, False, False]
    assert df["skip_reason"][2] == "nonfinite_grad" and math.isnan(df["grad_l2_pre_clip"][2])
    assert nan.unchanged  # the update was refused: no parameter moved at step 3
    assert all(torch.isfinite(p).all() for p in t.model.parameters())


class StopAfter(TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at:
            control.should_training_stop = True


def test_a_run_stopped_inside_the_window_still_recommends_from_what_it_saw(tmp_path):
    cb = ClipampCallback(
        window=5, start=0, quantile=0.95, tracking=None, csv_path=tmp_path / "steps.csv", verbose=False
    )
    trainer(tmp_path, [cb, StopAfter(3)], steps=8, max_grad_norm=0.3).train()
    df = pd.read_csv(tmp_path / "steps.csv")
    assert df["step"].tolist() == [1, 2, 3] and (df["phase"] == "calibrate").all()
    assert (cb.summary.start_step, cb.summary.end_step) == (1, 3)
    assert cb.summary.recommended_max_norm == pytest.approx(np.quantile(df["grad_l2_pre_clip"], 0.95), rel=1e-9)


def test_a_cap_is_refused_naming_the_hosts_own_threshold(tmp_path):
    """The cap until the first window closes is max_grad_norm itself (with apply=True): a cap= beside it
    would be dropped silently."""
    with pytest.raises(ValueError, match=r"cap: the τ until the first window closes is the host's own"):
        ClipampCallback(apply=True, cap=0.5, tracking=None, csv_path=tmp_path / "s.csv")
    assert not (tmp_path / "s.csv").exists()


class StopAt(TrainerCallback):
    """``KeyboardInterrupt`` at the end of optimizer step ``at``, once: Ctrl-C in a notebook cell."""

    def __init__(self, at: int) -> None:
        self.at, self.fired = at, False

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.at and not self.fired:
            self.fired = True
            raise KeyboardInterrupt


def test_a_train_cut_short_then_run_again_is_the_same_run_as_without_the_callback(tmp_path, store):
    """The interrupted ``train()`` never reached ``on_train_end``: the next one must still clip at the
    user's τ (not at the norm-only τ left in ``args``), hook the forward once, and close the first run."""
    runs = []
    for callbacks in ([ClipampCallback(tracking=store, verbose=False)], []):
        t = trainer(tmp_path / str(len(runs)), [*callbacks, StopAt(3)], steps=5, max_grad_norm=0.3)
        with pytest.raises(KeyboardInterrupt):
            t.train()
        t.train()
        runs.append((t, callbacks))
    (ours, [cb]), (ref, _) = runs
    assert ours.args.max_grad_norm == ref.args.max_grad_norm == 0.3
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        assert torch.equal(p, q), name
    second = [h for h in ours.state.log_history if "grad_norm" in h][-5:]
    assert sum(h["grad_norm"] > 0.3 for h in second) >= 3  # the second train() clips: τ matters
    df = pd.read_csv(MlflowClient(store).download_artifacts(cb.tracker.run_id, "steps.csv", str(tmp_path)))
    assert df["step"].tolist() == list(range(1, 6)) and (df["max_norm"] == 0.3).all()
    np.testing.assert_allclose(df["loss"], [h["loss"] for h in second], rtol=1e-5)  # one hook, not two
    runs = MlflowClient(store).search_runs([cb.tracker.experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "KILLED"]


class LossFirstTuple(torch.nn.Module):
    """A model that computes its own loss and returns ``(loss, logits)``: Trainer reads ``outputs[0]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)

    def forward(self, x, labels=None):
        out = self.net(x)
        return (torch.nn.functional.mse_loss(out, labels), out)


class LoggedLoss(TrainerCallback):
    def __init__(self) -> None:
        self.loss: list[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and "train_loss" not in logs:
            self.loss.append(logs["loss"])


def test_a_tuple_loss_is_recorded_as_trainer_logs_it(tmp_path):
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    ds = Dataset.from_dict({"x": x.tolist(), "labels": x.sum(1, keepdim=True).tolist()})
    cb, logged = ClipampCallback(window=3, start=0, tracking=None, csv_path=tmp_path / "steps.csv"), LoggedLoss()
    Trainer(
        model=LossFirstTuple(),
        args=args_for(tmp_path, 4, remove_unused_columns=False),
        train_dataset=ds,
        callbacks=[logged, cb],
    ).train()
    df = pd.read_csv(tmp_path / "steps.csv")
    assert len(logged.loss) == 4 and np.isfinite(df["loss"]).all()  # was nan on every row
    np.testing.assert_allclose(df["loss"], logged.loss, rtol=1e-5)


def test_a_classifiers_token_count_is_trainers_count_of_its_labels(tmp_path):
    """Trainer counts a causal LM's labels after the shift and a classifier's one per example
    (``num_items_in_batch``); the record did the causal shift on every model (3 of 4 labels)."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config(num_labels=3, pad_token_id=0))
    g = torch.Generator().manual_seed(1)
    ds = Dataset.from_dict(
        {
            "input_ids": torch.randint(1, V, (32, T), generator=g).tolist(),
            "labels": torch.randint(0, 3, (32,), generator=g).tolist(),
        }
    )
    Trainer(
        model=model,
        args=args_for(tmp_path, 3),
        train_dataset=ds,
        callbacks=[ClipampCallback(window=2, start=0, tracking=None, csv_path=tmp_path / "steps.csv")],
    ).train()
    df = pd.read_csv(tmp_path / "steps.csv")
    assert (df["token_count"] == 4 * 2).all()  # 4 examples × 2 micro-batches
    np.testing.assert_allclose(df["grad_l2_token_normalised"], df["grad_l2_pre_clip"] * math.sqrt(8), rtol=1e-6)


class ExtraTerm(Trainer):
    """A ``compute_loss`` that trains on the model's loss plus a constant term, as an auxiliary loss would."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        loss = outputs.loss + 0.5
        return (loss, outputs) if return_outputs else loss


@pytest.mark.parametrize("cls", [Trainer, ExtraTerm])
def test_a_compute_loss_other_than_the_models_is_said_naming_both_losses(tmp_path, cls):
    """The ``loss`` column is the model's own loss; where Trainer trains on (and logs) another, one warning
    says so with both numbers. Trainer's own ``compute_loss``, logged every 2 steps with an evaluation
    in between, is not warned about."""
    cb = ClipampCallback(window=3, start=0, tracking=None, csv_path=tmp_path / "steps.csv", verbose=False)
    args = args_for(tmp_path, 4, gradient_accumulation_steps=1, logging_steps=2, eval_strategy="steps", eval_steps=1)
    t = cls(model=tiny_llama(), args=args, train_dataset=dataset(), eval_dataset=dataset(4), callbacks=[cb])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.train()
    said = [str(w.message) for w in caught if str(w.message).startswith("clipamp: Trainer logged loss")]
    logged = [h["loss"] for h in t.state.log_history if "loss" in h]
    mean = pd.read_csv(tmp_path / "steps.csv")["loss"].iloc[:2].mean()
    if cls is Trainer:
        assert said == [] and logged[0] == pytest.approx(mean, rel=1e-6)
        return
    assert logged[0] == pytest.approx(mean + 0.5, rel=1e-6)  # the rows are the model's own loss
    assert said == [
        f"clipamp: Trainer logged loss {logged[0]:.6g} for steps 1–2, and the model's own loss (outputs.loss), "
        f"which the steps.csv loss column records, averages {mean:.6g} over them: the loss trained on is not the "
        "model's (a compute_loss that adds terms to it or rescales it); the norms, the calibration and the clip "
        "are unaffected"
    ]
