"""Each front end's calibration advice names only settings its user can set, spelled as that user writes them.

The app takes config overrides (``calibrate.start=N``, ``clip.max_norm=τ``, ``steps=``); the trainer
integrations take their callback's keywords and the host's own arguments (``TrainingArguments(max_grad_norm=,
max_steps=)``, Lightning's ``Trainer(gradient_clip_val=, max_steps=)``, accelerate's ``clip_grad_norm_(params,
max_norm)`` and ``ClipampAccelerate(total_steps=)``); ``python -m sweep.recommend`` takes its flags. Every branch of
the advice (``tests/engine/spelling_cases.py``) is rendered in each front end's spelling and every setting it
names is checked against that front end's API; then each integration's own recorder is driven on a tiny
parameter to a window placed by the run's end, a check and a run with no window, and the lines it prints are
checked the same way.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

from clipamp_engine.clip.calibrated import RECOMMENDED
from tests.app.helpers import compose_cfg
from tests.engine.spelling_cases import APP_WORDS, advice, keywords

STEPS, WINDOW = 30, 10
CALIBRATE = {k for k in RECOMMENDED if k != "cap"}  # an integration's **calibrate (cap is the host's τ)


def _params(*callables) -> set[str]:
    return {n for c in callables for n, p in inspect.signature(c).parameters.items() if p.kind != p.VAR_KEYWORD}


def _hf():
    from transformers import TrainingArguments

    from sweep.integrations.hf_trainer import ClipampCallback

    return lambda **kw: ClipampCallback(**kw).recorder, _params(ClipampCallback, TrainingArguments) | CALIBRATE


def _lightning():
    import lightning.pytorch as pl

    from sweep.integrations.lightning import ClipampCallback

    return lambda **kw: ClipampCallback(**kw).recorder, _params(ClipampCallback, pl.Trainer) | CALIBRATE


def _accelerate():
    from accelerate import Accelerator

    from sweep.integrations.accelerate import ClipampAccelerate

    allowed = _params(ClipampAccelerate, ClipampAccelerate.clip_grad_norm_, Accelerator.clip_grad_norm_) | CALIBRATE
    return lambda **kw: ClipampAccelerate(Accelerator(cpu=True), **kw).recorder, allowed


HOSTS = {"transformers": _hf, "lightning": _lightning, "accelerate": _accelerate}


def _drive(recorder, tmp_path, total_steps) -> None:
    """``STEPS`` steps whose norms fall 10% a step (they never settle) at a rising LR: the window is placed by the
    run's end (or never, of unknown length); its τ then clips what the norms no longer reach."""
    recorder.begin(total_steps=total_steps, user_tau=None, default_csv=tmp_path / f"{total_steps}.csv")
    p = torch.nn.Parameter(torch.zeros(4))
    for step in range(1, STEPS + 1):
        p.grad = torch.full((4,), 0.9**step)
        recorder.record(step, 1e-3 * step, recorder.measure([p], step, host_clips=False))
    recorder.end(STEPS)


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_an_integrations_advice_names_its_keywords_and_its_hosts_arguments(host, tmp_path, capsys):
    make, allowed = HOSTS[host]()
    spelling = make(tracking=None).spelling
    for branch, text in advice(spelling).items():
        named = keywords(text)
        assert named and named <= allowed, (branch, text, named - allowed)
        assert not APP_WORDS.search(text), (branch, text)
    for total_steps in (STEPS, None):
        _drive(make(tracking=None, csv_path=tmp_path / f"{total_steps}.csv", window=WINDOW), tmp_path, total_steps)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("clipamp: ")]
    assert any("window placement (start='auto'): " in line and "or start=N)" in line for line in said), said
    assert any("next: " in line for line in said) and any("no calibration window" in line for line in said), said
    for line in said:
        assert keywords(line) <= allowed and not APP_WORDS.search(line), line


def test_the_apps_advice_names_keys_of_its_config():
    """The app's spelling renders every branch as the app always has (``calibrate.start=N``, ``clip.max_norm=``,
    "raise steps"), and every key it names is one of the composed config's."""
    from sweep.run.build import APP_SPELLING

    cfg = compose_cfg("+experiment=calibrate")
    for branch, text in advice(APP_SPELLING).items():
        keys = re.findall(r"\b([a-z_]+)\.([a-z_]+)\b", text)
        assert keys or "raise steps" in text, (branch, text)
        for group, key in keys:
            assert hasattr(getattr(cfg, group), key), (branch, text)
        assert not keywords(text), (branch, text)  # settings are overrides, not keywords
    assert hasattr(cfg, APP_SPELLING.length)


def test_recommends_advice_names_its_flags(tmp_path, capsys):
    """``python -m sweep.recommend`` spells the options as its flags, the run's length as the log's, and τ as the
    ``max_grad_norm`` its last line writes in each trainer's terms; its report on a log names nothing else."""
    import numpy as np

    from sweep.recommend import cli
    from sweep.recommend.replay import RECOMMEND_SPELLING

    flags = {s for a in cli.parser()._actions for s in a.option_strings}
    for branch, text in [*advice(RECOMMEND_SPELLING).items(), ("report", _recommend_report(tmp_path, capsys, np))]:
        assert set(re.findall(r"--[a-z][\w-]*", text)) <= flags, (branch, text)
        assert keywords(text) <= {"max_grad_norm"} and not APP_WORDS.search(text), (branch, text)


def _recommend_report(tmp_path, capsys, np) -> str:
    """The report on a 300-step log read with a 200-step window: placed by the log's end, checked on the rest.
    Its last line (the τ in each trainer's terms, the app's included) is left out."""
    from sweep.recommend import cli

    steps = np.arange(1, 301)
    norms = np.exp(np.random.default_rng(0).normal(0, 0.3, 300)) * (1 + 8 * np.exp(-steps / 40))
    path = tmp_path / "log.csv"
    path.write_text("step,lr,grad_norm\n" + "".join(f"{s},{min(s, 30) * 1e-4},{g}\n" for s, g in zip(steps, norms)))
    assert cli.main([str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "raise the log's length to let --start auto wait" in "\n".join(out)
    return "\n".join(line for line in out if not line.startswith("max_grad_norm="))


#: A setting named with nothing after its ``=`` (``raise validate=``): the advice names keywords with a value.
BARE = re.compile(r"[\w.]=(?=[\s),;:]|$)")


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_an_integrations_advice_names_each_keyword_with_a_value(host):
    """A keyword front end names a setting as its user writes it, ``validate=N``, ``max_norm=τ``, ``quantile=q``:
    never a bare ``validate=``."""
    make, _ = HOSTS[host]()
    for branch, text in advice(make(tracking=None).spelling).items():
        assert not BARE.search(text), (branch, text)
    from clipamp_engine.spelling import ENGINE

    for branch, text in advice(ENGINE).items():
        assert not BARE.search(text), (branch, text)
    assert (
        "lengthen your loop to N steps and pass total_steps=N to let start='auto' wait"
        in advice(ENGINE)["no room to wait"]
    )


@pytest.mark.parametrize(
    "host,longer",
    [
        ("accelerate", "lengthen your loop to N steps and pass total_steps=N"),  # the length only tells the policy
        ("lightning", "raise max_steps=N"),  # the host's length: raising it lengthens the fit
        ("transformers", "raise max_steps=N (or num_train_epochs=N)"),
    ],
)
def test_a_longer_run_is_asked_for_as_each_host_lengthens_one(host, longer):
    """accelerate's loop is the user's: ``total_steps=`` tells the calibration its length and lengthens nothing,
    so the advice asks for the loop lengthened and its length passed; a trainer's ``max_steps`` lengthens the fit."""
    make, _ = HOSTS[host]()
    texts = advice(make(tracking=None).spelling)
    assert texts["no room to wait"].endswith(f"({longer} to let start='auto' wait)"), texts["no room to wait"]
    assert f"train longer after the window ({longer})" in texts["few: the run ended"], texts["few: the run ended"]


def test_the_hf_run_length_names_max_steps_and_num_train_epochs():
    """A ``Trainer`` run's length is ``max_steps`` or, where that is not set, ``num_train_epochs``: advice that
    asks for a longer run names both."""
    make, _ = HOSTS["transformers"]()
    texts = advice(make(tracking=None).spelling)
    assert texts["no room to wait"].endswith("(raise max_steps=N (or num_train_epochs=N) to let start='auto' wait)"), (
        texts["no room to wait"]
    )
    assert texts["no validation step"].endswith("raise validate=N or max_steps=N (or num_train_epochs=N)")


def test_a_manual_optimization_fit_names_tau_as_the_callbacks_max_norm(tmp_path):
    """Under manual optimization Lightning's ``gradient_clip_val`` does not clip: the user's τ is
    ``ClipampCallback(max_norm=)``, and the callback's advice names that; an automatic fit after it names
    ``Trainer(gradient_clip_val=)`` again."""
    from tests.app.integrations.test_lightning_records import ManualAccumulation, Tiny, callback, fit

    cb = callback(tmp_path, max_norm=1.0, window=3, start=0)
    fit(tmp_path, ManualAccumulation(), 8, [cb], max_steps=4)
    manual = advice(cb.recorder.policy.spelling)
    assert "keep max_norm=2;" in manual["inside"] and "set max_norm=τ from" in manual["outside: ties"]
    assert not any("gradient_clip_val" in text for text in manual.values())
    cb.max_norm = None
    fit(tmp_path / "auto", Tiny(), 8, [cb], max_steps=4)
    assert "keep gradient_clip_val=2;" in advice(cb.recorder.policy.spelling)["inside"]
