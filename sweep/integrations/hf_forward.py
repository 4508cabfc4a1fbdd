"""What ``ClipampCallback`` reads from the forwards ``Trainer`` runs: the model's own loss, the items it counts, the
step's loss and count over the ranks (the dtype the forward computes in: ``sweep.integrations.forward_dtype``)."""

from __future__ import annotations

from typing import Any

import torch


def model_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed itself, where ``Trainer.compute_loss`` reads it: ``outputs["loss"]`` (a
    ``ModelOutput`` is a dict), else ``outputs[0]`` of a tuple when it is a scalar; None otherwise."""
    if isinstance(output, dict):
        return output.get("loss")
    if isinstance(output, tuple | list):
        first = output[0] if output else None
        return first if torch.is_tensor(first) and first.ndim == 0 else None
    return getattr(output, "loss", None)


def loss_shifts_labels(model: Any) -> bool:
    """Trainer's rule for counting a batch's items (``num_items_in_batch``): a decoder-only causal-LM loss
    never predicts each row's first label, so the count is over ``labels[..., 1:]``; any other model (a
    classifier, an encoder-decoder) counts every label that is not -100."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.trainer_utils import unwrap_peft_model

    inner = unwrap_peft_model(model)
    causal = LOSS_MAPPING.get(getattr(inner, "loss_type", None)) is ForCausalLMLoss
    return causal and not getattr(getattr(inner, "config", None), "is_encoder_decoder", False)


def over_ranks(loss: torch.Tensor | None, tokens: torch.Tensor | None, loss_is_sum: bool):
    """The step's loss and token count over every rank, as Trainer logs them (one ``all_reduce``, on every
    rank alike; nothing without DDP). With ``num_items_in_batch`` each rank's loss is its own sum over the
    global token count, so the ranks' losses add up to the global mean; else each is a rank mean, averaged."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return loss, tokens
    if loss is None and tokens is None:
        return loss, tokens
    device = (loss if loss is not None else tokens).device
    nan = torch.tensor(float("nan"), device=device)
    both = torch.stack([nan if loss is None else loss.float(), nan if tokens is None else tokens.float()])
    dist.all_reduce(both)
    total, count = both.unbind()
    world = dist.get_world_size()
    return (
        None if loss is None else total if loss_is_sum else total / world,
        None if tokens is None else count.round().long(),
    )
