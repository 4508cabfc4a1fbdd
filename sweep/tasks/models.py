"""Small byte-level networks for the built-in tasks (vocab = 256 byte ids).

``TinyMLPLM`` doubles as the example for ``model=custom``::

    python -m sweep model=custom model._target_=sweep.tasks.models.TinyMLPLM \\
        '+model.kwargs={context: 8, d: 32}'
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from sweep.config.schema import ATTENTION

VOCAB = 256


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """Causal ``softmax(q kᵀ / √d) v`` from matmuls.

    Vaswani et al., "Attention Is All You Need", arXiv:1706.03762, eq. 1; the explicit form of
    ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``. The softmax runs in the scores' dtype:
    torch's CPU kernel computes a bf16 softmax in fp32 and rounds once (``tests/app/tasks/test_attention.py``).
    """
    T = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril_()
    weights = scores.masked_fill_(~causal, float("-inf")).softmax(-1)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return weights @ v


def use_eager(q: torch.Tensor, attention: str) -> bool:
    """``auto``: the explicit form for bf16 on CPU, where it is cheaper than the fused kernel's backward
    (``bench/bench_calibrate.py`` measures both); ``F.scaled_dot_product_attention`` elsewhere."""
    if attention == "auto":
        return q.device.type == "cpu" and q.dtype == torch.bfloat16
    return attention == "eager"


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float, attention: str = "auto"):
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"model.attention={attention!r} is not one of {', '.join(ATTENTION)}")
        self.n_head, self.dropout, self.attention = n_head, dropout, attention
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        if use_eager(q, self.attention):
            y = eager_attention(q, k, v, p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_head: int, dropout: float, attention: str = "auto"):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, attention)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Byte-level causal transformer: learned positions, pre-LN, tied head."""

    def __init__(self, d_model=128, n_layer=4, n_head=4, block_size=128, dropout=0.0, attention="auto"):
        super().__init__()
        if d_model % n_head:
            raise ValueError(
                f"model.d_model={d_model} is not divisible by model.n_head={n_head}: "
                "pick n_head dividing d_model (e.g. model.n_head=4)"
            )
        self.block_size = block_size
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, attention) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2 style scaled residual init
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * max(n_layer, 1)))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size={self.block_size}")
        x = self.drop(self.tok(idx) + self.pos.weight[:T])
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class LSTMLM(nn.Module):
    """Byte-level LSTM language model: embedding -> LSTM(n_layer) -> linear head."""

    def __init__(self, d_model=128, hidden=256, n_layer=2, dropout=0.0):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model)
        self.lstm = nn.LSTM(d_model, hidden, n_layer, batch_first=True, dropout=dropout if n_layer > 1 else 0.0)
        self.head = nn.Linear(hidden, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        if (
            x.device.type == "cpu"
            and torch.is_autocast_enabled("cpu")
            and not _cpu_lstm_autocasts(torch.get_autocast_dtype("cpu"))
        ):
            # oneDNN has no LSTM primitive for this dtype on this CPU (fp16; bf16 on CPUs without
            # AVX-512): run the recurrence in fp32, the rest of the model under autocast.
            with torch.autocast("cpu", enabled=False):
                out, _ = self.lstm(x.float())
        else:
            out, _ = self.lstm(x)
        return self.head(out)


@functools.cache
def _cpu_lstm_autocasts(dtype: torch.dtype) -> bool:
    """Whether an ``nn.LSTM`` runs under CPU autocast to ``dtype`` here: oneDNN decides by the CPU's
    instruction set, and raises where it has no primitive. Probed once per dtype on a 1-unit LSTM under a
    forked CPU RNG, so the run's random stream is the same either way."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        probe = nn.LSTM(1, 1)
        try:
            with torch.autocast("cpu", dtype=dtype):
                probe(torch.zeros(1, 1, 1))
        except RuntimeError:
            return False
    return True


class TinyMLPLM(nn.Module):
    """Fixed-context MLP LM: logits[t] = MLP(emb(x[t-context+1..t])). Causal, tiny.

    Example for ``model=custom``: ``model._target_=sweep.tasks.models.TinyMLPLM``.
    """

    def __init__(self, context: int = 4, d: int = 32, hidden: int = 256):
        super().__init__()
        self.context = context
        self.emb = nn.Embedding(VOCAB, d)
        self.mlp = nn.Sequential(nn.Linear(context * d, hidden), nn.GELU(), nn.Linear(hidden, VOCAB))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        e = F.pad(self.emb(idx), (0, 0, self.context - 1, 0))  # left-pad time with zeros
        ctx = torch.cat([e[:, i : i + T] for i in range(self.context)], dim=-1)
        return self.mlp(ctx)
