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


def test_a_fault_step_past_the_run_is_refused(capsys):
    """``--steps 20 --inject-step 30`` ran 20 clean steps and exited 0: the fault asked for never happened."""
    for argv, message in (
        (["--inject-step", "30"], "error: --inject-step 30 must be in [0, --steps 20], or the run never reaches it"),
        (["--spike", "--spike-step", "0"], "error: --spike-step 0 must be in [1, --steps 20]"),
    ):
        rc, lines, out = _lines(capsys, *argv)
        assert rc == 2 and lines == [] and out.err.startswith(message)
    rc, lines, _ = _lines(capsys, "--bf16", "--steps", "3")  # the defaults (5, 12) past a short run: no error
    assert rc == 0 and [l[:4] for l in lines] == ["STEP"] * 3
    rc, lines, _ = _lines(capsys, "--bf16", "--inject-step", "20")
    assert rc == 0 and [l.split()[1] for l in lines if l.startswith("SKIP")] == ["20"]
