"""The safety pipeline after backward, on 50M gradients: canonical recipe vs fused path vs the floor.

    python bench/bench_pipeline.py [--numel 50e6] [--rounds 9] [--iters 3] [--variants fp32,bf16] [--threads N]
                                   [--clock wall|process] [--malloc-keep] [--device cuda] [--json FILE]

Arms (every one sees the same gradients, restored before each timed call, untimed):
  (a) canonical: GradScaler unscale + ``clip_grad_norm_`` + foreach AdamW
  (b) canonical with fused AdamW
  (c) the floor, each round the faster of two recipes with the engine's norm (one ``_foreach_norm``
      accumulating in fp32) and skip flag on the device:
      (cg) fused AdamW given ``grad_scale``/``found_inf`` (the kernel divides by the factor);
      (cm) one ``_foreach_mul_`` by the factor, then fused AdamW given ``found_inf`` only
  (d) ``AmpTrainState`` fused path (record materialised every step, as on CPU by default), with the
      recipe ``clipamp_engine.fused.FACTOR_RECIPES`` picks for the device and dtype
  (e) ``AmpTrainState`` default path (foreach AdamW)
Variants: ``fp32`` (fp32 gradients, loss scaling on, as fp16 AMP) and ``bf16`` (bf16 parameters
and gradients, no loss scaling, as bf16 AMP). Arms run in a rotated order each round; each
figure is the median over rounds of the per-round paired ratio. Goals: (d) at least as fast as (b)
and (d)/(c) <= 1.05. (b)'s ``clip_grad_norm_`` norms bf16 gradients into bf16 (8 mantissa bits);
(c), (d) and (e) norm them in fp32, which on CPU costs a conversion pass (no CPU kernel reduces
bf16 into an fp32 result without one). Memory: parameters, 2 gradient copies (pristine and live)
and the AdamW states (m, v) of the 6 arms' optimizers, 15 full-size copies in all (≈ 3.0 GB at 50M
fp32), plus a full-size temporary during a foreach AdamW step.

``--clock process``: CPU time of this process instead of wall time (on a shared CPU, with
``--threads 1``, it does not count the time other processes hold the cores). ``--malloc-keep``
(glibc): keep freed heap memory in the process (``mallopt``: mmap threshold 32 MiB, trim threshold
2 GiB); by default glibc may hand the fp32 temporaries that the CPU norm of bf16 gradients
allocates back to the system after each call, and the next call page-faults them in again.
``--device cuda``: every tensor on the GPU, each timed call bracketed by ``torch.cuda.synchronize()``;
also prints the achieved memory bandwidth of (c) and (d) — ``TRAFFIC`` passes over the gradient
elements (norm: read g; AdamW: read p, g, m, v, write p, m, v) per call — against the device's peak
(memory clock × bus width × 2, from ``torch.cuda.get_device_properties``) and the measured bandwidth
of a 1 GiB device-to-device copy (:func:`copy_gbs`). ``--json``: the figures.
"""

from __future__ import annotations

import argparse
import ctypes
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
ARMS = ("a", "b", "cg", "cm", "d", "e")
NAMES = {
    "a": "canonical (unscale + clip_grad_norm_ + foreach AdamW)",
    "b": "canonical + fused AdamW",
    "cg": "floor: _foreach_norm + fused AdamW(grad_scale, found_inf)",
    "cm": "floor: _foreach_norm + _foreach_mul_ + fused AdamW(found_inf)",
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


def floor_arm(params, scaling: bool, multiply: bool):
    """The least work the fused path can do: one norm, the factor and skip flag on the device, one
    AdamW pass given the factor as ``grad_scale`` or, with ``multiply``, after one ``_foreach_mul_``."""
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    inv = 1.0 / SCALE if scaling else 1.0

    def run():
        grads = [p.grad for p in params]
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        pre = torch.linalg.vector_norm(torch.stack(norms)) * inv
        factor = torch.clamp(MAX_NORM / (pre + 1e-6), max=1.0) * inv
        opt.found_inf = (~torch.isfinite(pre)).float()
        if multiply:
            torch._foreach_mul_(grads, factor)
        else:
            opt.grad_scale = 1.0 / factor
        opt.step()
        opt.grad_scale = opt.found_inf = None

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

    run.state = state
    return run


def peak_gbs(device: str) -> float | None:
    """The device's peak memory bandwidth in GB/s (double data rate), None where torch does not say."""
    if device != "cuda":
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def copy_gbs(device: str, nbytes: int = 2**30, reps: int = 10) -> float:
    """The device's measured copy bandwidth in GB/s: a ``copy_`` between two ``nbytes`` buffers of
    random data (several times the L2), bytes read plus bytes written, median of ``reps`` calls
    after three warm-ups, each bracketed by a synchronize. The ceiling the achieved figures are
    read against; the datasheet's (:func:`peak_gbs`) is a lead."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(3 + reps):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def bench_variant(name: str, dtype: torch.dtype, scaling: bool, args) -> dict:
    torch.manual_seed(0)
    module = make_params(int(args.numel), dtype, args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    params = list(module.parameters())
    pristine = [torch.randn_like(p) * (1e-3 * (SCALE if scaling else 1.0)) for p in params]
    for p, g in zip(params, pristine):
        p.grad = g.clone()
    live = [p.grad for p in params]
    runs = {
        "a": hand_arm(params, False, scaling),
        "b": hand_arm(params, True, scaling),
        "cg": floor_arm(params, scaling, multiply=False),
        "cm": floor_arm(params, scaling, multiply=True),
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
            t = clock()
            runs[arm]()
            sync()
            total += clock() - t
        return total / args.iters

    for arm in ARMS:  # warm-up: lazy optimizer state, first-call overheads
        timed(arm)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
        for arm in order:
            times[arm].append(timed(arm))
    times["c"] = [min(g, m) for g, m in zip(times["cg"], times["cm"])]  # the floor: the faster recipe each round
    numel = sum(p.numel() for p in params)
    print(
        f"\n{name}: {numel / 1e6:.1f}M {str(dtype).removeprefix('torch.')} gradients, loss scaling "
        f"{'on' if scaling else 'off'}, {args.rounds} rounds x {args.iters} calls, {torch.get_num_threads()} threads, "
        f"{args.clock} clock"
    )
    recipe = runs["d"].state.fused_recipe
    for arm in ARMS:
        label = NAMES[arm] + (f" ({recipe})" if arm == "d" else "")
        print(f"  ({arm:2s}) {label:66s} {statistics.median(times[arm]) * 1e3:8.2f} ms")

    def paired(x: str, y: str) -> float:
        return statistics.median(a / b for a, b in zip(times[x], times[y]))

    ratios = {"a/d": paired("a", "d"), "b/d": paired("b", "d"), "e/d": paired("e", "d"), "d/c": paired("d", "c")}
    ratios["cg/cm"] = paired("cg", "cm")
    print(
        f"  speed-up of (d) over (a): {ratios['a/d']:.3f}x (goal >= 1.3)   over (b): {ratios['b/d']:.3f}x "
        f"(goal >= 1.0)   over (e): {ratios['e/d']:.3f}x"
    )
    print(
        f"  (d) / floor (c): {ratios['d/c']:.3f} (goal <= 1.05)   floor recipes (cg)/(cm): {ratios['cg/cm']:.3f} "
        f"(> 1: the multiply is faster)"
    )
    ms = {arm: statistics.median(times[arm]) * 1e3 for arm in (*ARMS, "c")}
    out = {"numel": numel, "dtype": str(dtype).removeprefix("torch."), "loss_scaling": scaling, "ms": ms}
    out |= {"ratios": ratios, "engine_recipe": recipe, "clock": args.clock, "threads": torch.get_num_threads()}
    out["malloc_keep"] = args.malloc_keep
    if args.device != "cpu":
        traffic = TRAFFIC * numel * module[0].element_size() / 1e9  # GB per call at the floor
        peak, copy = peak_gbs(args.device), args.copy_gbs
        gbs = {arm: traffic / (ms[arm] / 1e3) for arm in ("c", "d")}
        print(f"  achieved bandwidth ({TRAFFIC} passes over the gradient elements): {bandwidth_line(gbs, copy, peak)}")
        out |= {"traffic_gb": traffic, "achieved_gbs": gbs, "copy_gbs": copy, "peak_gbs": peak}
    return out  # its buffers go with the frame


def bandwidth_line(gbs: dict[str, float], copy: float | None, peak: float | None) -> str:
    """``(c) 3900 GB/s = 91% of copy 4300, 79% of peak 4916   (d) …``: each arm against the measured
    copy bandwidth and the datasheet peak, where known."""
    ceilings = [(name, c) for name, c in (("copy", copy), ("peak", peak)) if c]
    return "   ".join(
        f"({a}) {g:.0f} GB/s"
        + (" = " + ", ".join(f"{g / c:.0%} of {n} {c:.0f}" for n, c in ceilings) if ceilings else "")
        for a, g in gbs.items()
    )


def keep_freed_memory() -> None:
    """glibc's ``mallopt``: serve blocks up to 32 MiB from the heap and never trim it below 2 GiB."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    if not (libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, (2 << 30) - 1)):
        raise SystemExit("--malloc-keep: glibc's mallopt refused the thresholds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=float, default=50e6, help="gradient elements")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--iters", type=int, default=3, help="timed calls per arm and round")
    ap.add_argument("--variants", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--clock", default="wall", choices=["wall", "process"], help="process: this process's CPU time")
    ap.add_argument("--malloc-keep", action="store_true", help="glibc: keep freed memory (no page faults per call)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.malloc_keep:
        keep_freed_memory()
    print(f"torch {torch.__version__}" + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""))
    args.copy_gbs = copy_gbs(args.device) if args.device != "cpu" else None
    if args.copy_gbs:
        print(f"measured copy bandwidth: {args.copy_gbs:.0f} GB/s (read + write)")
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
