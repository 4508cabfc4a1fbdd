"""``clipamp --help`` lists common overrides with the values the app really defaults to."""

from __future__ import annotations

import re

import yaml

from tests.app.helpers import CONF, compose_cfg


def _listed() -> dict[str, str]:
    """KEY=VALUE pairs of the help's "Common overrides" section (placeholders in capitals left out)."""
    template = yaml.safe_load((CONF / "config.yaml").read_text())["hydra"]["help"]["template"]
    section = template.split("== Common overrides ==", 1)[1].split("${hydra.help.footer}", 1)[0]
    pairs = dict(re.findall(r"(?<![\w.])([a-z_][\w.]*)=(\S+)", section))
    return {k: v for k, v in pairs.items() if not re.fullmatch(r"[A-Z_/:.]+|sqlite:.*", v)}


def _value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_the_common_overrides_show_the_defaults():
    listed = _listed()
    base, calibrate = compose_cfg(), compose_cfg("+experiment=calibrate")
    group_choice = {"model": base.model.name, "data": base.data.name, "clip": base.clip.mode}
    examples = {"resume"}  # shown as what to type, not as a default
    checked = 0
    for key, text in listed.items():
        if key in examples:
            continue
        want = group_choice.get(key)
        if want is None:
            cfg = calibrate if key.startswith("calibrate.") else base
            want = _value(cfg, key)
        shown = None if text == "null" else type(want)(text) if want is not None else text
        assert shown == want, f"--help shows {key}={text}, the default is {want!r}"
        checked += 1
    assert checked >= 9 and "calibrate.quantile" in listed
