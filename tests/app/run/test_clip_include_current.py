"""`clip=quantile clip.include_current=…` reaches the engine (issue 11, item 5)."""

from __future__ import annotations

import pytest
import torch

from sweep.errors import UserError
from sweep.run.build import build_clip_policy
from tests.app.helpers import compose_cfg


@pytest.mark.parametrize(
    "override,expected", [(None, True), ("clip.include_current=false", False), ("clip.include_current=true", True)]
)
def test_quantile_convention_is_a_config_key(override, expected):
    cfg = compose_cfg("clip=quantile", *([override] if override else []))
    policy = build_clip_policy(cfg, torch.nn.Linear(2, 1))
    assert policy.include_current is expected
    # the package's rule clips a spike above every previous norm; the paper's never at q = 1
    policy.quantile = 1.0
    p = torch.nn.Parameter(torch.zeros(1))
    for step, g in enumerate([1.0, 2.0, 50.0], 1):
        p.grad = torch.tensor([g])
        post = policy.clip_([p], [p.grad], p.grad.norm(), step)
    assert float(post) == pytest.approx(50.0 if expected else 2.0, rel=1e-5)


def test_include_current_is_refused_for_other_modes():
    cfg = compose_cfg("clip=zscore", "clip.include_current=false")
    with pytest.raises(UserError, match="clip.include_current"):
        build_clip_policy(cfg, torch.nn.Linear(2, 1))
