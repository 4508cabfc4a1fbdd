"""A custom model that crashes in ``forward`` once training starts: an uncaught error inside a run
(a bug, not a user mistake). The eval-mode check forward of ``model=custom`` passes."""

import torch


class Boom(torch.nn.Module):
    def __init__(self, **_):
        super().__init__()
        self.w = torch.nn.Linear(1, 1)

    def forward(self, x):
        if self.training:
            raise RuntimeError("boom: a bug outside clipamp")
        return self.w.weight.new_zeros(*x.shape, 256) + self.w.weight.sum()
