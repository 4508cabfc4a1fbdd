"""An accelerate loop whose clip call is ClipampAccelerate's (bf16, accumulation 2, max_norm 1.0).

    PYTHONPATH=. .venv/bin/python examples/accelerate_loop.py

apply=False: the loop is bit-identical to the same loop with accelerator.clip_grad_norm_; steps.csv
holds every optimizer step and end() prints the recommended max_norm with its check (docs/accelerate.md).
"""

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from sweep.integrations.accelerate import ClipampAccelerate

torch.manual_seed(0)
steps, accumulation = 100, 2
accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=accumulation, cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
x = torch.randn(steps * accumulation * 8, 8)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

clipamp = ClipampAccelerate(accelerator, total_steps=steps, window=40, tracking=None, csv_path="steps.csv")
for inputs, targets in loader:
    with accelerator.accumulate(model):
        loss = F.mse_loss(model(inputs), targets)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            clipamp.clip_grad_norm_(model.parameters(), 1.0)  # was: accelerator.clip_grad_norm_(...)
        optimizer.step()
        optimizer.zero_grad()
        if accelerator.sync_gradients:
            clipamp.step_end(loss)
clipamp.end()
print("recommended max_norm:", clipamp.summary.recommended_max_norm)
