"""The dtype a host's training forward computes in, as a run's ``dtype`` tag says it: what autocast or the weights
make it, whatever the host's precision setting is named (a ``Trainer`` or Lightning fit of a model loaded in bf16
under a 32-bit setting runs its forward in bf16)."""

from __future__ import annotations

from typing import Any

import torch

from clipamp_engine.step import DTYPES

#: The ``dtype`` tag of a run (the report's and the MLflow view's column): the engine's name of the dtype.
DTYPE_TAGS = {dtype: name for name, dtype in DTYPES.items()}


def dtype_tag(dtype: torch.dtype) -> str:
    return DTYPE_TAGS.get(dtype, str(dtype).removeprefix("torch."))


class ForwardDtype:
    """The dtype a model's training forward computes in, read inside it, where accelerate's autocast (which wraps
    the model's own ``forward``, so that a hook on the model itself runs outside it) is in force: the autocast
    dtype of ``device_type`` where autocast is on there, else the dtype of the model's first floating-point
    parameter (a model trained in the dtype it was loaded in). A forward pre-hook on each submodule reads it when
    the first of them runs in training mode, and all are removed then: nothing is left to run on the steps after
    the first forward, and nothing reads a tensor back (``seen`` is ``None`` until then, and for a model without
    submodules)."""

    def __init__(self, model: torch.nn.Module, device_type: str) -> None:
        self.seen: str | None = None
        self._model, self._device = model, device_type
        self._hooks = [m.register_forward_pre_hook(self._read) for m in model.modules() if m is not model]

    def _read(self, module: torch.nn.Module, args: Any) -> None:
        if not module.training:  # an evaluation forward
            return
        if torch.is_autocast_enabled(self._device):
            dtype = torch.get_autocast_dtype(self._device)
        else:
            dtype = next((p.dtype for p in self._model.parameters() if p.is_floating_point()), torch.float32)
        self.seen = dtype_tag(dtype)
        self.remove()

    def tag(self, tracker: Any) -> bool:
        """Once the forward was seen: the run's ``dtype`` tag set to what it ran in (``tracker``: the run's, None
        where nothing is tracked); whether it was seen."""
        if self.seen is None:
            return False
        if tracker is not None:
            tracker.set_tags({"dtype": self.seen})
        return True

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
