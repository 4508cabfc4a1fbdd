"""What ``--help`` prints for the app's helper commands is plain text a user reads in a terminal:
no reStructuredText markup, and the defaults as the command applies them."""

from __future__ import annotations

import pytest

from sweep.recommend.cli import main as recommend_main
from sweep.report.cli import main as report_main
from sweep.resend import main as resend_main


@pytest.mark.parametrize("main", [resend_main, report_main, recommend_main], ids=["resend", "report", "recommend"])
def test_help_is_plain_text(main, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("usage: python -m sweep.")
    assert "``" not in out, out


def test_resend_help_names_the_server_it_sends_to(capsys):
    """The server is --tracking-uri, else $MLFLOW_TRACKING_URI, else the run's (it said "default: the
    run's", though the environment's server wins over it)."""
    with pytest.raises(SystemExit):
        resend_main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default: $MLFLOW_TRACKING_URI, else the run's" in help_text
