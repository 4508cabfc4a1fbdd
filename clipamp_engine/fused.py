"""The fused update path: unscale and clip folded into the optimizer's own pass, no host sync.

torch's fused optimizers (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``) accept
``grad_scale`` and ``found_inf`` tensors (the contract ``GradScaler.step`` uses): the kernel
divides each gradient by ``grad_scale`` and skips the whole update when ``found_inf == 1``.
Clipping by the global norm is a scalar too, so with ``pre`` the norm of the *unscaled*
gradient and ``c = min(1, τ / (pre + 1e-6))`` the optimizer can be handed
``grad_scale = loss_scale / (c · token_factor)`` and gradients are read twice in all: once
for the norm, once by the optimizer (the canonical recipe reads them three to four times:
unscale, norm, scale, optimizer); where a multiply is faster than the kernel's division, three
times (see the recipes below).

The skip decision stays on the device (``found_inf = ¬isfinite(pre) ∨ ¬isfinite(loss)``); the
record of a step is one small device tensor, materialised with the others in one transfer
per flush (``RecordBuffer``); the LR schedule advances on taken steps only through a device
counter (``DeviceLambdaLR``).

What the fused path needs, and what it gives up (otherwise the default path runs):
- an optimizer that takes ``grad_scale``/``found_inf`` (fused torch optimizers);
- a policy that declares ``single_coefficient`` (``norm``, ``none``, ``staged``, and
  ``calibrated``, whose threshold in force is one of them; its windows observe the records when
  they are materialised) and computes it with ``coefficient(pre, step)``; ``value``,
  ``per_group``, ``agc``, ``update``, ``quantile``, ``zscore`` and ``dpsgd`` need per-tensor
  passes, the update itself, host-side state or their own gradients, and keep their passes;
- no forensics probe (it snapshots parameters and reads the update);
- one process (under DDP/FSDP2 with several ranks the default path runs, whose collectives agree
  on skips);
- no fp64 parameters: the fused kernels take ``grad_scale`` in fp32 only, which would round an
  fp64 run's clip coefficient (the default path clips fp64 gradients in fp64);
- no SGD with momentum: torch's fused SGD allocates a missing momentum buffer with ``empty_like``
  before it reads ``found_inf``, so a skipped first step would leave uninitialised memory as the
  momentum of the next (the default path never calls ``step()`` on a skip);
- a non-finite loss still runs backward (its gradients are discarded by the same flag);
- an LR scheduler other than ``LambdaLR`` costs one sync per step (to step it on taken
  steps only); ``LambdaLR`` turns every group's ``lr`` into a 0-dim tensor (fp64 on CPU, where
  the fused kernels read it as a double; fp32 elsewhere).

How the factor ``f = c · token_factor / loss_scale`` reaches the gradients is chosen per device
type and parameter dtype (``FACTOR_RECIPES``, measured with ``bench/bench_pipeline.py``):
``"grad_scale"`` hands ``1 / f`` to the optimizer's kernel, which divides each gradient by it;
``"multiply"`` scales the gradients with one ``_foreach_mul_`` by ``f`` and runs the kernel with
``found_inf`` only. The second reads the gradients once more, but multiplies where the kernel
divides, and is the default path's arithmetic: with a power-of-two loss scale and no token
factor its updates equal the default path's bit for bit (``x / (1/f)`` differs from ``x · f``
in the last bit, and in bf16 the kernel keeps the quotient in fp32 where the default path rounds
the clipped gradient to bf16).

References:
    Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740 (loss scaling).
    Pascanu, Mikolov, Bengio, arXiv:1211.5063 (global-norm clipping).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch

from ._torch_compat import fused_kernel_devices, set_last_lr, takes_grad_scale
from .clip.base import ClipPolicy
from .norms import record_dtype, scale_grads_
from .records import SkipLog, StepLog

__all__ = [
    "DEFAULT_FACTOR_RECIPE",
    "FACTOR_RECIPES",
    "DeviceLambdaLR",
    "RecordBuffer",
    "apply_factor_and_step",
    "factor_recipe",
    "fused_kernel_devices",
    "fused_optimizer_step",
    "fused_path_refusal",
    "global_coefficient",
    "is_fusable",
]


def is_fusable(clip: ClipPolicy) -> bool:
    """Whether ``clip`` declares that its clip is one global coefficient (``single_coefficient``)."""
    return bool(clip.single_coefficient)


def fused_path_refusal(optimizer: torch.optim.Optimizer, clip: ClipPolicy, forensics: bool) -> str | None:
    """Why the fused path cannot run for this setup, or ``None`` when it can."""
    if not takes_grad_scale(optimizer):
        return f"{type(optimizer).__name__} does not take grad_scale/found_inf (build it with fused=True)"
    groups = optimizer.param_groups
    unfused = [i for i, g in enumerate(groups) if "fused" in g and not g["fused"]]  # torch steps those unfused
    if unfused:
        return f"param groups {unfused} of {type(optimizer).__name__} say fused={groups[unfused[0]]['fused']}"
    if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in groups):
        return (
            "SGD with momentum: torch's fused SGD allocates its momentum buffers, uninitialised, on a step its "
            "found_inf skips, and the next step would read them"
        )
    if "grad_scaler" in inspect.signature(optimizer.step).parameters:
        return f"{type(optimizer).__name__}.step takes the deprecated grad_scaler argument"
    if not is_fusable(clip):
        return f"clip mode {clip.mode!r} is not one global coefficient"
    if clip.gradient_source is not None:
        return f"clip mode {clip.mode!r} produces its own gradients"
    if forensics:
        return "forensics read the update"
    if any(p.dtype == torch.float64 for g in optimizer.param_groups for p in g["params"]):
        return "fp64 parameters: torch's fused kernels take grad_scale in fp32, which would round the clip coefficient"
    return None


def global_coefficient(clip: ClipPolicy, pre: torch.Tensor, step: int) -> torch.Tensor:
    """The policy's clip coefficient at ``step`` for a finite ``pre`` (1 where ``pre`` is not finite)."""
    coef = clip.coefficient(pre, step)
    return torch.where(torch.isfinite(pre), coef, torch.ones_like(coef))


def fused_optimizer_step(
    optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None, found_inf: torch.Tensor
) -> None:
    """One optimizer step that divides gradients by ``grad_scale`` (``None``: leaves them) and is
    skipped if ``found_inf == 1``."""
    optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]


#: ``(device type, parameter dtype)`` → how the fused path applies its factor (module docstring).
#: CPU, measured with ``bench/bench_pipeline.py`` (docs/measurements.md): in bf16 the multiply is
#: faster (the kernel's per-element division and its bf16 write-back of the quotient cost more than
#: one ``_foreach_mul_``); in fp32 ``grad_scale`` is (the kernel's division costs less than the
#: multiply's extra pass).
FACTOR_RECIPES: dict[tuple[str, torch.dtype], str] = {
    ("cpu", torch.float32): "grad_scale",
    ("cpu", torch.bfloat16): "multiply",
}
#: Where ``FACTOR_RECIPES`` has no entry (CUDA and other accelerators, until a bench run there chooses): the
#: kernel's division hides in its memory-bound pass and the multiply's extra read would not.
DEFAULT_FACTOR_RECIPE = "grad_scale"
RECIPES = ("grad_scale", "multiply")


def refit_recipe(optimizer: torch.optim.Optimizer, clip: ClipPolicy, params: Sequence[torch.Tensor]) -> str:
    """The fused path's recipe after the optimizer's param groups changed; ``ValueError`` when it cannot take them."""
    refusal = fused_path_refusal(optimizer, clip, forensics=False)
    if refusal is not None:
        raise ValueError(
            f"the optimizer's param groups changed and the fused path cannot run for them: {refusal}; "
            "build AmpTrainState with fused=False to take any param group"
        )
    return factor_recipe(params)


def factor_recipe(params: Sequence[torch.Tensor]) -> str:
    """The recipe for ``params``: ``"grad_scale"`` if every (device type, dtype) among them takes it, else
    ``"multiply"`` (one optimizer call takes one ``grad_scale``; the multiply is right for every dtype)."""
    chosen = {FACTOR_RECIPES.get((p.device.type, p.dtype), DEFAULT_FACTOR_RECIPE) for p in params}
    return "grad_scale" if chosen <= {"grad_scale"} else "multiply"


def apply_factor_and_step(
    optimizer: torch.optim.Optimizer,
    grads: list[torch.Tensor],
    factor: torch.Tensor,
    found_inf: torch.Tensor,
    recipe: str,
) -> None:
    """Multiply the gradients by ``factor`` and step, or skip the update if ``found_inf == 1``, by ``recipe``."""
    if recipe == "multiply":
        scale_grads_(grads, factor)
        fused_optimizer_step(optimizer, None, found_inf)
    elif recipe == "grad_scale":
        fused_optimizer_step(optimizer, 1.0 / factor, found_inf)
    else:
        raise ValueError(f"fused recipe {recipe!r} is not one of {', '.join(RECIPES)}")


def flush_window(log_every: Any, pending: int, pipeline: str, scheduler: Any) -> tuple[int, DeviceLambdaLR | None]:
    """A state's ``log_every`` checked (an integer ≥ 1, set with no record ``pending``), and the fused
    ``pipeline``'s ``DeviceLambdaLR`` for a ``LambdaLR`` scheduler, its window sized to the flushes (else None)."""
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"log_every={log_every!r} must be an integer >= 1")
    if pending:
        raise RuntimeError(f"{pending} records are pending: call flush() before setting log_every")
    if pipeline == "fused" and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return log_every, DeviceLambdaLR(scheduler, log_every)
    return log_every, None


class DeviceLambdaLR:
    """Advance a ``LambdaLR`` on taken steps only, without asking the host which steps were taken.

    A device counter holds the number of taken steps; each group's ``lr`` is a 0-dim tensor
    set from a window of precomputed factors ``lr_lambda(T₀ … T₀ + W − 1)`` indexed by
    ``counter − T₀``. Between two flushes at most ``W − 1`` steps run (fewer where the schedule ends
    sooner: ``known``), so the window always holds the next LR; ``sync(taken)`` (at a flush, where the
    count is on the host anyway) moves the window and brings the scheduler object (``last_epoch``,
    ``get_last_lr()``) up to date for checkpoints.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LambdaLR, window: int) -> None:
        self.scheduler = scheduler
        self.window = window + 1
        groups = scheduler.optimizer.param_groups
        device = groups[0]["params"][0].device
        self.dtype = torch.float64 if device.type == "cpu" else torch.float32  # what the fused kernels read
        for g in groups:
            if not isinstance(g["lr"], torch.Tensor):
                g["lr"] = torch.tensor(float(g["lr"]), dtype=self.dtype, device=device)
        self.taken = torch.zeros((), dtype=torch.long, device=device)
        self.sync(scheduler.last_epoch)

    def sync(self, taken: int) -> None:
        """Move the window to ``taken`` taken steps. ``lr_lambda(taken)`` raises here as it would in
        ``LambdaLR.step()``; ahead of it the window stops at the first factor the lambda cannot give (a
        schedule defined up to the end of the run), and ``known`` says how many steps it covers."""
        s = self.scheduler
        s.last_epoch = taken
        lrs = [base * fn(taken) for base, fn in zip(s.base_lrs, s.lr_lambdas)]
        set_last_lr(s, lrs)
        self.start = taken
        rows = [[lr, *_ahead(fn, base, taken, self.window)] for lr, base, fn in zip(lrs, s.base_lrs, s.lr_lambdas)]
        self.known = min(map(len, rows))  # steps the window covers; the caller flushes before it runs out
        rows = [row[: self.known] + [row[self.known - 1]] * (self.window - self.known) for row in rows]
        self.table = torch.tensor(rows, dtype=self.dtype, device=self.taken.device)
        self.taken.fill_(taken)
        for g, lr in zip(s.optimizer.param_groups, lrs):
            _write_lr(g, lr, self.taken.device, self.dtype)

    def advance(self, found_inf: torch.Tensor) -> None:
        """After a step: count it when taken and load the LR for the next one (on the device)."""
        self.taken += 1 - found_inf.long()
        lrs = torch.index_select(self.table, 1, (self.taken - self.start).reshape(1))  # no host index
        for i, g in enumerate(self.scheduler.optimizer.param_groups):
            _write_lr(g, lrs[i, 0], self.taken.device, self.dtype)


def _write_lr(group: dict[str, Any], lr: torch.Tensor | float, device: torch.device, dtype: torch.dtype) -> None:
    """Write ``lr`` into the group's 0-dim LR tensor (no sync). A group whose ``lr`` became a number since
    (``optimizer.load_state_dict`` of a checkpoint saved with float LRs, an LR set by hand) gets a tensor
    again: that number served the step just run, as it would have before ``LambdaLR.step()``."""
    if not isinstance(group["lr"], torch.Tensor):
        group["lr"] = torch.zeros((), dtype=dtype, device=device)
    if isinstance(lr, torch.Tensor):
        group["lr"].copy_(lr)
    else:
        group["lr"].fill_(lr)


def _ahead(fn: Any, base: float, taken: int, window: int) -> list[float]:
    """``base · fn(taken + i)`` for ``i`` = 1 … window − 1, up to the first that raises (not yet asked for:
    ``LambdaLR`` asks for it only once that step is taken, and raises then)."""
    out = []
    for i in range(1, window):
        try:
            out.append(base * fn(taken + i))
        except Exception:
            break
    return out


#: Layout of one pending record row (fp64 on the device, fp32 on MPS: an fp64 LR stays exact).
ROW = ("lr", "pre", "post", "loss", "tokens", "scale", "skipped", "loss_finite")


class RecordBuffer:
    """Device rows of steps not yet materialised; ``drain()`` turns them into records in one transfer."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.meta: list[tuple[int, float | None]] = []  # (step, max_norm) known on the host
        self.host_lr: list[float | None] = []  # a float LR, kept exact (an MPS row holds it in fp32)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, step: int, max_norm: float | None, values: Sequence[torch.Tensor | float]) -> None:
        """Queue one row (``ROW`` order); floats become device scalars without a host transfer."""
        device = next(v.device for v in values if isinstance(v, torch.Tensor))
        wide = record_dtype(device)
        self.rows.append(
            torch.stack(
                [
                    v.to(device).to(wide).reshape(())
                    if isinstance(v, torch.Tensor)
                    else torch.full((), v, dtype=wide, device=device)
                    for v in values
                ]
            )
        )
        self.meta.append((step, max_norm))
        self.host_lr.append(None if isinstance(values[0], torch.Tensor) else float(values[0]))

    def drain(self) -> list[StepLog]:
        if not self.rows:
            return []
        table = torch.stack(self.rows).tolist()  # sync: one transfer for every pending record
        out = [
            _record(step, max_norm, {**dict(zip(ROW, values)), **({"lr": lr} if lr is not None else {})})
            for (step, max_norm), values, lr in zip(self.meta, table, self.host_lr)
        ]
        self.rows, self.meta, self.host_lr = [], [], []
        return out


def _record(step: int, max_norm: float | None, v: dict[str, Any]) -> StepLog:
    tokens = None if math.isnan(v["tokens"]) else int(v["tokens"])
    common = dict(
        step=step,
        lr=v["lr"],
        grad_l2_pre_clip=v["pre"],
        loss=v["loss"],
        scaler_scale=v["scale"],
        token_count=tokens,
        max_norm=max_norm,
        pipeline="fused",
    )
    if v["skipped"]:
        reason = "nonfinite_grad" if v["loss_finite"] else "nonfinite_loss"
        pre = v["pre"] if reason == "nonfinite_grad" else float("nan")
        return SkipLog(
            **{**common, "grad_l2_pre_clip": pre}, grad_l2_post_clip=float("nan"), clipped=False, skip_reason=reason
        )
    return StepLog(**common, grad_l2_post_clip=v["post"], clipped=v["post"] < v["pre"])
