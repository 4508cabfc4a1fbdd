"""``python -m sweep.recommend`` on the log of a real Lightning fit (``CSVLogger``, the norm from Lightning's
``grad_norm`` utility in ``on_before_optimizer_step``, the LR from ``LearningRateMonitor``): the window, its
steps and τ equal those the Lightning ``ClipampCallback`` calibrated live in the same fit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import LearningRateMonitor  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.utilities import grad_norm  # noqa: E402

from sweep.integrations.lightning import ClipampCallback  # noqa: E402
from tests.app.integrations.test_dropin_lightning import LitGPT, _loader  # noqa: E402
from tests.app.recommend.test_recommend import parse  # noqa: E402

STEPS, WINDOW = 60, 20


class Logged(LitGPT):
    """LitGPT logging its total gradient norm as Lightning's docs show, under a linear LR warm-up."""

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))

    def configure_optimizers(self):
        opt = super().configure_optimizers()
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


@pytest.mark.slow
def test_a_lightning_csv_log_gives_the_callbacks_window_and_tau(tmp_path):
    torch.manual_seed(0)
    cb = ClipampCallback(window=WINDOW, quantile=0.9, tracking=None, csv_path=tmp_path / "steps.csv", verbose=False)
    trainer = L.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=1,
        precision="bf16-mixed",
        gradient_clip_val=1.0,
        callbacks=[cb, LearningRateMonitor(logging_interval="step")],
        logger=CSVLogger(str(tmp_path), name="logs"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Logged(), _loader(STEPS, 1))
    [csv] = (tmp_path / "logs").glob("version_*/metrics.csv")
    rec = parse([str(csv), "--window", str(WINDOW), "--quantile", "0.9"])
    assert rec.series.name == "grad_2.0_norm_total" and rec.series.lr_name == "lr-AdamW/pg1"  # two param groups
    assert rec.series.steps.tolist() == list(range(1, STEPS + 1))
    [live] = cb.policy.summaries
    [window] = rec.clip.summaries
    assert (window.start_step, window.end_step) == (live.start_step, live.end_step)
    assert window.recommended_max_norm == pytest.approx(live.recommended_max_norm, rel=1e-6)  # logged as fp32
    assert rec.clip.placement.start == cb.policy.placement.start


class Counted(L.LightningModule):
    """A one-layer regression that logs, with Lightning's ``grad_norm``, the optimizer step it is in (1-based)."""

    def __init__(self):
        super().__init__()
        self.layer, self.optimizer_steps = torch.nn.Linear(4, 1), 0

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def on_before_optimizer_step(self, optimizer):
        self.optimizer_steps += 1
        self.log_dict({**grad_norm(self, norm_type=2), "optimizer_step": float(self.optimizer_steps)})

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def fit_every_5(tmp_path, module, max_steps: int, callbacks=()) -> Path:
    """Fit ``module`` on 16 batches of 4 for ``max_steps``, logging to a ``CSVLogger`` every 5 steps: its
    ``metrics.csv``."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=CSVLogger(str(tmp_path), name="logs"),
        log_every_n_steps=5,
        callbacks=list(callbacks),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    [csv] = (tmp_path / "logs").glob("version_*/metrics.csv")
    return csv


def test_a_lightning_log_every_5_steps_is_read_as_optimizer_steps(tmp_path):
    """``log_every_n_steps=5``: Lightning writes steps 4, 9, … (``global_step`` before the update) for optimizer
    steps 5, 10, …; they are read as the latter, each norm and LR at the optimizer step that produced it."""
    csv = fit_every_5(tmp_path, Counted(), 30, [LearningRateMonitor(logging_interval="step")])
    rows = pd.read_csv(csv)
    logged = rows.dropna(subset=["grad_2.0_norm_total"])
    assert logged["step"].tolist() == list(range(4, 30, 5))  # Lightning's numbering, checked, not assumed
    rec = parse([str(csv), "--window", "10", "--start", "0"])
    assert rec.series.steps.tolist() == logged["optimizer_step"].astype(int).tolist() == list(range(5, 31, 5))
    assert rec.series.interval == 5 and any(
        "a Lightning log (its epoch and grad_2.0_norm_total)" in n for n in rec.notes
    )
    lr_of_step = 0.1 * np.minimum(0.1 + 0.09 * (rec.series.steps - 1), 1.0)  # LinearLR: the LR step k trains with
    assert rec.series.lrs == pytest.approx(lr_of_step, rel=1e-9)


class OwnName(Counted):
    """``Counted`` logging its total norm under a name of its own, nothing of Lightning's names beside it."""

    def on_before_optimizer_step(self, optimizer):
        self.optimizer_steps += 1
        norm = grad_norm(self, norm_type=2)["grad_2.0_norm_total"]
        self.log_dict({"gnorm": norm, "optimizer_step": float(self.optimizer_steps)})


def test_a_csvlogger_log_of_a_norm_of_its_own_every_5_steps_is_read_as_optimizer_steps(tmp_path):
    """No ``grad_norm`` utility name, no ``LearningRateMonitor``, no ``hparams.yaml`` (``CSVLogger`` writes none for
    a module without hyperparameters): Lightning's steps 4, 9, … are still read as optimizer steps 5, 10, …"""
    csv = fit_every_5(tmp_path, OwnName(), 32)
    assert sorted(p.name for p in csv.parent.iterdir()) == ["metrics.csv"]
    logged = pd.read_csv(csv).dropna(subset=["gnorm"])
    assert logged["step"].tolist() == list(range(4, 30, 5))  # Lightning's numbering, checked, not assumed
    rec = parse([str(csv), "--norm", "gnorm", "--window", "10", "--start", "0"])
    assert rec.series.steps.tolist() == logged["optimizer_step"].astype(int).tolist() == list(range(5, 31, 5))
    assert rec.series.interval == 5
    assert any(n.startswith("the log's steps are 4, 9, … (a count from 0 logged every 5 steps") for n in rec.notes)


def test_a_log_counted_from_1_every_5_steps_keeps_its_numbers(tmp_path):
    """Steps 5, 10, …, and a last one off the grid (the run's end), are a count from 1: not moved."""
    from tests.app.recommend.test_recommend import trace, write_csv

    steps, lr, norms = trace()
    keep = (steps % 5 == 0) | (steps == steps[-1] - 2)
    rec = parse([str(write_csv(tmp_path / "log.csv", {"step": steps[keep], "grad_norm": norms[keep]}))])
    assert rec.series.steps.tolist() == steps[keep].tolist()


def test_another_loops_csv_every_5_steps_keeps_its_numbers(tmp_path):
    """An ``epoch`` and ``step`` column without Lightning's names (a hand-written loop, HF exports) is not moved."""
    from tests.app.recommend.test_recommend import trace, write_csv

    steps, lr, norms = trace()
    keep = steps % 5 == 0
    cols = {"epoch": np.zeros(keep.sum(), dtype=int), "grad_norm": norms[keep], "lr": lr[keep], "step": steps[keep]}
    rec = parse([str(write_csv(tmp_path / "log.csv", cols))])
    assert rec.series.steps.tolist() == steps[keep].tolist()
