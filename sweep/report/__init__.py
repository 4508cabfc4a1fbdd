"""Presentation: run and sweep reports, tables, plots; ``python -m sweep.report``."""
