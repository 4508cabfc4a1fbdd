"""A plain Lightning fit with the clipamp callback (bf16-mixed, accumulation 2, gradient_clip_val=1.0).

    PYTHONPATH=. .venv/bin/python examples/lightning_callback.py

apply=False: the fit is bit-identical to the same fit without the callback; steps.csv holds every
optimizer step and the run prints the recommended gradient_clip_val with its check (docs/lightning.md).
"""

import lightning as L
import torch
import torch.nn.functional as F

from sweep.integrations.lightning import ClipampCallback


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


torch.manual_seed(0)
x = torch.randn(512, 8)
data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
callback = ClipampCallback(window=40, tracking=None, csv_path="steps.csv")  # apply=False: changes nothing
trainer = L.Trainer(
    max_steps=100,
    accelerator="cpu",
    precision="bf16-mixed",
    accumulate_grad_batches=2,
    gradient_clip_val=1.0,
    callbacks=[callback],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=8))
print("recommended gradient_clip_val:", callback.summary.recommended_max_norm)
