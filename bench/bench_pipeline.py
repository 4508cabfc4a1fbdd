"""The safety pipeline after backward, on 50M gradients: canonical recipe vs fused path vs the floor.

    python bench/bench_pipeline.py [--numel 50e6] [--rounds 9] [--iters 3] [--variants fp32,bf16] [--threads N]
                                   [--device cuda] [--json FILE]

Arms (every one sees the same gradients, restored before each timed call, untimed):
  (a) canonical: GradScaler unscale + ``clip_grad_norm_`` + foreach AdamW
  (b) canonical with fused AdamW
  (c) lower bound: one ``_foreach_norm`` + fused AdamW given ``grad_scale``/``found_inf``
  (d) ``AmpTrainState`` fused path (record materialised every step, as on CPU by default)
  (e) ``AmpTrainState`` default path (foreach AdamW)
Variants: ``fp32`` (fp32 gradients, loss scaling on, as fp16 AMP) and ``bf16`` (bf16 parameters
and gradients, no loss scaling, as bf16 AMP). Arms run in a rotated order each round; each
figure is the median over rounds of the per-round paired ratio. Goal: (a)/(d) ≥ 1.3 and
(d)/(c) ≤ 1.05. Memory: parameters + 2 gradient copies + 5 AdamW states (≈ 2.6 GB at 50M fp32).

``--device cuda``: every tensor on the GPU, each timed call bracketed by ``torch.cuda.synchronize()``;
also prints the achieved memory bandwidth of (c) and (d) — ``TRAFFIC`` passes over the gradient
elements (norm: read g; AdamW: read p, g, m, v, write p, m, v) per call — against the device's peak
(memory clock × bus width × 2, from ``torch.cuda.get_device_properties``). ``--json``: the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from clipamp_engine.distributed import GlobalBatchLoss, Replicas
from clipamp_engine.fused_step import fused_update
from clipamp_engine.scaling import LossScaler
from clipamp_engine.step import AmpTrainState

SCALE = 2.0**16
MAX_NORM = 1.0
#: Tensor passes per call of the floor (c): one norm read of g; AdamW reads p, g, m, v and writes p, m, v.
TRAFFIC = 8
ARMS = ("a", "b", "c", "d", "e")
NAMES = {
    "a": "canonical (unscale + clip_grad_norm_ + foreach AdamW)",
    "b": "canonical + fused AdamW",
    "c": "floor: _foreach_norm + fused AdamW(grad_scale, found_inf)",
    "d": "AmpTrainState fused path",
    "e": "AmpTrainState default path",
}


def make_params(numel: int, dtype: torch.dtype, device: str = "cpu") -> nn.ParameterList:
    """Square weights of 1M elements plus 1K biases, ``numel`` elements in all."""
    n = max(1, round(numel / 1_001_000))
    return nn.ParameterList(
        [
            nn.Parameter(torch.randn(*shape, dtype=dtype, device=device) * 0.02)
            for _ in range(n)
            for shape in ((1000, 1000), (1000,))
        ]
    )


def hand_arm(params, fused: bool, scaling: bool):
    device = params[0].device.type
    opt = torch.optim.AdamW(params, lr=1e-5, fused=fused, foreach=None if fused else True)
    scaler = LossScaler(device, init_scale=SCALE, growth_interval=10**9, enabled=scaling)
    scaler.scale(torch.ones((), device=device))  # the scale exists, as after a scaled backward

    def run():
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        scaler.step(opt)
        scaler.update()

    return run


def floor_arm(params, scaling: bool):
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    inv = 1.0 / SCALE if scaling else 1.0

    def run():
        norms = torch._foreach_norm([p.grad for p in params], 2.0, dtype=torch.float32)
        pre = torch.linalg.vector_norm(torch.stack(norms)) * inv
        coef = torch.clamp(MAX_NORM / (pre + 1e-6), max=1.0)
        opt.grad_scale, opt.found_inf = (1.0 / inv) / coef, (~torch.isfinite(pre)).float()
        opt.step()
        del opt.grad_scale, opt.found_inf

    return run


def engine_arm(module, fused: bool, scaling: bool):
    device = next(module.parameters()).device.type
    opt = torch.optim.AdamW(module.parameters(), lr=1e-5, fused=fused, foreach=None if fused else True)
    scaler = LossScaler(device, init_scale=SCALE, growth_interval=10**9, enabled=scaling)
    state = AmpTrainState(module, opt, None, dtype="fp16" if scaling else "bf16", max_norm=MAX_NORM, scaler=scaler)
    assert state.pipeline == ("fused" if fused else "default")
    state.scaler.scale(torch.ones((), device=device))  # the scale exists, as after a scaled backward
    loss = torch.tensor(2.5, device=device)
    acc = GlobalBatchLoss(1, 1, Replicas())
    acc.add(loss, 1)  # the default path's loss record (its one sync happens before backward, outside the timing)

    def run():  # the engine's part of a step after backward, record included (step() minus backward)
        state.step_count += 1
        if fused:
            fused_update(state, loss)
        else:
            lr, scale = float(opt.param_groups[0]["lr"]), state.scaler.get_scale()
            state._ready.append(state._update(acc, lr, scale))
        state.flush()

    return run


def peak_gbs(device: str) -> float | None:
    """The device's peak memory bandwidth in GB/s (double data rate), None where torch does not say."""
    if device != "cuda":
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def bench_variant(name: str, dtype: torch.dtype, scaling: bool, args) -> dict:
    torch.manual_seed(0)
    module = make_params(int(args.numel), dtype, args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    params = list(module.parameters())
    pristine = [torch.randn_like(p) * (1e-3 * (SCALE if scaling else 1.0)) for p in params]
    for p, g in zip(params, pristine):
        p.grad = g.clone()
    live = [p.grad for p in params]
    runs = {
        "a": hand_arm(params, False, scaling),
        "b": hand_arm(params, True, scaling),
        "c": floor_arm(params, scaling),
        "d": engine_arm(module, True, scaling),
        "e": engine_arm(module, False, scaling),
    }

    def timed(arm: str) -> float:
        total = 0.0
        for _ in range(args.iters):
            for p, g in zip(params, live):
                p.grad = g
            torch._foreach_copy_(live, pristine)
            sync()
            t = time.perf_counter()
            runs[arm]()
            sync()
            total += time.perf_counter() - t
        return total / args.iters

    for arm in ARMS:  # warm-up: lazy optimizer state, first-call overheads
        timed(arm)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
        for arm in order:
            times[arm].append(timed(arm))
    numel = sum(p.numel() for p in params)
    print(
        f"\n{name}: {numel / 1e6:.1f}M {str(dtype).removeprefix('torch.')} gradients, loss scaling "
        f"{'on' if scaling else 'off'}, {args.rounds} rounds x {args.iters} calls, {torch.get_num_threads()} threads"
    )
    for arm in ARMS:
        print(f"  ({arm}) {NAMES[arm]:58s} {statistics.median(times[arm]) * 1e3:8.2f} ms")

    def paired(x: str, y: str) -> float:
        return statistics.median(a / b for a, b in zip(times[x], times[y]))

    ratios = {"a/d": paired("a", "d"), "b/d": paired("b", "d"), "e/d": paired("e", "d"), "d/c": paired("d", "c")}
    print(
        f"  speed-up of (d) over (a): {ratios['a/d']:.3f}x (goal >= 1.3)   over (b): {ratios['b/d']:.3f}x   "
        f"over (e): {ratios['e/d']:.3f}x"
    )
    print(f"  (d) / floor (c): {ratios['d/c']:.3f} (goal <= 1.05)")
    ms = {arm: statistics.median(times[arm]) * 1e3 for arm in ARMS}
    out = {"numel": numel, "dtype": str(dtype).removeprefix("torch."), "loss_scaling": scaling, "ms": ms}
    out["ratios"] = ratios
    if args.device != "cpu":
        traffic = TRAFFIC * numel * module[0].element_size() / 1e9  # GB per call at the floor
        peak = peak_gbs(args.device)
        gbs = {arm: traffic / (ms[arm] / 1e3) for arm in ("c", "d")}
        of_peak = "   ".join(
            f"({a}) {g:.0f} GB/s" + (f" = {g / peak:.0%} of {peak:.0f}" if peak else "") for a, g in gbs.items()
        )
        print(f"  achieved bandwidth ({TRAFFIC} passes over the gradient elements): {of_peak}")
        out |= {"traffic_gb": traffic, "achieved_gbs": gbs, "peak_gbs": peak}
    return out  # its buffers go with the frame


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=50e6, help="gradient elements")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=3, help="timed calls per arm and round")
    ap.add_argument("--variants", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    variants = {"fp32": (torch.float32, True), "bf16": (torch.bfloat16, False)}
    results = {}
    for v in args.variants.split(","):
        results[v] = bench_variant(v, *variants[v], args)
        gc.collect()  # the previous variant's buffers before the next one allocates
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.json is not None:
        args.json.write_text(
            json.dumps({"torch": torch.__version__, "device": args.device, "variants": results}, indent=1)
        )


if __name__ == "__main__":
    main()
