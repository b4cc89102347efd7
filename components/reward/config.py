"""The reward stage's configuration."""

from __future__ import annotations

import dataclasses

from components.core.flags import field
from components.core.training.config import TrainConfig


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
    min_reward_accuracy: float = field(
        0.0,
        help="fail after writing the model when its eval accuracy is below this, so no "
        "policy is aligned to a reward model that cannot rank the data (0 = never)",
    )

    ensemble_size: int = field(
        1,
        help="reward models trained with seeds seed, seed+1, ...: PPO trains against the "
        "first (or, with its conservative_reward, the ensemble's mean - lambda*std or "
        "minimum) and logs their spread on its samples (ensemble disagreement); 1 = one",
    )

    def __post_init__(self) -> None:
        TrainConfig.__post_init__(self)
        if not 1 <= self.ensemble_size <= 16:
            raise ValueError(f"ensemble_size: {self.ensemble_size} must be in 1..16")
        if self.center_rewards_coef < 0:
            raise ValueError(f"center_rewards_coef: {self.center_rewards_coef} must be >= 0")
        if not 0.0 <= self.min_reward_accuracy <= 1.0:
            raise ValueError(f"min_reward_accuracy: {self.min_reward_accuracy} must be in [0, 1]")
