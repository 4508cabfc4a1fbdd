"""The spike replay's report lines say the recovery tolerance the run used, digits included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sweep.report.spike import summary_line, table_title
from tests.app.helpers import compose_cfg


@pytest.mark.parametrize(("tolerance", "said"), [(0.05, "5%"), (0.025, "2.5%"), (0.005, "0.5%"), (0.1, "10%")])
def test_title_and_summary_say_the_tolerance_the_recovery_was_measured_with(tolerance, said):
    cfg = compose_cfg("+experiment=spike", f"spike.recovery_tolerance={tolerance}")
    back = SimpleNamespace(spiked=True, metrics={"loss_excess_100": 0.01, "recovery_steps": 3.0, "recovered": 1.0})
    never = SimpleNamespace(spiked=True, metrics={"loss_excess_100": 0.2, "recovery_steps": 101.0, "recovered": 0.0})
    line = summary_line({"fixed": (back, back), "none": (never, never)}, cfg)
    assert f"within ±{said} of it for good" in table_title(cfg)
    assert f"fixed: +1.0% at +100, back within ±{said} for good after 3 step(s)" in line
    assert f"none: +20.0% at +100, not back within ±{said} in 100 steps" in line
