"""The dispatch point: unknown modes and options, bad values, plain defaults for every mode."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from clipamp_engine.clip import CLIP_MODES, clip_mode_options, make_clip_policy

# -- dispatch --------------------------------------------------------------------------------


def test_unknown_mode_lists_the_modes():
    with pytest.raises(
        ValueError, match="'bogus'.*norm, none, value, staged, per_group, agc, update, quantile, zscore"
    ):
        make_clip_policy("bogus")


def test_unknown_option_lists_the_modes_options():
    with pytest.raises(ValueError, match=r"no option 'max_nrom'.*options are: max_norm"):
        make_clip_policy("norm", max_nrom=1.0)
    with pytest.raises(ValueError, match=r"'zscore' has no option 'zthresh'.*alpha, z_thresh, warmup_steps"):
        make_clip_policy("zscore", zthresh=2.0)


@pytest.mark.parametrize(
    "mode, options, match",
    [
        ("value", {"clip_value": 0}, "clip_value=0"),
        ("staged", {"stages": [[5, 1.0]]}, "first stage must start"),
        ("staged", {"stages": [[0, 1.0], [0, 2.0]]}, "strictly increasing"),
        ("quantile", {"quantile": 10}, r"\(0, 1\]"),
        ("zscore", {"clip_option": "median"}, "adaptive_scaling, mean"),
        ("agc", {"exclude": ["bias"]}, "named_params"),
        ("per_group", {}, "optimizer"),
        ("update", {"max_update_norm": -1}, "max_update_norm"),
        ("norm", {"max_norm": "x"}, r"^max_norm='x' must be > 0 \(use clip mode 'none'"),
        ("norm", {"max_norm": None}, r"^max_norm=None must be > 0 \(use clip mode 'none'"),
        ("norm", {"max_norm": math.nan}, r"^max_norm=nan must be > 0"),
    ],
)
def test_bad_option_values_are_value_errors(mode, options, match):
    with pytest.raises(ValueError, match=match):
        make_clip_policy(mode, **options)


def test_every_mode_has_plain_defaults_and_builds_from_them():
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for mode in CLIP_MODES:
        opts = clip_mode_options(mode)
        for value in opts.values():
            assert value is None or isinstance(value, (bool, int, float, str, list, dict)), (mode, value)
        policy = make_clip_policy(mode, named_params=model.named_parameters(), optimizer=opt, **opts)
        assert policy.mode == mode
        assert type(policy) is CLIP_MODES[mode]
