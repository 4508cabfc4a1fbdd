"""A custom model that crashes in ``forward``: an uncaught error inside a run (a bug, not a user mistake)."""

import torch


class Boom(torch.nn.Module):
    def __init__(self, **_):
        super().__init__()
        self.w = torch.nn.Linear(1, 1)

    def forward(self, x):
        raise RuntimeError("boom: a bug outside clipamp")
