"""The seed demo: STEP/SKIP lines, at least one SKIP, flags behave as documented."""

from __future__ import annotations

import pandas as pd

from clipamp_engine import demo


def _lines(capsys, *argv):
    rc = demo.main(list(argv))
    out = capsys.readouterr()
    return rc, [l for l in out.out.splitlines() if l[:4] in ("STEP", "SKIP")], out


def test_default_fp16_demo_skips_the_injected_inf(capsys):
    rc, lines, _ = _lines(capsys)
    assert rc == 0 and len(lines) == 20
    assert any(l.startswith("SKIP   5") and "reason=nonfinite_grad" in l for l in lines)


def test_bf16_skips_only_the_injected_fault(capsys):
    rc, lines, _ = _lines(capsys, "--bf16")
    assert rc == 0
    assert [l.split()[1] for l in lines if l.startswith("SKIP")] == ["5"]


def test_spike_is_clipped_to_max_norm(capsys):
    rc, lines, _ = _lines(capsys, "--bf16", "--spike")
    spike = next(l for l in lines if l.split()[1] == "12")
    assert spike.startswith("STEP") and "clipped" in spike and "post=1 " in spike
    assert float(spike.split("pre=")[1].split()[0]) > 1e6


def test_csv_and_max_skip_rate(tmp_path, capsys):
    path = tmp_path / "steps.csv"
    rc, _, out = _lines(capsys, "--csv", str(path), "--max-skip-rate", "0.01")
    assert rc == 1 and "FAIL skip rate" in out.err
    df = pd.read_csv(path)
    assert df["step"].tolist() == list(range(1, 21)) and df["skipped"].sum() >= 1
