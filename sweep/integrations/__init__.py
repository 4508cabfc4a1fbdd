"""Adapters for other people's training loops (each imports its framework; nothing imports them).

``sweep.integrations.hf_trainer.ClipampCallback``: a ``transformers.TrainerCallback``.
"""
