"""The app's config: the schema (``schema``), its checks (``validate``), plain-data views (``convert``)."""

from sweep.config.schema import Config, forensics_on, register, window_ranges
from sweep.config.validate import validate

__all__ = ["Config", "forensics_on", "register", "validate", "window_ranges"]
