"""PPO stage: rollouts, advantages and clipped updates of the policy against a reward model."""

from components.ppo.config import PPOConfig

__all__ = ["PPOConfig", "run"]


def __getattr__(name: str):
    """``run`` imports the training stack on first use: reading the config imports no JAX."""
    if name == "run":
        from components.ppo.stage import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
