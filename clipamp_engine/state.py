"""Import alias kept for users: ``AmpTrainState`` lives in ``clipamp_engine.step``."""

from .step import DTYPES, AmpTrainState, parse_dtype

__all__ = ["DTYPES", "AmpTrainState", "parse_dtype"]
