"""Reward stage: a Bradley-Terry reward model trained data-parallel with ``jax.pmap``."""

from components.reward.config import RewardConfig

__all__ = ["RewardConfig", "run"]


def __getattr__(name: str):
    """``run`` imports the training stack on first use: reading the config imports no JAX."""
    if name == "run":
        from components.reward.stage import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
