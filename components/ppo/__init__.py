"""PPO stage: rollouts, advantages and clipped updates of the policy against a reward model."""

from components.ppo.config import PPOConfig
from components.ppo.stage import run

__all__ = ["PPOConfig", "run"]
