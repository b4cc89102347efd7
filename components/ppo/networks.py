"""What the PPO loop starts from and hands back: the networks' graphs and host parameters
(:class:`Networks`), and the run's result (:class:`LoopResult`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from components.core.model import lora
from components.ppo.monitors import Monitors
from components.ppo.rollout import Frozen, Models, ScoreNorm, TokenIds

PyTree = Any


@dataclasses.dataclass(slots=True)
class Networks:
    """Everything the loop starts from: graph definitions and host parameters."""

    models: Models
    policy: PyTree
    critic: PyTree | None  # None for grpo and rloo
    reward: PyTree | None  # None: reward functions alone
    ids: TokenIds
    norm: ScoreNorm
    frozen: Frozen | None = None  # LoRA: the bases (policy, critic and reward hold the rest)
    monitors: PyTree | None = None  # the reward artifact's other models, stacked (monitors.py)
    monitor_spec: Monitors | None = None

    @property
    def reference(self) -> PyTree:
        """The reference's own parameters: the initial policy, or with LoRA its adapters off."""
        return self.policy if self.frozen is None else lora.adapters_off(self.policy)

    def whole_policy(self, policy: PyTree) -> PyTree:
        """A host policy's whole parameters (its frozen base joined back under LoRA)."""
        return policy if self.frozen is None else lora.join(policy, self.frozen.policy)


@dataclasses.dataclass(slots=True)
class LoopResult:
    """What the loop hands back to the stage."""

    policy: PyTree  # host copy of the output policy (the last good one)
    iteration: int  # the updates the output policy has had (restorations undo some)
    status: str
    metrics: dict[str, float]  # the output policy's rollout figures, plus the run's counts
    guard_events: list[dict[str, Any]]
    final_kl: float | None  # KL per token of the output policy's check rollout
    # select_checkpoint heldout: the iteration output and the last one, with their held-out
    # reward model scores; None when the last policy is the output by configuration.
    selected: dict[str, float] | None = None
