"""Norm-pattern diagnosis: read a run's per-step records and name what the norms say.

A table of norm patterns and their usual causes, made executable:

=====================  ==========================================================
kind                   likely cause
=====================  ==========================================================
``spikes``             bad samples, long sequences, label bugs (which data source?)
``slow_growth``        LR too high, instability accumulating
``always_clipped``     threshold too low, or LR / loss scale / loss normalisation wrong
``sustained_clipping`` after the LR warm-up, the rolling clipping ratio stays above the band
``nonfinite``          overflow, invalid loss, bad input
``zero_norm``          detached graph, frozen params, empty loss mask
``scale_oscillating``  fp16 loss scale bouncing: overflows recur right after growth
``scale_at_floor``     fp16 overflows even at the smallest loss scale
=====================  ==========================================================

``diagnose(records)`` takes ``StepLog``/``SkipLog`` objects or row dicts (e.g. from
``csv.DictReader`` over a steps CSV: strings are parsed) with the canonical columns and
optionally ``max_norm``, ``clipped``, ``data_source``, ``scaler_at_floor``. Thresholds are
keyword arguments with the defaults documented on ``diagnose``. Numpy, and torch for the binomial
interval (``clipamp_engine.band.clopper_pearson``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .findings import FINDING_KINDS, SEVERITIES, Finding, format_findings
from .norm_patterns import (
    Trace,
    find_always_clipped,
    find_nonfinite,
    find_scale_at_floor,
    find_scale_oscillating,
    find_slow_growth,
    find_spikes,
    find_sustained_clipping,
    find_zero_norm,
    trace_rows,
)
from .records import StepLog

__all__ = ["FINDING_KINDS", "SEVERITIES", "Finding", "diagnose", "format_findings"]


def diagnose(
    records: Iterable[StepLog | Mapping[str, Any]],
    *,
    spike_window: int = 50,
    spike_factor: float = 5.0,
    spike_min_history: int = 10,
    growth_min_steps: int = 40,
    growth_min_rho: float = 0.5,
    growth_min_ratio: float = 2.0,
    clip_ratio_above: float = 0.5,
    clip_min_steps: int = 20,
    sustained_window: int = 50,
    sustained_above: float = 0.05,
    scale_min_reversals: int = 4,
    scale_max_period: int = 200,
    min_scale: float = 1.0,
) -> list[Finding]:
    """Name the norm patterns in a run's records (empty list: nothing to report).

    Args:
        records: ``StepLog``/``SkipLog`` objects or row dicts, in step order.
        spike_window, spike_factor, spike_min_history: a spike is a finite norm above
            ``spike_factor`` × the median of the previous ``spike_window`` finite norms of taken steps (once
            ``spike_min_history`` are available).
        growth_min_steps, growth_min_rho, growth_min_ratio: slow growth needs that many
            positive norms, a Spearman rank correlation of norm vs step ≥ ``growth_min_rho``
            (and t-statistic > 3), and a last-quarter median ≥ ``growth_min_ratio`` × the
            first-quarter median.
        clip_ratio_above, clip_min_steps: "always clipped" when more than this share of at
            least that many taken steps were clipped (``clipped`` column, else post < pre,
            else pre > max_norm).
        sustained_window, sustained_above: "sustained clipping" when, after the LR warm-up (the
            first step whose LR did not rise), the clipping ratio over some ``sustained_window``
            consecutive taken steps exceeds ``sustained_above`` (the top of the pretraining
            band) beyond noise: the exact 95% lower bound of that ratio is above it (over 50 steps
            that takes ≥ 7 clipped steps, not 3); skipped when ``always_clipped`` already fires.
        scale_min_reversals, scale_max_period: the loss scale "oscillates" when it reverses
            direction at least that many times, at least once per ``scale_max_period`` steps.
        min_scale: the scaler's floor (a disabled scaler's constant 1.0 never counts).

    Returns:
        ``Finding`` objects, most severe first.
    """
    rows = trace_rows(records)
    if not rows:
        return []
    t = Trace(rows)
    found = [
        find_nonfinite(t),
        find_zero_norm(t),
        find_spikes(t, spike_window, spike_factor, spike_min_history),
        find_slow_growth(t, growth_min_steps, growth_min_rho, growth_min_ratio),
        (always := find_always_clipped(t, clip_ratio_above, clip_min_steps)),
        None if always else find_sustained_clipping(t, sustained_window, sustained_above),
        find_scale_oscillating(t, scale_min_reversals, scale_max_period),
        find_scale_at_floor(t, min_scale),
    ]
    findings = [f for f in found if f is not None]
    return sorted(findings, key=lambda f: -SEVERITIES.index(f.severity))
