"""A run logs the model sizes its model reads: ``model=custom`` does not log the built-in GPT's."""

import pytest

from sweep.config.convert import flat_params
from tests.app.helpers import compose_cfg


@pytest.mark.parametrize(
    "overrides, logged, absent",
    [
        (["model=gpt", "model.n_layer=8"], {"model.n_layer": 8, "model.d_model": 128}, ["model.hidden"]),
        (["model=lstm"], {"model.hidden": 256, "model.n_layer": 3}, ["model.n_head", "model.block_size"]),
        (["model=custom", "model.n_layer=8"], {"model._target_": "sweep.tasks.models.TinyMLPLM"}, ["model.n_layer"]),
        (["model=custom", "data=synthetic"], {"model.in_features": 16}, ["model.d_model"]),
    ],
)
def test_params_hold_the_sizes_the_model_reads(overrides, logged, absent):
    params = flat_params(compose_cfg("+experiment=train", *overrides))
    assert {k: params[k] for k in logged} == logged
    assert not [k for k in absent if k in params]
