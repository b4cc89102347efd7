"""DPO stage: a policy aligned on preference pairs against its frozen copy, with ``jax.pmap``."""

from components.dpo.config import DPOConfig

__all__ = ["DPOConfig", "run"]


def __getattr__(name: str):
    """``run`` imports the training stack on first use: reading the config imports no JAX."""
    if name == "run":
        from components.dpo.stage import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
