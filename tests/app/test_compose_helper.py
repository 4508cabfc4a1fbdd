"""``compose_cfg``, the suite's way to the typed config: one compose per distinct command, the same result."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

import tests.app.helpers as helpers
from sweep.config.convert import to_config
from sweep.errors import UserError


@pytest.fixture
def composes(monkeypatch) -> list:
    """The overrides of every Hydra compose ``compose_cfg`` runs during the test."""
    seen = []

    def counted(config_name, overrides):
        seen.append(tuple(overrides))
        return compose(config_name=config_name, overrides=overrides)

    monkeypatch.setattr(helpers, "compose", counted)
    return seen


def test_a_command_is_composed_once_and_each_caller_gets_its_own_copy(composes, monkeypatch):
    command = ("+experiment=train", "seed=48151", "clip=per_group")  # a command no other test composes
    first = helpers.compose_cfg(*command)
    with initialize_config_dir(config_dir=str(helpers.CONF), version_base="1.3"):
        reference = to_config(compose(config_name="config", overrides=list(command)))
    assert first == reference  # what Hydra composes for the command
    first.steps = -1
    first.clip.patterns["attn"] = 0.5
    second = helpers.compose_cfg(*command)
    assert second == reference and second is not first  # the first caller's changes stay its own
    assert composes == [command]  # composed once
    monkeypatch.setenv("CLIPAMP_TEST_SETTING", "1")
    assert helpers.compose_cfg(*command) == reference
    monkeypatch.chdir(helpers.CONF)
    assert helpers.compose_cfg(*command) == reference
    assert len(composes) == 3  # another environment, another working folder: composed again


def test_a_command_that_is_refused_is_refused_every_time(composes):
    command = ("+experiment=train", "seed=48151", "+stepz=60")
    messages = []
    for _ in range(2):
        with pytest.raises(UserError) as e:
            helpers.compose_cfg(*command)
        messages.append(str(e.value))
    assert messages[0] == messages[1] and messages[0].startswith("stepz is not a key")
    assert composes == [command, command]
