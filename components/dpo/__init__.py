"""DPO stage: a policy aligned on preference pairs against its frozen copy, with ``jax.pmap``."""

from components.dpo.config import DPOConfig
from components.dpo.stage import run

__all__ = ["DPOConfig", "run"]
