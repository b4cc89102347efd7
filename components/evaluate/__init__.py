"""Evaluate stage: win rate, KL and rewards of the aligned policy, a promotion gate, a report."""

from components.evaluate.config import EvalConfig
from components.evaluate.stage import run

__all__ = ["EvalConfig", "run"]
