"""SFT stage: the initial policy, trained on chosen responses with ``jax.pmap``."""

from components.sft.config import SFTConfig

__all__ = ["SFTConfig", "run"]


def __getattr__(name: str):
    """``run`` imports the training stack on first use: reading the config imports no JAX."""
    if name == "run":
        from components.sft.stage import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
