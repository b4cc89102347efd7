"""What the reward artifact's held-out model and ensemble members (core/rewards/members.py)
do to a PPO run (ppo/monitors.py): PPOConfig's over-optimisation settings."""

from __future__ import annotations

import dataclasses
from typing import Literal

from components.core.flags import field

# The held-out reward model's score fell while the proxy's rose (heldout_patience).
STATUS_STOPPED_OVEROPTIMISATION = "stopped_overoptimisation"


@dataclasses.dataclass(kw_only=True)
class OveroptimisationSettings:
    """A conservative reward over the ensemble, checkpoint selection and the early stop."""

    __slots__ = ()

    conservative_reward: Literal["", "mean", "min", "mean-std"] = field(
        "",
        help="with a reward ensemble (reward ensemble_size > 1): train against its mean, its "
        "minimum or mean - conservative_lambda * std of the members' standardized scores "
        "(Coste et al. 2023) instead of the first member alone; '' = the first member",
    )
    conservative_lambda: float = field(
        1.0, help="conservative_reward mean-std: the weight of the ensemble's std"
    )
    select_checkpoint: Literal["heldout", "last"] = field(
        "heldout",
        help="the policy the stage outputs: heldout = of the checkpoints saved, the one the "
        "held-out reward model scored highest (with a held-out model; else the last), last = "
        "the last",
    )
    select_prompts: int = field(
        256,
        help="select_checkpoint heldout: each save samples this many held-out-split prompts "
        "select_samples times, with the same keys at every save, and is ranked by the "
        "held-out model's mean score of them; 0 = by the save's own rollout (one batch of "
        "train prompts: noisy on a plateau)",
    )
    select_samples: int = field(1, help="select_prompts: samples per prompt")
    heldout_patience: int = field(
        0,
        help="stop early (status stopped_overoptimisation) when the held-out reward model's "
        "score, averaged over this many rollouts, has fallen more than heldout_tolerance "
        "below its best such average while the proxy's average rose above its value then; "
        "0 = never",
    )
    heldout_tolerance: float = field(
        0.2,
        help="heldout_patience: the fall that stops, in the held-out model's eval stds; one "
        "rollout's score wanders by about 0.1 on the built-in task",
    )

    def __post_init__(self) -> None:
        for name, allowed in (
            ("conservative_reward", ("", "mean", "min", "mean-std")),
            ("select_checkpoint", ("heldout", "last")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {allowed}")
        if (
            self.conservative_lambda < 0
            or self.heldout_patience < 0
            or self.select_prompts < 0
            or self.select_samples < 1
            or not (0 <= self.heldout_tolerance < float("inf"))
        ):
            raise ValueError(
                f"conservative_lambda ({self.conservative_lambda}), heldout_patience "
                f"({self.heldout_patience}), select_prompts ({self.select_prompts}) and "
                f"heldout_tolerance ({self.heldout_tolerance}) must be finite and >= 0, and "
                f"select_samples ({self.select_samples}) >= 1"
            )
