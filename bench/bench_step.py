"""AmpTrainState.step (CSV on) vs the hand-written canonical AMP loop, same model, same data.

    python bench/bench_step.py [--dtype bf16] [--steps 40] [--rounds 5] [--fused]
                               [--device cuda] [--d-model 768 --layers 12 --heads 12 --vocab 50257 --tie]
                               [--deferred] [--threads N] [--json FILE]

Both loops train identical copies of a small byte-level transformer with AdamW under CPU
autocast; rounds alternate A/B so machine noise hits both. Prints per-step medians and the
ratio engine / canonical (goal ≤ 1.03). ``--fused``: both loops use fused AdamW, so the engine
runs its fused path (unscale and clip inside the optimizer's pass) against the canonical recipe.
Absolute times on shared machines are noise; the ratio is the figure.

``--device cuda``: autocast, model and data on the GPU, each round ends with
``torch.cuda.synchronize()``. The defaults are the CPU model (0.48M params); the GPT-2-small shape
(124M params with ``--tie``) is ``--d-model 768 --layers 12 --heads 12 --vocab 50257 --tie``.
``--deferred``: the engine loop calls ``step_deferred`` (records materialised every ``log_every``
steps, no host sync in between; rows written at each flush) instead of ``step``.
``--threads N``: ``torch.set_num_threads(N)`` (0: torch's default, one per core). On a shared CPU,
``--threads 1`` keeps the ratio steady: with every core's thread both loops wait on whichever core
another process holds, and the ratio swings.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from clipamp_engine.csvlog import StepCSVWriter
from clipamp_engine.scaling import LossScaler
from clipamp_engine.step import AmpTrainState


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=256, d=128, layers=2, heads=4, block=128):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(block, d))
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(d, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        h = self.emb(x) + self.pos[:t]
        return self.head(self.blocks(h, mask=self.mask[:t, :t], is_causal=True))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def canonical_step(model, opt, scaler, x, y, dtype, max_norm, device="cpu"):
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        loss = lm_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--steps", type=int, default=40, help="steps per round and loop")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--fused", action="store_true", help="fused AdamW in both loops (engine: fused path)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--tie", action="store_true", help="tie the output head to the embedding (as GPT-2)")
    ap.add_argument("--deferred", action="store_true", help="engine loop: step_deferred, rows written at flushes")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.manual_seed(0)
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    base = TinyLM(vocab=args.vocab, d=args.d_model, layers=args.layers, heads=args.heads, block=args.seq)
    if args.tie:
        base.head.weight = base.emb.weight
    base = base.to(dev)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq + 1)).to(dev) for _ in range(8)]
    batches = [(d[:, :-1], d[:, 1:]) for d in data]

    m_ref = copy.deepcopy(base)
    o_ref = torch.optim.AdamW(m_ref.parameters(), lr=1e-3, fused=args.fused)
    s_ref = LossScaler(dev, enabled=args.dtype == "fp16")
    m_eng = copy.deepcopy(base)
    o_eng = torch.optim.AdamW(m_eng.parameters(), lr=1e-3, fused=args.fused)
    s_eng = LossScaler(dev, enabled=args.dtype == "fp16")
    state = AmpTrainState(m_eng, o_eng, lm_loss, dtype=args.dtype, max_norm=1.0, scaler=s_eng)
    tmp = tempfile.TemporaryDirectory()
    writer = StepCSVWriter(Path(tmp.name) / "steps.csv")

    def run_ref(n):
        sync()
        t = time.perf_counter()
        for i in range(n):
            canonical_step(m_ref, o_ref, s_ref, *batches[i % len(batches)], tdtype, 1.0, dev)
        sync()
        return (time.perf_counter() - t) / n

    def run_eng(n):
        sync()
        t = time.perf_counter()
        for i in range(n):
            if args.deferred:
                for record in state.step_deferred(*batches[i % len(batches)]):
                    writer.write(record)
            else:
                writer.write(state.step(*batches[i % len(batches)]))
        for record in state.flush():
            writer.write(record)
        sync()
        return (time.perf_counter() - t) / n

    run_ref(3), run_eng(3)  # warm-up
    ref_times, eng_times = [], []
    for r in range(args.rounds):
        first, second = (run_ref, run_eng) if r % 2 == 0 else (run_eng, run_ref)
        a, b = first(args.steps), second(args.steps)
        ref_t, eng_t = (a, b) if first is run_ref else (b, a)
        ref_times.append(ref_t)
        eng_times.append(eng_t)
    writer.close()
    ref_med, eng_med = statistics.median(ref_times), statistics.median(eng_times)
    params = sum(p.numel() for p in base.parameters())
    where = f"{torch.cuda.get_device_name()}" if dev == "cuda" else f"{torch.get_num_threads()} threads"
    print(
        f"model: {params / 1e6:.2f}M params, batch {args.batch}x{args.seq}, {args.dtype}, "
        f"{args.rounds} rounds x {args.steps} steps, torch {torch.__version__}, {where}, "
        f"AdamW {'fused' if args.fused else 'foreach'}, engine path {state.pipeline}"
        + (f", step_deferred (log_every {state.log_every})" if args.deferred else "")
    )
    print(f"canonical loop : {ref_med * 1e3:8.2f} ms/step  (rounds: {', '.join(f'{t * 1e3:.1f}' for t in ref_times)})")
    print(f"AmpTrainState  : {eng_med * 1e3:8.2f} ms/step  (rounds: {', '.join(f'{t * 1e3:.1f}' for t in eng_times)})")
    paired = statistics.median(e / r for e, r in zip(eng_times, ref_times))
    print(
        f"ratio engine/canonical: {paired:.3f} median of per-round pairs, {eng_med / ref_med:.3f} "
        f"ratio of medians  (goal <= 1.03)"
    )
    if args.json is not None:
        figures = {"params": params, "dtype": args.dtype, "device": dev, "batch": args.batch, "seq": args.seq}
        figures["threads"] = torch.get_num_threads()
        figures |= {"pipeline": state.pipeline, "deferred": args.deferred, "canonical_ms": ref_med * 1e3}
        figures |= {"engine_ms": eng_med * 1e3, "ratio_paired": paired, "ratio_of_medians": eng_med / ref_med}
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
