"""Evaluate stage: win rate, KL and rewards of the aligned policy, a promotion gate, a report."""

from components.evaluate.config import EvalConfig

__all__ = ["EvalConfig", "run"]


def __getattr__(name: str):
    """``run`` imports the training stack on first use: reading the config imports no JAX."""
    if name == "run":
        from components.evaluate.stage import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
