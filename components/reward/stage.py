"""The reward stage: train a Bradley-Terry reward model and export it with reward statistics."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from components.core import fileio
from components.core.distributed import is_primary
from components.core.model_io import save_model
from components.core.trainer import train_on_preferences
from components.reward.config import RewardConfig
from components.reward.train import make_reward_eval_sums, make_reward_loss, summarize_eval

REWARD_STATS_FILE = "reward_stats.json"


def run(config: RewardConfig, shards_dir: str, output: str) -> dict[str, Any]:
    """Train on ``shards_dir``'s train split; write the model artifact to ``output``."""
    trained = train_on_preferences(
        config,
        shards_dir,
        output,
        stage="reward",
        base=config.base_policy,
        scalar_head=True,
        make_loss=lambda graphdef: make_reward_loss(
            graphdef, center_coef=config.center_rewards_coef, use_margin=config.use_margin
        ),
        make_eval_sums=make_reward_eval_sums,
        summarize_eval=summarize_eval,
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
    save_model(
        output, trained.model, trained.result.params, tokenizer=trained.manifest["tokenizer"],
        stage="reward", training=dataclasses.asdict(config), step=trained.result.step,
        reward_stats=stats,
    )  # fmt: skip
    if is_primary():
        fileio.write_text(fileio.join(output, REWARD_STATS_FILE), json.dumps(stats, indent=2))
    return trained.summary()
