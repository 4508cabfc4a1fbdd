"""Presentation: run and sweep reports, tables, plots; ``python -m sweep.report``."""

#: Ctrl-C (at start-up or later): one line, exit 130.
STOPPED = "interrupted: the report was not finished (it only reads the tracking store: nothing there changed)"
