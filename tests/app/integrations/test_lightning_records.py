"""The Lightning ``ClipampCallback``'s records of the steps Lightning takes in its own ways: the loss of a step
that accumulates fewer micro-batches, manual accumulation, the fit's length, skipped steps."""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import GradientAccumulationScheduler  # noqa: E402

from sweep.integrations.lightning import ClipampCallback  # noqa: E402


class Tiny(L.LightningModule):
    """A linear regression that notes each batch's loss under the optimizer step it goes into."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 1)
        self.losses: dict[int, list[float]] = {}

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.net(batch[0]), batch[1])
        self.losses.setdefault(self.trainer.global_step + 1, []).append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader(batches: int) -> torch.utils.data.DataLoader:
    torch.manual_seed(0)
    x = torch.randn(8 * batches, 8)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def fit(tmp_path, module, data, callbacks=(), **trainer) -> L.Trainer:
    """A quiet CPU fit of ``module`` on ``data`` (a ``DataLoader``, or that many batches of 8)."""
    t = L.Trainer(
        accelerator="cpu",
        devices=1,
        callbacks=list(callbacks),
        default_root_dir=str(tmp_path),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer,
    )
    t.fit(module, loader(data) if isinstance(data, int) else data)
    return t


def callback(tmp_path, **kw) -> ClipampCallback:
    return ClipampCallback(tracking=None, csv_path=tmp_path / "steps.csv", verbose=False, **kw)


def means(module) -> list[float]:
    return [sum(v) / len(v) for _, v in sorted(module.losses.items())]


def test_a_step_the_epoch_end_cuts_short_records_the_mean_of_its_micro_batches(tmp_path):
    """10 batches an epoch, accumulate_grad_batches=3: steps 4 and 8 accumulate one micro-batch each (Lightning
    still divides its loss by 3); every step's loss is the mean of the losses of the micro-batches it ran."""
    module = Tiny()
    fit(tmp_path, module, 10, [callback(tmp_path, window=3, start=0)], max_epochs=2, accumulate_grad_batches=3)
    assert [len(v) for _, v in sorted(module.losses.items())] == [3, 3, 3, 1] * 2
    df = pd.read_csv(tmp_path / "steps.csv")
    assert df["loss"].tolist() == pytest.approx(means(module), rel=1e-6)


class Clipping(Tiny):
    """Notes each optimizer step's gradient norm (before Lightning's clip) and the τ Lightning clips it at."""

    def __init__(self):
        super().__init__()
        self.norms: list[float] = []
        self.taus: list[float] = []

    def on_before_optimizer_step(self, optimizer) -> None:
        self.norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])))

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        self.taus.append(gradient_clip_val)
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)


ACCUMULATIONS = {  # the accumulation (callbacks, Trainer argument), batches an epoch, each step's micro-batches
    "scheduler": (lambda: [GradientAccumulationScheduler({0: 1, 2: 3})], {}, 6, [1] * 12 + [3] * 4),
    "epoch_end": (list, dict(accumulate_grad_batches=3), 7, [3, 3, 1] * 4),
}


@pytest.mark.parametrize("how", ACCUMULATIONS)
def test_accumulation_that_changes_or_ends_an_epoch_short_is_recorded_step_by_step(tmp_path, how):
    """4 epochs with ``GradientAccumulationScheduler({0: 1, 2: 3})`` (6 batches an epoch: 6+6+2+2 = 16 steps) or
    ``accumulate_grad_batches=3`` (7 batches an epoch: steps of 3, 3, 1). The calibration is told the steps the
    fit takes (Lightning's ``estimated_stepping_batches`` says 24 under the scheduler: it counts every epoch at
    the factor in force when the fit starts, 1), so a window of 4 placed after the transient closes within
    the fit. One row per optimizer step: its pre-clip norm the module's own (before Lightning's clip), its
    loss the mean of its micro-batches; the fit is the fit without the callback. ``apply=True``: Lightning
    clips at ``gradient_clip_val`` up to the window's end, at the calibrated τ after, as the rows say."""
    accumulation, kw, batches, micro = ACCUMULATIONS[how]
    kw = dict(kw, max_epochs=4, gradient_clip_val=0.5)
    ref, ours, applied = Clipping(), Clipping(), Clipping()
    fit(tmp_path / "ref", ref, batches, accumulation(), **kw)
    cb = callback(tmp_path / "a", window=4)
    trainer = fit(tmp_path / "a", ours, batches, [*accumulation(), cb], **kw)
    steps = len(micro)
    assert trainer.global_step == steps and cb.policy.total_steps == steps
    assert [len(v) for _, v in sorted(ours.losses.items())] == micro
    df = pd.read_csv(tmp_path / "a" / "steps.csv")
    assert df["step"].tolist() == list(range(1, steps + 1))
    assert df["grad_l2_pre_clip"].tolist() == pytest.approx(ref.norms, rel=1e-6)
    assert df["loss"].tolist() == pytest.approx(means(ours), rel=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))
    assert cb.summary is not None and cb.summary.end_step < steps
    cb = callback(tmp_path / "b", window=4, apply=True)
    fit(tmp_path / "b", applied, batches, [*accumulation(), cb], **kw)
    end, tau = cb.summary.end_step, cb.summary.recommended_max_norm
    assert applied.taus == [0.5] * end + [tau] * (steps - end)
    df = pd.read_csv(tmp_path / "b" / "steps.csv")
    assert df["max_norm"].tolist() == pytest.approx(applied.taus)
    assert df["grad_l2_pre_clip"].tolist() == pytest.approx(applied.norms, rel=1e-6)


class ManualAccumulation(Tiny):
    """Lightning's manual accumulation: backward every batch, ``opt.step()`` every ``N``-th."""

    N = 2

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss / self.N)
        if (batch_idx + 1) % self.N == 0:
            opt.step()
            opt.zero_grad()
        return loss


def test_manual_accumulation_records_the_mean_of_the_batches_of_a_step(tmp_path):
    """Each of the 4 steps accumulates two batches: its loss is their mean, as under automatic optimization."""
    module = ManualAccumulation()
    fit(tmp_path, module, 8, [callback(tmp_path, max_norm=1.0, window=3, start=0)], max_steps=4)
    assert [len(v) for _, v in sorted(module.losses.items())] == [2] * 4
    df = pd.read_csv(tmp_path / "steps.csv")
    assert df["loss"].tolist() == pytest.approx(means(module), rel=1e-6)


class StopAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        trainer.should_stop = trainer.global_step >= self.step


class Stream(torch.utils.data.IterableDataset):
    """12 batches of 8 with no length: Lightning cannot count an epoch's steps."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(12):
            x = torch.randn(8, 8, generator=g)
            yield x, x.sum(1, keepdim=True)


@pytest.mark.parametrize(
    "limits,steps,total",
    [
        (dict(max_epochs=1), 40, 40),
        (dict(max_steps=1000, max_epochs=1), 40, 40),  # the epoch ends first
        (dict(max_steps=25, max_epochs=1), 25, 25),
        (dict(max_steps=25), 25, 25),
        (dict(max_epochs=-1, callbacks=[StopAt(12)]), 12, None),  # no limit: unknown
        (dict(max_epochs=1, data=torch.utils.data.DataLoader(Stream(), batch_size=None)), 12, None),
    ],
    ids=["max_epochs", "max_steps_beyond_max_epochs", "max_steps_within", "max_steps", "no_limit", "iterable"],
)
def test_the_calibration_is_told_the_steps_the_fit_takes(tmp_path, limits, steps, total):
    """The run length the window is placed in is Lightning's ``estimated_stepping_batches``: max_steps or
    max_epochs, whichever ends the fit first; ``None`` (unknown) for a fit without a limit or an epoch
    without a length. 40 batches an epoch, a window of 10 placed after the transient: it closes in a
    40-step fit however the 40 steps are asked for."""
    limits = dict(limits)
    data, stop = limits.pop("data", 40), limits.pop("callbacks", [])
    cb = callback(tmp_path, window=10)
    trainer = fit(tmp_path, Tiny(), data, [cb, *stop], **limits)
    assert trainer.global_step == steps and cb.policy.total_steps == total
    if steps == 40:
        assert cb.summary is not None and cb.summary.end_step < 40


class Noting(Tiny):
    """Notes the parameters after each optimizer step."""

    def __init__(self):
        super().__init__()
        self.weights: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_end(self, *args) -> None:
        self.weights[self.trainer.global_step] = [p.detach().clone() for p in self.parameters()]

    def unchanged(self) -> list[bool]:
        """Per step from 2: whether the step left the parameters as they were."""
        w = self.weights
        return [all(torch.equal(p, q) for p, q in zip(w[s], w[s - 1])) for s in range(2, max(w) + 1)]


class Overflow(Noting):
    """An inf loss at step ``at``: every gradient inf/NaN, the GradScaler skips the step."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.trainer.global_step + 1 == self.at else loss


def fp16():
    """``16-mixed`` as Lightning runs it on CUDA (its ``MixedPrecision`` plugin and a ``GradScaler``), on CPU."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))


def fp16_fit(tmp_path, callbacks, steps=6, at=3):
    module = Overflow(at)
    fit(tmp_path, module, steps, callbacks, max_steps=steps, plugins=[fp16()], gradient_clip_val=1.0)
    return module


def test_a_step_the_grad_scaler_skips_is_recorded_skipped(tmp_path):
    """The rows say skipped exactly where Lightning's step left the parameters as they were (step 3, the scale
    backing off from 256 to 128 after it); that step stays out of the window; the fit is the fit without
    the callback."""
    cb = callback(tmp_path, window=4, start=0)
    ours = fp16_fit(tmp_path / "a", [cb])
    ref = fp16_fit(tmp_path / "b", [])
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))
    assert ours.unchanged() == [False, True, False, False, False]
    df = pd.read_csv(tmp_path / "steps.csv")
    assert df["skipped"].tolist() == [False, False, True, False, False, False]
    assert df["skip_reason"].fillna("").tolist() == ["", "", "nonfinite_grad", "", "", ""]
    assert df["scaler_scale"].tolist() == [256.0] * 3 + [128.0] * 3
    assert (cb.summary.n_finite, cb.summary.n_skipped) == (3, 1)


class NoLoss(Noting):
    """``training_step`` returns ``None`` (Lightning: skip this batch) for the batches in ``none``."""

    def __init__(self, none: set[int]):
        super().__init__()
        self.none = none

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx in self.none else loss


@pytest.mark.parametrize("precision", ["32", "16-mixed"])
def test_a_step_without_a_loss_is_recorded_skipped_and_kept_out_of_the_window(tmp_path, precision):
    """``training_step`` returns ``None`` at batches 2 and 3: Lightning counts steps 3 and 4 (global_step 8 after
    8 batches) but they leave the parameters as they were (no backward: no gradient). Their rows say skipped,
    ``no_loss``, norms and loss NaN; the window (steps 1-4) holds the norms of steps 1 and 2 only; the fit is
    the fit without the callback."""
    kw = dict(max_epochs=1, gradient_clip_val=1.0, plugins=[fp16()] if precision == "16-mixed" else [])
    cb = callback(tmp_path, window=4, start=0)
    ours = NoLoss({2, 3})
    trainer = fit(tmp_path / "a", ours, 8, [cb], **kw)
    ref = NoLoss({2, 3})
    fit(tmp_path / "b", ref, 8, **{**kw, "plugins": [fp16()] if precision == "16-mixed" else []})
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), ref.parameters()))
    assert trainer.global_step == 8 and ours.unchanged() == [False, True, True, False, False, False, False]
    df = pd.read_csv(tmp_path / "steps.csv")
    assert df["skipped"].tolist() == [False, False, True, True] + [False] * 4
    assert df["skip_reason"].fillna("").tolist() == ["", ""] + ["no_loss"] * 2 + [""] * 4
    rows = df.iloc[2:4]
    assert rows[["grad_l2_pre_clip", "grad_l2_post_clip", "loss"]].isna().all().all()
    assert (cb.summary.n_finite, cb.summary.n_skipped) == (2, 2)
    assert cb.summary.quantiles["max"] == df["grad_l2_pre_clip"][:2].max()


def test_a_step_with_a_loss_in_some_micro_batches_is_taken(tmp_path):
    """Accumulating 2: step 2's first micro-batch returns ``None``, its second a loss, whose gradient the step
    applies: taken, its loss that batch's."""
    module = NoLoss({2})
    fit(tmp_path, module, 8, [callback(tmp_path, window=3, start=0)], max_epochs=1, accumulate_grad_batches=2)
    df = pd.read_csv(tmp_path / "steps.csv")
    assert not df["skipped"].any() and df["grad_l2_pre_clip"].gt(0).all()
    assert df["loss"][1] == pytest.approx(module.losses[2][1], rel=1e-6)


class TwoStepsPerBatch(Tiny):
    """Manual optimization with two ``opt.step()`` per batch (one per half), noting each step's pre-clip norm."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.norms: list[float] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for half in (slice(0, 4), slice(4, 8)):
            loss = F.mse_loss(self.net(batch[0][half]), batch[1][half])
            opt.zero_grad()
            self.manual_backward(loss)
            self.norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])))
            opt.step()
        return loss


def test_every_opt_step_of_a_batch_is_recorded(tmp_path):
    """Each of the 12 steps (2 per batch) is a row with its own norm, and the window of steps 1–5 closes;
    a step's loss is known at its batch's end: the last step of a batch has it, an earlier one NaN."""
    module, cb = TwoStepsPerBatch(), callback(tmp_path, window=5, start=0)
    trainer = fit(tmp_path, module, 6, [cb], max_epochs=1)
    df = pd.read_csv(tmp_path / "steps.csv")
    assert trainer.global_step == 12 and df["step"].tolist() == list(range(1, 13))
    assert df["grad_l2_pre_clip"].tolist() == pytest.approx(module.norms, rel=1e-6)
    assert df["loss"][::2].isna().all() and df["loss"][1::2].notna().all()
    assert (cb.summary.start_step, cb.summary.end_step) == (1, 5)


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_the_dtype_tag_is_what_the_forward_ran_in(tmp_path, store, precision):
    """``dtype`` (the report's and the MLflow view's column, which read '—' for a Lightning run) is the dtype
    autocast ran the forward in, seen from inside it; ``precision`` stays Lightning's setting."""
    from mlflow import MlflowClient

    seen = []
    module = Tiny()
    module.net.register_forward_pre_hook(
        lambda m, a: seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
    )
    cb = ClipampCallback(tracking=store, csv_path=tmp_path / "steps.csv", verbose=False)
    fit(tmp_path, module, 2, [cb], max_steps=2, precision=precision)
    ran = {torch.bfloat16: "bf16", torch.float16: "fp16", None: "fp32"}[seen[0]]
    tags = MlflowClient(store).get_run(cb.recorder.tracker.run_id).data.tags
    assert (tags["dtype"], tags["precision"]) == (ran, precision)


class InWeightsDtype(Tiny):
    """``Tiny`` fed in its weights' dtype (a model loaded in bf16), its loss in fp32."""

    def training_step(self, batch, batch_idx):
        x = batch[0].to(self.net.weight.dtype)
        return F.mse_loss(self.net(x).float(), batch[1])


@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float32])
def test_the_dtype_tag_follows_the_weights_a_32_bit_fit_leaves_alone(tmp_path, store, weights):
    """``32-true`` casts neither the module nor the inputs: a model whose weights are bf16 computes in bf16, and its
    ``dtype`` tag says so (the dtype of the layer's output, seen by a hook, is the reference)."""
    from mlflow import MlflowClient

    out = []
    module = InWeightsDtype()
    module.net.to(weights)
    module.net.register_forward_hook(lambda m, a, y: out.append(y.dtype))
    cb = ClipampCallback(tracking=store, csv_path=tmp_path / "steps.csv", verbose=False)
    fit(tmp_path, module, 2, [cb], max_steps=2, precision="32-true")
    tags = MlflowClient(store).get_run(cb.recorder.tracker.run_id).data.tags
    assert out[0] == weights
    assert (tags["dtype"], tags["precision"]) == ({torch.bfloat16: "bf16"}.get(weights, "fp32"), "32-true")
    assert not module.net._forward_pre_hooks  # the dtype's one-shot hooks are gone


@pytest.mark.parametrize(
    "limits",
    [dict(max_epochs=1), dict(max_steps=1000, max_epochs=1), dict(max_steps=12)],
    ids=["max_epochs", "max_steps_beyond_max_epochs", "max_steps"],
)
def test_the_advice_to_lengthen_the_fit_names_the_argument_that_lengthens_it(tmp_path, capsys, limits):
    """A 12-step fit leaves a 10-step window no room to wait for the norms: the placement says to raise the
    run's length, naming the ``Trainer`` argument that ends this fit. Doubling that argument, as a user does
    next, doubles the fit (where the epochs end it, a higher ``max_steps`` would change nothing)."""
    first = fit(
        tmp_path, Tiny(), 12, [ClipampCallback(tracking=None, csv_path=tmp_path / "a.csv", window=10)], **limits
    )
    said = re.search(r"raise (\w+)=N to let start='auto' wait", capsys.readouterr().out)
    assert said and said.group(1) in limits, (said, limits)
    name = said.group(1)
    longer = fit(tmp_path, Tiny(), 12, [callback(tmp_path, window=10)], **{**limits, name: 2 * limits[name]})
    assert longer.global_step == 24 and first.global_step == 12
