"""The calibration's advice, by default, names the settings as a user of the engine in their own loop sets them:
``CalibratedClip``'s keywords (through ``recommended_calibration``), ``AmpTrainState(max_norm=…)`` and the run's
``total_steps``, never the app's overrides (``calibrate.start=N``, ``clip.max_norm=``, ``steps``)."""

from __future__ import annotations

import inspect

import pytest

from clipamp_engine.clip.calibrated import CalibratedClip, recommended_calibration
from clipamp_engine.spelling import ENGINE, Spelling
from clipamp_engine.step import AmpTrainState
from tests.engine.spelling_cases import APP_WORDS, advice, keywords

TEXTS = advice(ENGINE)


def _keywords_of(*callables) -> set[str]:
    return {name for c in callables for name in inspect.signature(c).parameters if name not in ("self", "overrides")}


@pytest.mark.parametrize("branch", sorted(TEXTS))
def test_the_engines_advice_names_only_its_own_keywords(branch):
    text = TEXTS[branch]
    allowed = _keywords_of(CalibratedClip, AmpTrainState, recommended_calibration)
    named = keywords(text)
    assert named and named <= allowed, (text, named - allowed)
    assert not APP_WORDS.search(text), text


#: A front end of flags whose length setting lengthens the run (recommend's shape), for the spelling tests.
FLAGS = Spelling(
    length="the log's length",
    **{k: f"--{k}" for k in ("start", "window", "every", "validate", "quantile")},
    named="{}",
    assign="{} {}",
    auto="auto",
    band="band",
    lengthen="raise",
)


def test_a_policy_built_with_a_spelling_names_its_settings_in_every_text():
    """The spelling travels from the constructor to each text: the placement (fixed, and the deadline a run too
    short to wait gets), the window's warning, the check's action."""
    flags = FLAGS
    fixed = CalibratedClip(window=5, start=3, quantile=0.99, spelling=flags)
    assert fixed.placement.reason.startswith("--start 3: the window starts at step 4")
    for step in range(1, 12):
        fixed.observe(_record(step, 1.0 + step % 3))
    [summary] = fixed.summaries
    assert summary.warnings and "lengthen --window to ≥" in summary.warnings[0]
    assert "use a lower --quantile" in summary.warnings[0]
    [check] = fixed.checks()
    assert "with --quantile band" in check.action and "(--window)" in check.action and not keywords(check.action)
    tight = CalibratedClip(window=20, start="auto", total_steps=40, spelling=flags)
    assert tight.placement.reason.endswith("(raise the log's length to let --start auto wait)")


def _record(step: int, norm: float):
    from clipamp_engine.records import StepLog

    return StepLog(
        step=step, lr=1e-3, grad_l2_pre_clip=norm, grad_l2_post_clip=norm, loss=1.0, scaler_scale=None, clipped=False
    )


def test_a_refused_start_names_auto_as_the_spelling_writes_it():
    """The constructor's refusal of ``start`` is advice too: ``start='auto'`` for the engine, ``calibrate.start=auto``
    in the app (whose config check shows the engine's line), ``--start auto`` for a command's flags."""
    flags = Spelling(start="--start", named="{}", assign="{} {}", auto="auto")
    for spelling, line in [
        (ENGINE, "start=-3 must be 'auto' or a number of steps >= 0"),
        (flags, "--start -3 must be auto or a number of steps >= 0"),
    ]:
        with pytest.raises(ValueError) as e:
            CalibratedClip(window=5, start=-3, spelling=spelling)
        assert str(e.value).startswith(line), str(e.value)


def _own_loop(steps: int, total_steps: int) -> CalibratedClip:
    """A loop of ``steps`` iterations (a 5-step LR warm-up, then steady log-normal norms) whose policy is told
    ``total_steps``: each record reaches it as ``AmpTrainState.step`` hands it over, clipped at the τ in force."""
    import numpy as np

    from clipamp_engine.records import StepLog

    clip = recommended_calibration(total_steps=total_steps, window=20)
    norms = np.random.default_rng(0).lognormal(0, 0.2, steps)
    for step, norm in enumerate(norms.tolist(), start=1):
        tau = clip.threshold
        post = norm if tau is None else min(norm, tau)
        lr = 1e-3 * min(1.0, step / 5)
        clip.observe(StepLog(step, lr, norm, post, loss=1.0, scaler_scale=1.0, clipped=post < norm, max_norm=tau))
    return clip


def test_the_engines_advice_for_a_longer_run_lengthens_the_loop_as_well_as_total_steps():
    """``total_steps`` only tells the policy how long the loop runs. A 40-step loop leaves ``start='auto'`` no room
    to wait; raising ``total_steps`` alone moves the deadline past the loop's end, so no window closes and
    nothing is checked. The advice asks for the loop lengthened and its length passed, and doing just that
    places the window after the warm-up and checks τ on more held-out steps."""
    short = _own_loop(40, total_steps=40)
    assert short.placement.rule == "deadline" and short.placement.start == 1 and short.checks()[0].steps == 20
    advice = short.placement.reason
    assert advice.endswith("(lengthen your loop to N steps and pass total_steps=N to let start='auto' wait)"), advice
    told_only = _own_loop(40, total_steps=120)  # the length raised, the loop not
    assert told_only.summaries == [] and told_only.checks() == []
    followed = _own_loop(120, total_steps=120)
    [check] = followed.checks()
    assert followed.placement.rule == "auto" and followed.placement.start > 5  # after the warm-up
    assert check.steps > 20


def test_a_spelling_names_how_its_run_is_lengthened_or_is_refused():
    with pytest.raises(ValueError) as e:
        Spelling(lengthen="longer")
    assert str(e.value) == "lengthen='longer' must be 'loop' or 'raise'"
