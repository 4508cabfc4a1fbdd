"""``model=custom`` classes that are right in eval mode and wrong in training mode, a BatchNorm model
(whose statistics a training-mode forward changes), and a loss that raises."""

import torch

from sweep.tasks.models import TinyMLPLM


class TrainShape(TinyMLPLM):
    """Logits of the right shape in eval mode, one position short in training mode."""

    def forward(self, x):
        out = super().forward(x)
        return out[:, :-1] if self.training else out


class Detached(TinyMLPLM):
    """In training mode its logits are cut off from autograd (nothing would train)."""

    def forward(self, x):
        out = super().forward(x)
        return out.detach() if self.training else out


class Normed(TinyMLPLM):
    """Dropout and BatchNorm: a training-mode forward draws random numbers and updates statistics."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.norm = torch.nn.BatchNorm1d(256)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        out = self.drop(super().forward(x))
        return self.norm(out.transpose(1, 2)).transpose(1, 2)


def broken_loss(output, targets):
    return torch.nn.functional.cross_entropy(output.flatten(0, 1), targets.flatten()) + undefined_name  # noqa: F821
