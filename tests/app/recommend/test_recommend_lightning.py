"""``python -m sweep.recommend`` on the log of a real Lightning fit (``CSVLogger``, the norm from Lightning's
``grad_norm`` utility in ``on_before_optimizer_step``, the LR from ``LearningRateMonitor``): the window, its
steps and τ equal those the Lightning ``ClipampCallback`` calibrated live in the same fit."""

from __future__ import annotations

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
