"""Norm-pattern diagnosis on synthetic traces: each pattern found, a healthy trace gives nothing."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from clipamp_engine.csvlog import StepCSVWriter
from clipamp_engine.diagnosis import FINDING_KINDS, Finding, diagnose, format_findings
from clipamp_engine.records import SkipLog, StepLog

stats = pytest.importorskip("scipy.stats")


def _trace(norms, *, tau=10.0, scale=None, sources=None, skipped=None, reasons=None):
    rows = []
    for i, n in enumerate(norms):
        skip = bool(skipped[i]) if skipped is not None else False
        post = math.nan if skip else min(n, tau) if math.isfinite(n) else n
        rows.append(
            {
                "step": i + 1,
                "lr": 1e-3,
                "grad_l2_pre_clip": n,
                "grad_l2_post_clip": post,
                "loss": 2.0,
                "skipped": skip,
                "skip_reason": (reasons[i] if reasons else "nonfinite_grad") if skip else "",
                "scaler_scale": 1.0 if scale is None else scale[i],
                "max_norm": tau,
                "data_source": sources[i] if sources else "",
            }
        )
    return rows


def _healthy(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return list(np.exp(rng.normal(0.0, 0.15, n)))


def _kinds(findings):
    return [f.kind for f in findings]


def test_healthy_trace_has_no_findings():
    rows = _trace(_healthy(), tau=2.0)
    assert diagnose(rows) == []
    assert "no findings" in format_findings([])


def test_spikes_and_the_dominant_data_source():
    norms = _healthy()
    sources = ["books" if i % 4 else "web" for i in range(len(norms))]
    spikes = [60, 130, 200, 271, 350]
    for i in spikes:
        norms[i] *= 20
        sources[i] = "forum"
    norms[300] *= 20  # one spike from another source
    findings = diagnose(_trace(norms, tau=100.0, sources=sources))
    assert _kinds(findings) == ["spikes"]
    f = findings[0]
    assert f.steps == sorted([i + 1 for i in spikes] + [301])
    assert f.evidence["dominant_source"] == "forum"
    assert f.evidence["spike_sources"] == {"forum": 5, "web": 1}
    assert f.evidence["max_ratio"] > 10


def test_a_spikes_median_is_of_the_finite_norms_before_it_and_says_so():
    """A log of every 3rd step (or one with skipped steps): the median is of the 50 finite norms before the spike,
    which span 150 steps, and the finding says norms, not steps."""
    norms = _healthy(200, seed=2)
    norms[151] *= 30
    rows = _trace(norms, tau=100.0, skipped=[i % 7 == 3 for i in range(200)])
    for row in rows:
        row["step"] *= 3
    f = next(f for f in diagnose(rows) if f.kind == "spikes")
    finite = [n for i, n in enumerate(norms[:151]) if i % 7 != 3]
    assert f.steps == [456] and f.evidence["window_medians"] == [float(np.median(finite[-50:]))]
    assert "above 5× the median of the previous 50 finite norms (worst" in f.message


def test_slow_growth():
    rng = np.random.default_rng(1)
    steps = np.arange(600)
    norms = list(np.exp(steps / 300 + rng.normal(0, 0.2, len(steps))))  # ×e² over the run, noisy
    findings = diagnose(_trace(norms, tau=1e6))
    assert _kinds(findings) == ["slow_growth"]
    ev = findings[0].evidence
    assert ev["spearman_rho"] > 0.8 and ev["ratio"] > 2
    assert ev["growth_per_1000_steps"] == pytest.approx(math.exp(1000 / 300), rel=0.3)


def test_always_clipped():
    findings = diagnose(_trace(_healthy(), tau=0.5))
    assert _kinds(findings) == ["always_clipped"]
    f = findings[0]
    assert f.severity == "error" and f.evidence["clip_ratio"] > 0.9
    assert f.evidence["max_norm_median"] == 0.5 and f.evidence["norm_p50"] == pytest.approx(1.0, rel=0.1)
    assert f"taken steps were clipped (τ≈0.5 vs median norm {f.evidence['norm_p50']:.3g}, p95" in f.message


def test_nonfinite_steps_counts_and_reasons():
    norms = _healthy(200)
    skipped = [False] * 200
    reasons = [""] * 200
    for i, r in [(20, "nonfinite_grad"), (21, "nonfinite_grad"), (150, "nonfinite_loss")]:
        skipped[i], reasons[i] = True, r
        norms[i] = math.inf if r == "nonfinite_grad" else math.nan
    findings = diagnose(_trace(norms, tau=5.0, skipped=skipped, reasons=reasons))
    assert _kinds(findings) == ["nonfinite"]
    f = findings[0]
    assert f.steps == [21, 22, 151]
    assert f.evidence["reasons"] == {"nonfinite_grad": 2, "nonfinite_loss": 1}
    assert f.severity == "warning"  # 1.5% of steps


def test_zero_norm():
    norms = _healthy(100)
    for i in (10, 11, 12):
        norms[i] = 0.0
    findings = diagnose(_trace(norms, tau=5.0))
    assert _kinds(findings) == ["zero_norm"]
    assert findings[0].steps == [11, 12, 13] and findings[0].severity == "warning"
    assert diagnose(_trace([0.0] * 50, tau=5.0))[0].severity == "error"


def test_scale_oscillating():
    scale = [2.0 ** (10 + (i // 20) % 2) for i in range(400)]  # up and down every 20 steps
    findings = diagnose(_trace(_healthy(), tau=5.0, scale=scale))
    assert _kinds(findings) == ["scale_oscillating"]
    assert findings[0].evidence["reversals"] >= 18
    # GradScaler's normal rhythm (grow every 2000 steps, back off once) is not oscillation
    calm = [2.0 ** (10 + (i // 2000) % 2) for i in range(8000)]
    assert diagnose(_trace(list(np.ones(8000)), tau=5.0, scale=calm)) == []


def test_scale_at_floor_but_not_for_a_disabled_scaler():
    n = 60
    scale = [max(2.0 ** (8 - i), 1.0) for i in range(n)]
    skipped = [s <= 1.0 and i % 2 == 0 for i, s in enumerate(scale)]
    norms = [math.inf if s else 1.0 for s in skipped]
    findings = diagnose(_trace(norms, tau=5.0, scale=scale, skipped=skipped))
    assert "scale_at_floor" in _kinds(findings)
    f = next(f for f in findings if f.kind == "scale_at_floor")
    assert f.steps[0] == 9 and f.evidence["overflows_at_floor"] > 0 and f.severity == "error"
    assert findings[0].severity == "error"  # most severe first
    assert diagnose(_trace(_healthy(), tau=5.0, scale=[1.0] * 400)) == []  # bf16: constant 1.0


def test_reads_steplogs_and_csv_rows(tmp_path):
    records = []
    for i, n in enumerate(_healthy(120), 1):
        records.append(
            StepLog(
                step=i,
                lr=1e-3,
                grad_l2_pre_clip=float(n),
                grad_l2_post_clip=min(float(n), 0.5),
                loss=1.0,
                scaler_scale=1.0,
                clipped=n > 0.5,
                max_norm=0.5,
            )
        )
    records.append(
        SkipLog(
            step=121,
            lr=1e-3,
            grad_l2_pre_clip=math.inf,
            grad_l2_post_clip=math.nan,
            loss=1.0,
            scaler_scale=1.0,
            clipped=False,
            max_norm=0.5,
            skip_reason="nonfinite_grad",
        )
    )
    direct = diagnose(records)
    path = tmp_path / "steps.csv"
    with StepCSVWriter(path) as w:
        for r in records:
            w.write(r)
    with open(path, newline="") as fh:
        from_csv = diagnose(list(csv.DictReader(fh)))
    assert _kinds(direct) == _kinds(from_csv) == ["always_clipped", "nonfinite"]
    assert [f.steps for f in direct] == [f.steps for f in from_csv]


def test_format_findings_is_a_markdown_list():
    f = Finding("spikes", "warning", "2 norm spikes", list(range(1, 15)), {"count": 2})
    text = format_findings([f])
    assert text.startswith("- **spikes** (warning): 2 norm spikes — steps 1, 2, 3")
    assert "(+4)" in text
    plain = format_findings([f], markdown=False)  # a terminal shows no markdown
    assert plain == text.replace("**spikes**", "spikes")
    assert set(FINDING_KINDS) == {
        "nonfinite",
        "zero_norm",
        "spikes",
        "slow_growth",
        "always_clipped",
        "sustained_clipping",
        "scale_oscillating",
        "scale_at_floor",
    }


def _with_lr(rows, warmup):
    for r in rows:
        r["lr"] = 3e-3 * min(1.0, r["step"] / warmup)
    return rows


def test_sustained_clipping_after_warmup_is_found_and_warmup_clipping_is_not():
    norms = _healthy(400)
    rows = _with_lr(_trace(norms, tau=1.1), warmup=20)  # lognormal(0, .15) > 1.1: ~26% of steps
    for r in rows[:20]:
        r["grad_l2_pre_clip"] *= 5  # a warm-up burst, clipped: not a finding by itself
    clipped = np.array([r["grad_l2_pre_clip"] > 1.1 for r in rows])
    found = [f for f in diagnose(rows) if f.kind == "sustained_clipping"]
    assert len(found) == 1
    f = found[0]
    after = clipped[20:]
    counts = np.convolve(after.astype(float), np.ones(50), "valid")  # the reference computation
    lower = stats.beta.ppf(0.025, counts, 50 - counts + 1)  # Clopper–Pearson lower bound of each window
    assert f.evidence["warmup_end"] == 21 and f.evidence["peak_ratio"] == pytest.approx(counts.max() / 50)
    assert f.evidence["windows_over"] == int((lower > 0.05).sum()) > 0
    # the same trace clipped only during warm-up: nothing sustained
    calm = _with_lr(_trace(norms, tau=3.0), warmup=20)
    for r in calm[:20]:
        r["grad_l2_pre_clip"] *= 5
    assert "sustained_clipping" not in _kinds(diagnose(calm))


def test_always_clipped_takes_precedence_over_sustained():
    rows = _with_lr(_trace(_healthy(200), tau=0.5), warmup=10)
    assert "always_clipped" in _kinds(diagnose(rows)) and "sustained_clipping" not in _kinds(diagnose(rows))


def test_a_few_clips_in_band_are_not_sustained_clipping():
    """3 clipped of 50 steps (6%) is within the noise of a 3% target: no finding; 7 of 50 is."""
    for k, found in ((3, False), (6, False), (7, True)):
        norms = [2.0 if i % 50 < k else 1.0 for i in range(200)]
        rows = _with_lr(_trace(norms, tau=1.5), warmup=1)
        assert ("sustained_clipping" in _kinds(diagnose(rows))) is found, k


def test_sustained_clipping_on_a_sampled_log_states_the_runs_steps():
    """A log of every 10th step (LR warm-up to step 500): the warm-up ends at logged step 510, not at row 51's
    "step 60"; its clipped warm-up rows stay out of the rolling windows; a 50-row window is 500 steps."""
    norms = _healthy(2000)
    rows = _with_lr(_trace(norms, tau=1.1), warmup=500)
    for r in rows[:500]:
        r["grad_l2_pre_clip"] *= 5  # a clipped warm-up: no part of a sustained window
    sampled = [r for r in rows if r["step"] % 10 == 0]
    [f] = [f for f in diagnose(sampled) if f.kind == "sustained_clipping"]
    after = np.array([r["grad_l2_pre_clip"] > 1.1 for r in sampled if r["step"] >= 510])
    counts = np.convolve(after.astype(float), np.ones(50), "valid")  # the reference, over post-warm-up rows only
    lower = stats.beta.ppf(0.025, counts, 50 - counts + 1)
    assert f.evidence["warmup_end"] == 510 and f.evidence["log_interval"] == 10
    assert f.evidence["windows_over"] == int((lower > 0.05).sum()) > 0
    assert "after the LR warm-up (step 510) the clipping ratio over 500 steps (50 logged, one every 10)" in f.message
    assert all(s % 10 == 0 and s >= 510 + 490 for s in f.steps)  # each window's last step, a logged step


def test_slow_growth_states_the_steps_it_spans_not_the_values_counted():
    rng = np.random.default_rng(1)
    steps = np.arange(600)
    norms = list(np.exp(steps / 300 + rng.normal(0, 0.2, len(steps))))
    sampled = [r for r in _trace(norms, tau=1e6) if r["step"] % 5 == 0]  # HF logging_steps=5: 120 values
    [f] = [f for f in diagnose(sampled) if f.kind == "slow_growth"]
    assert "rises steadily over steps 5–600 (120 logged finite values)" in f.message
    assert (f.evidence["steps"], f.evidence["span_steps"]) == (120, 596)
    gappy = _trace([math.nan if i in (100, 200, 300) else x for i, x in enumerate(norms)], tau=1e6)
    [f] = [f for f in diagnose(gappy) if f.kind == "slow_growth"]
    assert "rises steadily over steps 1–600 (597 logged finite values)" in f.message
    [f] = [f for f in diagnose(_trace(norms, tau=1e6)) if f.kind == "slow_growth"]
    assert "rises steadily over 600 steps" in f.message  # every step: as before
