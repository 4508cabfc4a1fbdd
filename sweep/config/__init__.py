"""The app's config schema (Hydra structured configs) and its checks."""

from sweep.config.schema import Config, register, validate

__all__ = ["Config", "register", "validate"]
