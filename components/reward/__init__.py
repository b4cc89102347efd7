"""Reward stage: a Bradley-Terry reward model trained data-parallel with ``jax.pmap``."""

from components.reward.config import RewardConfig
from components.reward.stage import run

__all__ = ["RewardConfig", "run"]
