"""What the experiments measured, as types and pure functions: what they produce and the reports read."""
