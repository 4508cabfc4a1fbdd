"""How a front end writes the settings the calibration's advice names.

The calibration's texts (a window's placement, a short window's warning, the band check's next action)
tell the user which setting to change: the threshold τ, the run's length, or one of the calibration
options (``start``, ``window``, ``every``, ``validate``, ``quantile``). A user reaches those settings
through one front end — ``CalibratedClip``'s keywords in their own loop, a config override in the app, a
callback's keywords and the host's arguments in a trainer, a command's flags — and the advice must name
them as that front end spells them. ``Spelling`` says how; ``CalibratedClip(spelling=…)`` renders every
text it writes with it (``ENGINE``, its own keywords, by default). The texts are rendered where a window
is placed, summarised or checked, never per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Setting = Literal["threshold", "length", "start", "window", "every", "validate", "quantile"]


@dataclass(frozen=True)
class Spelling:
    """The names of the settings the advice names, and how a value is written to one.

    Args:
        threshold: the setting that holds τ (``max_norm``, ``clip.max_norm``, ``max_grad_norm``).
        length: the setting that holds the run's length (``total_steps``, ``steps``, ``max_steps``); settings
            that each set it are joined by ``|`` (``max_steps|num_train_epochs``).
        start, window, every, validate, quantile: the calibration options' names.
        named: how a setting is named without a value, given its name and a placeholder for the value (``N``, ``q``
            for the quantile, ``τ`` for the threshold): ``"{}={}"``: ``every=N``, a keyword as the user writes it;
            ``"{}"``: ``calibrate.every``, a key named alone.
        assign: how a value is written to an option (``"{}={}"``: ``start=200``; ``"{} {}"``: ``--start 200``);
            the threshold is always ``name=value``, the keyword or override every front end sets it with.
        auto: ``start``'s automatic placement as a value (``'auto'``, ``auto``).
        band: ``quantile``'s value that aims τ at the target band (``None``, ``null``, ``band``).
    """

    threshold: str = "max_norm"
    length: str = "total_steps"
    start: str = "start"
    window: str = "window"
    every: str = "every"
    validate: str = "validate"
    quantile: str = "quantile"
    named: str = "{}={}"
    assign: str = "{}={}"
    auto: str = "'auto'"
    band: str = "None"

    def name(self, setting: Setting) -> str:
        """``setting`` named without a value: ``every=N``, ``calibrate.every``, ``--every``; a setting spelled two
        ways as the first with the other after it: ``max_steps=N (or num_train_epochs=N)``."""
        first, *others = (self.named.format(n, PLACEHOLDERS.get(setting, "N")) for n in self._names(setting))
        return first + "".join(f" (or {other})" for other in others)

    def set(self, setting: Setting, value: object) -> str:
        """``value`` written to ``setting`` (its first name): ``start=200``, ``calibrate.start=200``,
        ``--start 200``."""
        return ("{}={}" if setting == "threshold" else self.assign).format(self._names(setting)[0], value)

    def _names(self, setting: Setting) -> list[str]:
        return getattr(self, setting).split("|")


#: What ``Spelling.name`` writes for a setting's value: a number of steps (``N``) but for these.
PLACEHOLDERS: dict[str, str] = {"threshold": "τ", "quantile": "q"}


#: ``CalibratedClip``'s own keywords, ``AmpTrainState(max_norm=…)`` and ``recommended_calibration(total_steps=…)``.
ENGINE = Spelling()
