"""DP-SGD gradients: per-sample clipping plus Gaussian noise, with ``torch.func``.

Global-norm clipping bounds the *batch* gradient (training stability); per-sample clipping
bounds every *example's* influence, and with calibrated noise gives DP-SGD's privacy
guarantee. Only the gradient computation is here: privacy accounting (ε, δ over the run,
sampling rates, the moments/RDP accountant) is out of scope — use a dedicated library
(e.g. Opacus' accountants) for that.

References:
    Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang, "Deep Learning with
    Differential Privacy", arXiv:1607.00133.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from ..gradients import GradientSource
from ..norms import CLIP_EPS
from .base import ClipPolicy

__all__ = ["DPSGDClip", "PerExampleGradients", "dp_sgd_grads"]


def dp_sgd_grads(
    model: nn.Module,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    max_norm: float | Sequence[float],
    noise_multiplier: float,
    per_layer: bool = False,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """Compute DP-SGD gradients for one batch and write them to every trainable ``.grad``.

    For each example i (``torch.func.vmap`` over ``grad`` of the one-example loss)::

        g_i = ∇ loss_fn(model(x_i), y_i)
        flat:       g̃_i = g_i · min(1, C / (‖g_i‖ + 1e-6))             (‖·‖ over all parameters)
        per_layer:  g̃_i,l = g_i,l · min(1, C_l / (‖g_i,l‖ + 1e-6))      (each parameter tensor l)
        ḡ = (Σ_i g̃_i + N(0, σ² C² I)) / B

    with σ = ``noise_multiplier`` and, per layer, C = ‖(C_1, …, C_L)‖₂ (the total sensitivity,
    as Opacus does). Existing ``.grad`` values are replaced, so run the optimizer step right
    after (no accumulation across calls: each call is one noisy batch).

    Cost: B per-sample copies of the gradient (vmap materialises them), one reduction per
    parameter tensor for the per-sample norms. Models must not mix examples in the forward
    (no BatchNorm in training mode; use GroupNorm/LayerNorm); dropout draws a separate mask per
    example.

    Args:
        model: the module; its ``requires_grad`` parameters get the gradients.
        loss_fn: ``loss_fn(model(x), y)`` for a batch of one example (mean or sum: equal).
        inputs, targets: batch-first tensors with the same leading size B.
        max_norm: C (> 0); with ``per_layer``, one C_l per trainable parameter tensor, in
            ``named_parameters()`` order, or one value for all.
        noise_multiplier: σ (≥ 0; 0 gives the clipped mean without noise).
        per_layer: clip each parameter tensor separately instead of the flat per-example norm.
        generator: RNG for the noise (on the parameters' device), for reproducibility.

    Returns:
        ``{"batch_size", "clip_fraction" (examples with any clipped part), "mean_sample_norm",
        "max_sample_norm" (flat per-example norms before clipping), "noise_std" (σ·C, on the
        sum)}`` as Python numbers (one host sync).
    """
    if noise_multiplier < 0 or not math.isfinite(noise_multiplier):
        raise ValueError(f"noise_multiplier={noise_multiplier!r} must be a finite number >= 0")
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("model has no trainable parameters")
    if isinstance(max_norm, (int, float)):
        bounds = [float(max_norm)] * (len(named) if per_layer else 1)
    else:
        bounds = [float(c) for c in max_norm]
        if not per_layer and len(bounds) != 1:
            raise ValueError(f"max_norm has {len(bounds)} values: a list of bounds needs per_layer=True")
        if per_layer and len(bounds) != len(named):
            raise ValueError(
                f"max_norm has {len(bounds)} values but the model has {len(named)} trainable "
                f"parameter tensors ({', '.join(named)})"
            )
    if not all(c > 0 and math.isfinite(c) for c in bounds):
        raise ValueError(f"max_norm={max_norm!r} must be finite and > 0")
    batch = inputs.shape[0]
    if targets.shape[0] != batch:
        raise ValueError(f"inputs have {batch} examples but targets have {targets.shape[0]}")

    params = {n: p.detach() for n, p in named.items()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def example_loss(p, b, x, y):
        return loss_fn(functional_call(model, (p, b), (x.unsqueeze(0),)), y.unsqueeze(0))

    per_sample = vmap(grad(example_loss), in_dims=(None, None, 0, 0), randomness="different")(
        params, buffers, inputs, targets
    )
    grads = [per_sample[n] for n in named]
    reals = [torch.view_as_real(g) if g.is_complex() else g for g in grads]  # |z|² = re² + im²
    wide = functools.reduce(torch.promote_types, [r.dtype for r in reals], torch.float32)  # fp64 stays fp64
    layer_sq = torch.stack([r.flatten(1).to(wide).pow(2).sum(1) for r in reals])  # (L, B), one reduction per tensor
    sample_norm = layer_sq.sum(0).sqrt()  # (B,)
    if per_layer:
        c = torch.tensor(bounds, dtype=wide, device=layer_sq.device).unsqueeze(1)
        coef = torch.clamp(c / (layer_sq.sqrt() + CLIP_EPS), max=1.0)  # (L, B)
        clipped = (coef < 1).any(0)
        sensitivity = math.sqrt(sum(b * b for b in bounds))
    else:
        coef_b = torch.clamp(bounds[0] / (sample_norm + CLIP_EPS), max=1.0)
        coef = coef_b.expand(len(grads), batch)
        clipped = coef_b < 1
        sensitivity = bounds[0]
    noise_std = noise_multiplier * sensitivity
    with torch.no_grad():
        for p, g, k in zip(named.values(), grads, coef):
            summed = torch.tensordot(k.to(g.dtype), g, dims=1)  # Σ_i coef_i g_i
            if noise_std > 0:
                summed = summed + noise_std * torch.randn(
                    summed.shape, generator=generator, device=summed.device, dtype=summed.dtype
                )
            p.grad = (summed / batch).to(p.dtype)
    stats = torch.stack([clipped.float().mean(), sample_norm.mean(), sample_norm.max()]).tolist()  # sync: the stats
    return {
        "batch_size": batch,
        "clip_fraction": stats[0],
        "mean_sample_norm": stats[1],
        "max_sample_norm": stats[2],
        "noise_std": noise_std,
    }


class PerExampleGradients(GradientSource):
    """The gradient source of ``DPSGDClip``: ``policy.backward`` writes the clipped, noised mean of the
    per-example gradients; the forward then only computes the loss (no autograd graph).

    Refuses accumulation (each call is one noisy batch), fp16 (the per-example gradients are not
    loss-scaled) and several replicas (DDP/FSDP2 reduce inside ``loss.backward``, which never runs).
    """

    builds_graph = False

    def __init__(self, policy: DPSGDClip) -> None:
        self.policy = policy

    def refusal(self, *, has_loss_fn, accumulation_steps, dtype, world_size, world_kind):
        mode = self.policy.mode
        if not has_loss_fn:
            return f"clip mode {mode!r} computes per-example losses: it needs a loss_fn"
        if accumulation_steps != 1 or dtype == "fp16":
            return (
                f"clip mode {mode!r} computes per-example gradients: it needs "
                f"accumulation_steps=1 and dtype bf16 or fp32 (got {accumulation_steps}, {dtype!r})"
            )
        if world_size > 1:
            return (
                f"clip mode {mode!r} computes per-example gradients outside backward, so "
                f"{world_kind} never reduces them: run it in one process"
            )
        return None

    def backward(self, loss, scaler, model, loss_fn, inputs, targets) -> None:
        self.policy.backward(model, loss_fn, inputs, targets)


class DPSGDClip(ClipPolicy):
    """``clip=dpsgd``: per-example clipping to ``max_norm`` plus Gaussian noise (σ = ``noise_multiplier``).

    Its ``gradient_source`` (``PerExampleGradients``) computes the gradients with ``dp_sgd_grads``
    instead of ``loss.backward()``; ``clip_`` then has nothing left to do. Needs
    ``accumulation_steps=1`` and bf16/fp32 (the per-example gradients are not loss-scaled).
    Privacy accounting is out of scope (see the module docstring). A ``(loss_sum, token_count)``
    loss is taken per example as its token mean.

    Args:
        max_norm: C (> 0): the per-example bound; with ``per_layer`` the bound of each of the L
            parameter tensors, so an example's whole gradient is bounded by C·√L, the sensitivity
            the noise is scaled to (``dp_sgd_grads``).
        noise_multiplier: σ (≥ 0).
        per_layer: clip each parameter tensor separately (see ``dp_sgd_grads``).
        seed: seeds the policy's own CPU generator, which draws the noise when the model is on the
            CPU and whose state ``state_dict()`` checkpoints. On any other device the noise comes
            from that device's global RNG (``torch.manual_seed`` / ``torch.cuda.manual_seed``):
            ``seed`` and the checkpointed generator state do not apply there.
    """

    mode = "dpsgd"
    columns = ("dp_clip_fraction",)

    def __init__(
        self, max_norm: float = 1.0, noise_multiplier: float = 1.0, per_layer: bool = False, seed: int = 0
    ) -> None:
        if not max_norm > 0 or noise_multiplier < 0:
            raise ValueError(f"max_norm={max_norm!r} must be > 0 and noise_multiplier={noise_multiplier!r} >= 0")
        self.max_norm, self.noise_multiplier, self.per_layer = float(max_norm), float(noise_multiplier), per_layer
        self.generator = torch.Generator().manual_seed(seed)
        self.last_stats: dict[str, float] = {}
        self._source = PerExampleGradients(self)

    @property
    def gradient_source(self) -> PerExampleGradients:
        return self._source

    def backward(self, model: nn.Module, loss_fn: Callable, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        def example_loss(output, target):
            result = loss_fn(output, target)
            return result[0] / result[1] if isinstance(result, tuple) else result

        gen = self.generator if next(model.parameters()).device.type == "cpu" else None
        self.last_stats = dp_sgd_grads(
            model,
            example_loss,
            inputs,
            targets,
            max_norm=self.max_norm,
            noise_multiplier=self.noise_multiplier,
            per_layer=self.per_layer,
            generator=gen,
        )

    def clip_(self, params, grads, pre, step):
        return pre

    @property
    def threshold(self) -> float:
        return self.max_norm

    def after_step(self, params, optimizer) -> dict[str, Any]:
        return {"dp_clip_fraction": self.last_stats.get("clip_fraction", math.nan)}

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "generator" in state:
            self.generator.set_state(state["generator"])
