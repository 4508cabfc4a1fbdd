"""A run's norm figures draw what the run measured and used: the quantiles p50/p90/p95/p99 (not their
confidence intervals) and, in red, the τ the steps were clipped at (their ``max_norm``, the ``tau_used``
tag), with the recommended τ labelled as a recommendation where the run did not clip at it."""

from __future__ import annotations

import math
import random

import pytest

import sweep.report.plots as plots
import sweep.report.run as run_report
from clipamp_engine.calibration import QUANTILE_KEYS
from sweep.run.loop import RunRecords
from sweep.run.pipeline import RunResult
from sweep.run.summary import summary_metrics, tau_tags
from tests.app.helpers import TINY, compose_cfg


def _rows(n: int = 60, max_norm: float | None = 1.0) -> list[dict]:
    rnd = random.Random(0)
    rows = []
    for step in range(1, n + 1):
        pre = math.exp(rnd.gauss(0.3, 0.5))
        clipped = max_norm is not None and pre > max_norm
        rows.append(
            dict(
                step=step,
                loss=5.0 - step / n,
                grad_l2_pre_clip=pre,
                grad_l2_post_clip=min(pre, max_norm) if max_norm else pre,
                skipped=False,
                clipped=clipped,
                scaler_scale=1.0,
                lr=1e-3,
                max_norm=max_norm,
                phase="train",
            )
        )
    return rows


class _Tracker:
    def __init__(self, root):
        self.root = root

    def artifact_path(self, name):
        p = self.root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        return p


@pytest.fixture
def figures(monkeypatch):
    """Each saved figure's file name → (legend labels, annotation texts, red-line y or x data)."""
    seen: dict[str, dict] = {}
    real_save = plots.save

    def save(fig, path, dpi=90):
        ax = fig.axes[0]
        red = [line for line in ax.get_lines() if line.get_color() == "red"]
        seen[path.name] = dict(
            labels=ax.get_legend_handles_labels()[1],
            texts=[t.get_text() for t in ax.texts],
            red=[list(line.get_ydata()) if path.name == "grad_norm.png" else list(line.get_xdata()) for line in red],
        )
        return real_save(fig, path, dpi)

    monkeypatch.setattr(plots, "save", save)
    monkeypatch.setattr(run_report, "write_notes", lambda *a, **k: None)
    return seen


def _report(tmp_path, rows, *overrides):
    cfg = compose_cfg("+experiment=train", *TINY, "tracking.plots=true", *overrides)
    records = RunRecords(rows)
    metrics = summary_metrics(cfg, records, [])
    for k in QUANTILE_KEYS:  # what a calibrate run adds: the first window's intervals
        metrics[f"grad_norm_{k}_ci_low"] = metrics[f"grad_norm_{k}"] * 0.9
        metrics[f"grad_norm_{k}_ci_high"] = metrics[f"grad_norm_{k}"] * 1.1
    run_report.write_run_report(cfg, _Tracker(tmp_path), RunResult("r", None, metrics, records=records))
    return metrics


@pytest.mark.slow  # a run's figures drawn with matplotlib; test_a_fixed_tau_run_draws… stays fast
def test_the_quantile_lines_are_the_quantiles_not_their_intervals(tmp_path, figures):
    _report(tmp_path, _rows())
    for name in ("grad_norm.png", "grad_norm_hist.png"):
        assert sorted(figures[name]["texts"]) == sorted(QUANTILE_KEYS), name


def test_a_fixed_tau_run_draws_the_tau_it_clipped_at(tmp_path, figures):
    rows = _rows(max_norm=1.0)
    metrics = _report(tmp_path, rows, "clip.max_norm=1.0")
    assert tau_tags(rows)["tau_used"] == "1"
    assert metrics["recommended_max_norm"] != 1.0
    trace = figures["grad_norm.png"]
    assert "τ used = 1" in trace["labels"]
    assert [set(ys) for ys in trace["red"]] == [{1.0}]  # the red line is τ used, at every step
    rec = f"recommended τ = {metrics['recommended_max_norm']:.3g}"
    assert rec in trace["labels"] and not any(label.startswith("τ =") for label in trace["labels"])
    hist = figures["grad_norm_hist.png"]
    assert [set(xs) for xs in hist["red"]] == [{0.0}]  # log10(1.0)
    assert hist["labels"] == ["τ used", "recommended τ"]


@pytest.mark.slow  # a run's figures drawn with matplotlib; test_a_fixed_tau_run_draws… stays fast
def test_an_unclipped_run_draws_no_tau_used(tmp_path, figures):
    _report(tmp_path, _rows(max_norm=None), "clip=none")
    assert figures["grad_norm.png"]["red"] == []
    assert not any(label.startswith("τ used") for label in figures["grad_norm.png"]["labels"])
