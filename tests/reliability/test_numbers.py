"""Issue 12 item 15: every number that can break the maths is checked once, in ``validate(cfg)``."""

from __future__ import annotations

import pytest

from sweep.config import validate
from sweep.errors import UserError
from tests.app.helpers import compose_cfg, run_cli

BAD = [
    ("optim.min_lr_ratio=-1", "optim.min_lr_ratio=-1.0 must be in [0, 1]"),
    ("optim.min_lr_ratio=nan", "optim.min_lr_ratio=nan must be in [0, 1]"),
    ("optim.betas=[0.9,1.5]", "optim.betas=[0.9, 1.5] must be two numbers in [0, 1)"),
    ("optim.betas=[0.9]", "optim.betas=[0.9] must be two numbers in [0, 1)"),
    ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 must be >= 0"),
    ("optim.warmup_steps=-5", "optim.warmup_steps=-5 must be >= 0"),
    ("amp.backoff_factor=1.5", "amp.backoff_factor=1.5 must be in (0, 1)"),
    ("amp.backoff_factor=0", "amp.backoff_factor=0.0 must be in (0, 1)"),
    ("amp.growth_factor=0.5", "amp.growth_factor=0.5 must be > 1"),
    ("amp.growth_interval=0", "amp.growth_interval=0 must be >= 1"),
    (
        "amp.init_scale=1e9",
        "need amp.min_scale <= amp.init_scale <= amp.max_scale, got 1.0 <= 1000000000.0 <= 16777216.0: "
        "pass e.g. amp.init_scale=65536.0",
    ),
    (
        "amp.max_scale=0.5",
        "need amp.min_scale <= amp.init_scale <= amp.max_scale, got 1.0 <= 65536.0 <= 0.5: pass e.g.",
    ),
    ("amp.min_scale=0", "amp.min_scale=0.0 must be > 0: pass e.g. amp.min_scale=1.0"),
    ("amp.hysteresis=0", "amp.hysteresis=0 must be an integer >= 1 (1 = back off on every overflow): pass e.g."),
    ("model.dropout=1.0", "model.dropout=1.0 must be in [0, 1)"),
    ("model.dropout=-0.2", "model.dropout=-0.2 must be in [0, 1)"),
    ("model.n_layer=0", "model.n_layer=0 must be >= 1"),
]


@pytest.mark.parametrize("override,message", BAD, ids=[b[0] for b in BAD])
def test_out_of_range_number_is_one_line(override, message):
    with pytest.raises(UserError) as e:
        validate(compose_cfg("+experiment=train", override))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert "pass e.g." in str(e.value) or "must be >= 1" in str(e.value)


@pytest.mark.parametrize("experiment", ["train", "calibrate", "sweep", "spike"])
def test_shipped_defaults_pass(experiment):
    validate(compose_cfg(f"+experiment={experiment}"))


@pytest.mark.slow  # a `python -m sweep` subprocess: seconds of imports
def test_cli_refuses_negative_min_lr_ratio_before_any_run(tmp_path):
    """Exit 2, one line, and no store or run created: a negative LR would have trained by gradient ascent."""
    p = run_cli("+experiment=train", "optim.min_lr_ratio=-1", "steps=2", cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "error: optim.min_lr_ratio=-1.0 must be in [0, 1] (the LR decays to min_lr_ratio·lr): "
        "pass e.g. optim.min_lr_ratio=0.1"
    ]
    assert "Traceback" not in p.stdout + p.stderr
    assert not (tmp_path / "mlruns").exists()
