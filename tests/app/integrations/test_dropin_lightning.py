"""The Lightning ``ClipampCallback``: ``apply=False`` leaves a fit bit-identical; ``apply=True`` clips as
Lightning would."""

from __future__ import annotations

import signal

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from mlflow import MlflowClient

L = pytest.importorskip("lightning")

from lightning.pytorch.utilities import grad_norm  # noqa: E402

from sweep.integrations.lightning import ClipampCallback  # noqa: E402
from tests.engine.nanogpt_shaped import NanoGPTShaped, batches, configure_optimizers  # noqa: E402

SIZE = dict(vocab=32, block=8, d=16, n_layer=1, n_head=2)


class LitGPT(L.LightningModule):
    """nanoGPT-shaped, two AdamW groups (decay first): Lightning clips in that group order."""

    def __init__(self):
        super().__init__()
        self.model = NanoGPTShaped(**SIZE)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits, _ = self.model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self):
        return configure_optimizers(self.model)


def _loader(steps, accumulate):
    data = batches(steps * accumulate, batch=4, block=SIZE["block"], vocab=SIZE["vocab"])
    x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False)


def quiet_trainer(root, callbacks, steps, **kw) -> L.Trainer:
    """A CPU ``Trainer`` of ``steps`` optimizer steps that writes nothing but what the callbacks write."""
    return L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def fit(tmp_path, callbacks, steps, tau, accumulate=2):
    """One fit; returns (module, the norms Lightning's clip_grad_norm_ computed)."""
    torch.manual_seed(0)
    module = LitGPT()
    trainer = quiet_trainer(
        tmp_path, callbacks, steps, precision="bf16-mixed", accumulate_grad_batches=accumulate, gradient_clip_val=tau
    )
    norms, clip = [], torch.nn.utils.clip_grad_norm_

    def spy(*args, **kw):
        norms.append(clip(*args, **kw))
        return norms[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.utils, "clip_grad_norm_", spy)
        trainer.fit(module, _loader(steps, accumulate))
    return module, [float(n) for n in norms]


def _compare(tmp_path, steps, tau):
    cb = ClipampCallback(tracking=None, csv_path=tmp_path / "steps.csv", verbose=False)
    ours, ours_norms = fit(tmp_path / "a", [cb], steps, tau)
    ref, ref_norms = fit(tmp_path / "b", [], steps, tau)
    assert len(ref_norms) == steps and ours_norms == ref_norms  # Lightning's own norm, every step
    assert sum(n > tau for n in ref_norms) > steps / 2  # most steps clip
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), name
    df = pd.read_csv(tmp_path / "steps.csv")
    assert df["step"].tolist() == list(range(1, steps + 1))
    assert df["grad_l2_pre_clip"].tolist() == ref_norms  # the callback's pre-clip norm is Lightning's
    return cb, df


def test_apply_false_changes_nothing_in_a_short_bf16_fit(tmp_path):
    _compare(tmp_path, steps=6, tau=0.25)


@pytest.mark.slow  # two 60-step fits
def test_apply_false_changes_nothing_in_a_60_step_bf16_accumulated_fit(tmp_path):
    cb, df = _compare(tmp_path, steps=60, tau=0.25)
    assert df["loss"].notna().all()


def test_apply_true_clips_at_the_users_tau_then_at_the_calibrated_one(tmp_path):
    """In the window the callback's clip is Lightning's (bit for bit); after it, τ = the window's quantile."""
    steps, window, tau0 = 8, 4, 0.25
    cb = ClipampCallback(
        apply=True, window=window, start=0, quantile=0.95, tracking=None, csv_path=tmp_path / "s.csv", verbose=False
    )
    ours, _ = fit(tmp_path / "a", [cb], window, tau0)
    ref, _ = fit(tmp_path / "b", [], window, tau0)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), ours.parameters()))
    cb = ClipampCallback(
        apply=True, window=window, start=0, quantile=0.95, tracking=None, csv_path=tmp_path / "s.csv", verbose=False
    )
    fit(tmp_path / "c", [cb], steps, tau0)
    df = pd.read_csv(tmp_path / "s.csv")
    tau = cb.summary.recommended_max_norm
    assert tau == pytest.approx(df["grad_l2_pre_clip"][:window].quantile(0.95), rel=1e-9)
    assert df["max_norm"].tolist() == [tau0] * window + [tau] * (steps - window)
    assert df["phase"].tolist() == ["calibrate"] * window + ["validate"] * (steps - window)


class Watched(LitGPT):
    """Logs its total gradient norm in its own ``on_before_optimizer_step``, as Lightning's docs show."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_before_optimizer_step(self, optimizer):
        self.seen.append(float(grad_norm(self, norm_type=2)["grad_2.0_norm_total"]))


def test_apply_true_leaves_the_modules_own_grad_norm_log_pre_clip(tmp_path):
    """The module's hook sees the gradients before the clip, as without the callback: in the window the
    norms it logs are those of the fit with Lightning's own clip; every step, the steps.csv pre-clip norm."""
    steps, window, tau0 = 8, 4, 0.25
    cb = ClipampCallback(
        apply=True, window=window, start=0, quantile=0.95, tracking=None, csv_path=tmp_path / "s.csv", verbose=False
    )
    seen = {}
    for name, callbacks in (("ours", [cb]), ("ref", [])):
        torch.manual_seed(0)
        module = Watched()
        trainer = quiet_trainer(tmp_path / name, callbacks, steps, precision="bf16-mixed", gradient_clip_val=tau0)
        trainer.fit(module, _loader(steps, 1))
        seen[name] = module.seen
    df = pd.read_csv(tmp_path / "s.csv")
    assert seen["ours"][:window] == seen["ref"][:window]  # the same fit until τ changes
    assert seen["ours"] == pytest.approx(df["grad_l2_pre_clip"].tolist(), rel=1e-6)  # grad_norm: fp32 per tensor
    assert (df["grad_l2_pre_clip"] > df["max_norm"]).sum() >= steps / 2  # most steps clip: a post-clip log differs


class ManualGPT(LitGPT):
    """Manual optimization; ``clip_here=τ`` clips in ``training_step`` with Lightning's own
    ``clip_gradients`` (the reference), else the callback is trusted with τ."""

    def __init__(self, clip_here=None):
        super().__init__()
        self.automatic_optimization = False
        self.clip_here = clip_here

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        if self.clip_here is not None:
            self.clip_gradients(opt, gradient_clip_val=self.clip_here, gradient_clip_algorithm="norm")
        opt.step()
        return loss


def test_manual_optimization_apply_false_clips_at_max_norm_as_lightnings_clip_gradients(tmp_path):
    """The callback stands in for the user's clip (they must not clip themselves): ``apply=False``
    with ``max_norm=τ`` gives the run that ``self.clip_gradients(opt, τ)`` gives, bit for bit."""
    steps, tau = 6, 0.25

    def run(module, callbacks, root):
        torch.manual_seed(0)
        quiet_trainer(root, callbacks, steps, precision="bf16-mixed").fit(module, _loader(steps, 1))
        return module

    torch.manual_seed(0)
    ref = run(ManualGPT(clip_here=tau), [], tmp_path / "ref")
    torch.manual_seed(0)
    cb = ClipampCallback(max_norm=tau, tracking=None, csv_path=tmp_path / "s.csv", verbose=False)
    ours = run(ManualGPT(), [cb], tmp_path / "ours")
    torch.manual_seed(0)
    unclipped = run(ManualGPT(), [], tmp_path / "none")
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), name
    assert not all(torch.equal(p, q) for p, q in zip(ref.parameters(), unclipped.parameters()))
    df = pd.read_csv(tmp_path / "s.csv")
    assert (df["grad_l2_pre_clip"] > tau).sum() > steps / 2  # most steps clip
    assert df["grad_l2_post_clip"].tolist() == pytest.approx([min(n, tau) for n in df["grad_l2_pre_clip"]], rel=1e-5)


def test_a_manual_fit_that_clips_itself_is_refused_before_any_record(tmp_path):
    """A manual ``training_step`` kept as it was, ``self.clip_gradients(opt, τ)`` before ``opt.step()``: the
    callback would see only clipped norms and calibrate on them; the first ``opt.step()`` is refused naming
    ``max_norm=τ``, nothing recorded, and the precision plugin's own ``clip_gradients`` is back."""
    cb = ClipampCallback(tracking=None, csv_path=tmp_path / "s.csv", verbose=False)
    trainer = quiet_trainer(tmp_path, [cb], 4)
    module = ManualGPT(clip_here=0.25)
    before = [p.detach().clone() for p in module.parameters()]
    message = (
        "the gradients were clipped at 0.25 (self.clip_gradients) before opt.step(): ClipampCallback would record "
        "the clipped norms as the pre-clip ones and calibrate on them; drop that call and pass its τ to the "
        "callback, ClipampCallback(max_norm=0.25), which clips at it as that call does"
    )
    torch.manual_seed(0)
    with pytest.raises(ValueError) as raised:
        trainer.fit(module, _loader(4, 1))
    assert str(raised.value) == message
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))  # no step taken
    assert pd.read_csv(tmp_path / "s.csv").empty
    assert "clip_gradients" not in vars(trainer.precision_plugin)


@pytest.mark.parametrize(
    "callback,tau,message",
    [
        (
            dict(max_norm=0.5),
            None,
            r"ClipampCallback\(max_norm=0.5\) with automatic optimization and apply=False: Lightning clips at "
            r"Trainer\(gradient_clip_val=\) and the callback leaves that clip alone",
        ),
        (
            dict(max_norm=0.5, apply=True),
            0.25,
            r"ClipampCallback\(max_norm=0.5\) and Trainer\(gradient_clip_val=0.25\) name two thresholds: pass one",
        ),
    ],
)
def test_a_max_norm_that_would_not_be_the_clip_is_refused_before_any_step(tmp_path, callback, tau, message):
    """Under automatic optimization Lightning's gradient_clip_val is the clip: a max_norm beside it
    would make the records describe a clip that never ran."""
    cb = ClipampCallback(tracking=None, csv_path=tmp_path / "s.csv", verbose=False, **callback)
    torch.manual_seed(0)
    module = LitGPT()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=message):
        quiet_trainer(tmp_path, [cb], 2, gradient_clip_val=tau).fit(module, _loader(2, 1))
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))
    assert not (tmp_path / "s.csv").exists()


def test_a_value_clip_is_refused_naming_lightnings_setting_as_the_user_wrote_it(tmp_path):
    """Trainer(gradient_clip_algorithm="value") clips each element, not the norm the callback calibrates."""
    cb = ClipampCallback(tracking=None, csv_path=tmp_path / "s.csv", verbose=False)
    torch.manual_seed(0)
    module = LitGPT()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = quiet_trainer(tmp_path, [cb], 2, gradient_clip_val=0.5, gradient_clip_algorithm="value")
    message = (
        r"^gradient_clip_algorithm='value': ClipampCallback calibrates a norm threshold; "
        r"use gradient_clip_algorithm='norm' or drop the callback$"
    )
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, _loader(2, 1))
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))
    assert not (tmp_path / "s.csv").exists()


class TwoOptimizers(L.LightningModule):
    """Manual optimization with two networks and their optimizers (a GAN's generator and discriminator)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.a, self.b = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        for opt, net in zip(self.optimizers(), (self.a, self.b)):
            loss = F.mse_loss(net(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=0.05), torch.optim.SGD(self.b.parameters(), lr=0.01)


def test_two_optimizers_are_refused_before_any_step(tmp_path):
    """One calibration window cannot hold two networks' norms, and only the last opt.step() of a batch
    would be recorded: the fit is refused at its start, nothing trained and nothing written."""
    cb = ClipampCallback(max_norm=1.0, tracking=None, csv_path=tmp_path / "s.csv", verbose=False)
    torch.manual_seed(0)
    module = TwoOptimizers()
    before = [p.detach().clone() for p in module.parameters()]
    x = torch.randn(32, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    message = (
        r"^ClipampCallback records and calibrates the steps of one optimizer, and this fit has 2: each opt.step\(\) "
        r"would go into one calibration window, mixing the norms of different networks; configure one optimizer, "
        r"or clip and record each network with the engine's own loop \(docs/own-loop.md\)$"
    )
    with pytest.raises(ValueError, match=message):
        quiet_trainer(tmp_path, [cb], 4).fit(module, loader)
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), before))
    assert not (tmp_path / "s.csv").exists() and not list(tmp_path.rglob("*.csv"))


class RaiseAfter(L.Callback):
    """``exception`` after optimizer step ``at`` (its record written); keeps the callback's CSV writer."""

    def __init__(self, at: int, exception: BaseException, cb: ClipampCallback) -> None:
        self.at, self.exception, self.cb = at, exception, cb

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            self.writer = self.cb.recorder.writer
            raise self.exception


@pytest.mark.parametrize(
    "exception,raised,status",
    [(RuntimeError("boom"), RuntimeError, "FAILED"), (KeyboardInterrupt(), SystemExit, "KILLED")],
)
def test_an_exception_gives_the_clip_back_closes_the_csv_and_ends_the_run(tmp_path, store, exception, raised, status):
    """An error, or Ctrl-C (Lightning exits after its own cleanup): ``gradient_clip_val`` is the user's again,
    the CSV is closed with the steps done, and the MLflow run, their metrics sent, ends FAILED or KILLED, not
    RUNNING."""
    cb = ClipampCallback(apply=True, window=4, tracking=store, verbose=False)
    kill = RaiseAfter(2, exception, cb)
    trainer = quiet_trainer(tmp_path, [cb, kill], 6, gradient_clip_val=0.25)
    sigint = signal.getsignal(signal.SIGINT)
    torch.manual_seed(0)
    try:
        with pytest.raises(raised):
            trainer.fit(LitGPT(), _loader(6, 1))
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores Ctrl-C while it shuts down
    assert trainer.gradient_clip_val == 0.25
    assert kill.writer._file.closed and cb.recorder.writer is None
    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
    assert run.info.status == status
    steps = pd.read_csv(client.download_artifacts(run.info.run_id, "steps.csv", str(tmp_path)))
    assert steps["step"].tolist() == [1, 2]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "grad_l2_pre_clip")] == [1, 2]  # sent
