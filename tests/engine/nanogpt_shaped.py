"""A model shaped like nanoGPT's ``model.py`` (tied embedding, pre-LN blocks, ``forward(idx, targets)``
returning ``(logits, loss)``) and its ``configure_optimizers`` (decay params first, then no-decay)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGPTShaped(nn.Module):
    """``forward(idx, targets=None) -> (logits, loss)``; ``loss`` is ``None`` without targets."""

    def __init__(self, vocab: int = 64, block: int = 16, d: int = 32, n_layer: int = 2, n_head: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT does

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def configure_optimizers(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.1, **kw):
    """nanoGPT's AdamW: 2-D+ tensors decay, the rest (biases, LayerNorm) do not; decay group first."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    groups = [
        {"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **kw)


def batches(n: int, batch: int = 8, block: int = 16, vocab: int = 64, seed: int = 0):
    """``n`` deterministic ``(idx, targets)`` pairs of a next-token task."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        seq = torch.randint(0, vocab, (batch, block + 1), generator=g)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out
