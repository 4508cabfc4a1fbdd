"""How a front end writes the settings the calibration's advice names.

The calibration's texts (a window's placement, a short window's warning, the band check's next action)
tell the user which setting to change: the threshold τ, the run's length, or one of the calibration
options (``start``, ``window``, ``every``, ``validate``, ``quantile``). A user reaches those settings
through one front end — ``CalibratedClip``'s keywords in their own loop, a config override in the app, a
callback's keywords and the host's arguments in a trainer, a command's flags — and the advice must name
them as that front end spells them. ``Spelling`` says how; ``CalibratedClip(spelling=…)`` renders every
text it writes with it (``ENGINE``, its own keywords, by default). The texts are rendered where a window
is placed, summarised or checked, never per step.

The run's length is a setting of two kinds. Where it sets how long the host trains (the app's ``steps``, a
trainer's ``max_steps``), a longer run is that setting raised. Where it only tells the calibration how long
the user's own loop runs (``total_steps`` of ``CalibratedClip`` and ``ClipampAccelerate``), raising it alone
lengthens nothing: the window moves later and fewer held-out steps remain before the loop ends. The advice
then asks for both, the loop lengthened and its new length passed (``Spelling.longer_run``).
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
        lengthen: how a longer run is asked for: ``"loop"``, the length setting only tells the calibration how
            long the user's loop runs (lengthen the loop to N steps and pass that N); ``"raise"``, raising the
            setting lengthens the run.
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
    lengthen: Literal["loop", "raise"] = "loop"

    def __post_init__(self) -> None:
        if self.lengthen not in ("loop", "raise"):
            raise ValueError(f"lengthen={self.lengthen!r} must be 'loop' or 'raise'")

    def name(self, setting: Setting) -> str:
        """``setting`` named without a value: ``every=N``, ``calibrate.every``, ``--every``; a setting spelled two
        ways as the first with the other after it: ``max_steps=N (or num_train_epochs=N)``."""
        first, *others = (self.named.format(n, PLACEHOLDERS.get(setting, "N")) for n in self._names(setting))
        return first + "".join(f" (or {other})" for other in others)

    def set(self, setting: Setting, value: object) -> str:
        """``value`` written to ``setting`` (its first name): ``start=200``, ``calibrate.start=200``,
        ``--start 200``."""
        return ("{}={}" if setting == "threshold" else self.assign).format(self._names(setting)[0], value)

    def longer_run(self, also: Setting | None = None) -> str:
        """The advice for a longer run, and with it a larger ``also`` if given: ``raise max_steps=N and
        validate=N`` where the length setting lengthens the run; ``lengthen your loop to N steps and pass
        total_steps=N, and raise validate=N`` where it only tells the calibration the loop's length."""
        length = self.name("length")
        if self.lengthen == "raise":
            return f"raise {length}" + (f" and {self.name(also)}" if also else "")
        return f"lengthen your loop to N steps and pass {length}" + (f", and raise {self.name(also)}" if also else "")

    def _names(self, setting: Setting) -> list[str]:
        return getattr(self, setting).split("|")


#: What ``Spelling.name`` writes for a setting's value: a number of steps (``N``) but for these.
PLACEHOLDERS: dict[str, str] = {"threshold": "τ", "quantile": "q"}


#: ``CalibratedClip``'s own keywords, ``AmpTrainState(max_norm=…)`` and ``recommended_calibration(total_steps=…)``.
ENGINE = Spelling()
