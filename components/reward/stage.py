"""The reward stage: train a Bradley-Terry reward model and export it with reward statistics."""

from __future__ import annotations

import json
from typing import Any

from components.core import fileio
from components.core.training.distributed import is_primary
from components.core.training.trainer import train_on_preferences
from components.hf.importer import remove_import, resolve_base
from components.reward.config import RewardConfig
from components.reward.train import make_reward_eval_sums, make_reward_loss, summarize_eval

REWARD_STATS_FILE = "reward_stats.json"


class RewardAccuracyError(ValueError):
    """The reward model ranks held-out pairs worse than ``min_reward_accuracy`` asks."""


def run(config: RewardConfig, shards_dir: str, output: str) -> dict[str, Any]:
    """Train on ``shards_dir``'s train split; write the model artifact to ``output``.

    Raises RewardAccuracyError after writing it when the eval accuracy is below
    ``min_reward_accuracy``.
    """
    loss_terms = {"center_coef": config.center_rewards_coef, "use_margin": config.use_margin}
    trained = train_on_preferences(
        config,
        shards_dir,
        output,
        stage="reward",
        # A Hugging Face folder is imported once into the task's work folder.
        base=resolve_base(config.base_policy, fileio.join(output, "work")),
        scalar_head=True,
        make_loss=lambda graphdef: make_reward_loss(graphdef, **loss_terms),
        make_eval_sums=lambda graphdef: make_reward_eval_sums(graphdef, **loss_terms),
        summarize_eval=summarize_eval,
        # Fingerprinted as given: an HF folder's import is redone in a new output.
        inputs={"--base-policy": config.base_policy},
    )
    final = trained.final_eval
    # PPO normalizes rewards with these; the accuracy is the reward model's on held-out pairs.
    stats = {
        "mean": final["reward_mean"],
        "std": final["reward_std"],
        "pairs": final["pairs"],
        "accuracy": final["accuracy"],
        "split": "eval",
    }
    trained.save(output, "reward", reward_stats=stats)
    remove_import(fileio.join(output, "work"))
    if is_primary():
        fileio.write_text(fileio.join(output, REWARD_STATS_FILE), json.dumps(stats, indent=2))
    check_accuracy(config, stats, output)
    return trained.summary()


def check_accuracy(config: RewardConfig, stats: dict[str, Any], output: str) -> None:
    """Refuse a reward model below ``min_reward_accuracy``: the reason names the fix."""
    if stats["accuracy"] >= config.min_reward_accuracy:
        return
    raise RewardAccuracyError(
        f"reward model eval accuracy {stats['accuracy']:.3f} (on {stats['pairs']:.0f} eval pairs) "
        f"is below min_reward_accuracy {config.min_reward_accuracy:g}: a policy aligned to it "
        f"would learn noise, so nothing downstream should use it (it is kept in {output}). "
        "Train it on more preference data or for more steps (pipeline: reward_steps), or "
        "lower min_reward_accuracy if your labels are this noisy"
    )
