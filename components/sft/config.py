"""The sft stage's configuration."""

from __future__ import annotations

import dataclasses

from components.core.flags import field
from components.core.training.config import TrainConfig


@dataclasses.dataclass(slots=True, kw_only=True)
class SFTConfig(TrainConfig):
    """Supervised fine-tuning on prompt + chosen response, the prompt masked out of the loss."""

    base_policy: str = field("", help="policy model artifact to continue from; '' = preset init")
