"""The reward stage's configuration."""

from __future__ import annotations

import dataclasses

from components.core.flags import field
from components.core.trainer import TrainConfig


@dataclasses.dataclass(slots=True, kw_only=True)
class RewardConfig(TrainConfig):
    """Bradley-Terry reward-model training on preference pairs."""

    base_policy: str = field(
        "", help="policy model artifact to start from (fresh scalar head); '' = preset init"
    )
    center_rewards_coef: float = field(
        0.0, help="weight of the mean squared reward, keeping rewards centred (TRL: 0.01)"
    )
    use_margin: bool = field(True, help="subtract each pair's margin inside the sigmoid")

    def __post_init__(self) -> None:
        TrainConfig.__post_init__(self)
        if self.center_rewards_coef < 0:
            raise ValueError(f"center_rewards_coef: {self.center_rewards_coef} must be >= 0")
