"""A nanoGPT-shaped loop through AmpTrainState: the model computes its own loss, τ calibrated as the runner does.

    PYTHONPATH=. .venv/bin/python examples/own_loop_nanogpt.py [--steps 400] [--apply]

A byte-level GPT (nanoGPT's shape: tied embedding, pre-LN blocks, ``forward(idx, targets) ->
(logits, loss)``, AdamW with decay / no-decay groups) on the standard library's own sources,
bf16 autocast, accumulation 2. Without ``--apply`` every step is exactly nanoGPT's
``clip_grad_norm_(model.parameters(), 1.0)`` step; with ``--apply`` τ is calibrated as the runner
calibrates it, with the window shortened to steps/3 (at most the runner's 200) so that a short run
keeps steps to validate it (1.0 until the window closes, the calibrated τ after), and the window, τ
with its interval and the verdict are printed. Writes ``steps.csv`` (replaced on a re-run).
"""

import argparse
import inspect
import json
import math
import textwrap

import torch
import torch.nn.functional as F
from torch import nn

from clipamp_engine.clip.calibrated import recommended_calibration
from clipamp_engine.csvlog import StepCSVWriter
from clipamp_engine.step import AmpTrainState


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head, self.ln_1, self.ln_2 = n_head, nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(d, 2))
        x = x + self.attn_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab=256, block=64, d=48, n_layer=2, n_head=4):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def corpus() -> torch.Tensor:
    text = "".join(inspect.getsource(m) for m in (json, textwrap, argparse, inspect))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--apply", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    data, block, batch = corpus(), 64, 8
    model = GPT(block=block)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
    warmup = max(args.steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    )
    window = min(200, args.steps // 3)
    # --apply: nanoGPT's τ = 1.0 until the window closes, the calibrated τ after; else nanoGPT's step exactly
    clip = recommended_calibration(total_steps=args.steps, window=window, cap=1.0) if args.apply else None
    state = AmpTrainState(
        model, optimizer, dtype="bf16", max_norm=1.0, clip=clip, scheduler=schedule, accumulation_steps=2
    )
    with StepCSVWriter("steps.csv") as csv:
        for _ in range(args.steps):
            i = torch.randint(0, len(data) - block - 1, (batch,))
            seq = torch.stack([data[j : j + block + 1] for j in i.tolist()])
            log = state.step(seq[:, :-1], seq[:, 1:])  # the model's own (logits, loss): no loss_fn
            csv.write(log)
    print(f"final loss {log.loss:.3f}, last pre-clip norm {log.grad_l2_pre_clip:.4g}")
    if clip is None:
        return
    print(clip.placement.reason)
    for s, check in zip(clip.summaries, clip.checks()):
        low, high = (f"{x:.4g}" if math.isfinite(x) else "no bound" for x in (s.tau_ci.low, s.tau_ci.high))
        print(f"window {s.start_step}-{s.end_step}: τ = {s.recommended_max_norm:.4g} [{low}, {high}]")
        if check is not None:
            print(f"  {check.verdict}; next: {check.action}")


if __name__ == "__main__":
    main()
