"""A custom model that crashes in ``forward`` once training starts: an uncaught error inside a run
(a bug, not a user mistake). The checks of ``model=custom`` (one eval-mode and one training-mode
forward) pass."""

import torch


class Boom(torch.nn.Module):
    def __init__(self, **_):
        super().__init__()
        self.w = torch.nn.Linear(1, 1)
        self.train_calls = 0

    def forward(self, x):
        if self.training:
            self.train_calls += 1
            if self.train_calls > 1:
                raise RuntimeError("boom: a bug outside clipamp")
        return self.w.weight.new_zeros(*x.shape, 256) + self.w.weight.sum()
