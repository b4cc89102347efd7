"""SFT stage: the initial policy, trained on chosen responses with ``jax.pmap``."""

from components.sft.config import SFTConfig
from components.sft.stage import run

__all__ = ["SFTConfig", "run"]
