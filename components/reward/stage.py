"""The reward stage: train a Bradley-Terry reward model and export it with reward statistics."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
from flax import nnx

from components.core import fileio
from components.core.distributed import is_primary, maybe_initialize
from components.core.input_pipeline import read_manifest
from components.core.model_io import save_model, stage_model
from components.core.parallel import replicate
from components.core.trainer import (
    eval_batch_count,
    fit,
    make_eval_step,
    preference_streams,
    run_eval,
)
from components.reward.config import RewardConfig
from components.reward.train import make_reward_eval_sums, make_reward_loss, summarize_eval

REWARD_STATS_FILE = "reward_stats.json"


def run(config: RewardConfig, shards_dir: str, output: str) -> dict[str, Any]:
    """Train on ``shards_dir``'s train split; write the model artifact to ``output``."""
    maybe_initialize()
    manifest = read_manifest(shards_dir)
    model = stage_model(
        manifest,
        base=config.base_policy,
        preset=config.preset,
        scalar_head=True,
        seed=config.seed,
        remat=config.remat,
        dtype=config.dtype,
        workdir=fileio.join(output, "work"),
    )
    graphdef, params = nnx.split(model, nnx.Param)
    eval_step = make_eval_step(make_reward_eval_sums(graphdef))
    eval_count = eval_batch_count(manifest, "eval", config)

    def evaluate(replicated_params: Any) -> dict[str, float]:
        batches = preference_streams(shards_dir, "eval", config, shuffle=False, repeat=False)
        return summarize_eval(run_eval(eval_step, replicated_params, batches, eval_count))

    train_data = preference_streams(shards_dir, "train", config, shuffle=True, repeat=True)
    loss_fn = make_reward_loss(
        graphdef, center_coef=config.center_rewards_coef, use_margin=config.use_margin
    )
    result = fit(
        config=config, output=output, stage="reward", params=params,
        loss_fn=loss_fn, train_data=train_data, evaluate=evaluate,
    )  # fmt: skip
    final_eval = evaluate(replicate(result.params))
    stats = {
        "mean": final_eval["reward_mean"],
        "std": final_eval["reward_std"],
        "pairs": final_eval["pairs"],
        "accuracy": final_eval["accuracy"],
        "split": "eval",
    }
    save_model(
        output, model, result.params, tokenizer=manifest["tokenizer"], stage="reward",
        training=dataclasses.asdict(config), step=result.step, reward_stats=stats,
    )  # fmt: skip
    if is_primary():
        fileio.write_text(fileio.join(output, REWARD_STATS_FILE), json.dumps(stats, indent=2))
    jax.block_until_ready(result.params)
    return {**result.metrics, **{f"eval/{k}": v for k, v in final_eval.items()}}
