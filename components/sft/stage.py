"""The sft stage: warm-start a policy on the chosen responses and export it."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from components.core import fileio
from components.core.distributed import maybe_initialize
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
from components.sft.config import SFTConfig
from components.sft.train import make_sft_eval_sums, make_sft_loss, summarize_eval


def run(config: SFTConfig, shards_dir: str, output: str) -> dict[str, Any]:
    """Train the initial policy on ``shards_dir``; write the model artifact to ``output``."""
    maybe_initialize()
    manifest = read_manifest(shards_dir)
    model = stage_model(
        manifest,
        base=config.base_policy,
        preset=config.preset,
        scalar_head=False,
        seed=config.seed,
        remat=config.remat,
        dtype=config.dtype,
        workdir=fileio.join(output, "work"),
    )
    graphdef, params = nnx.split(model, nnx.Param)
    eval_step = make_eval_step(make_sft_eval_sums(graphdef))
    eval_count = eval_batch_count(manifest, "eval", config)

    def evaluate(replicated_params: Any) -> dict[str, float]:
        batches = preference_streams(shards_dir, "eval", config, shuffle=False, repeat=False)
        return summarize_eval(run_eval(eval_step, replicated_params, batches, eval_count))

    train_data = preference_streams(shards_dir, "train", config, shuffle=True, repeat=True)
    result = fit(
        config=config, output=output, stage="sft", params=params,
        loss_fn=make_sft_loss(graphdef), train_data=train_data, evaluate=evaluate,
    )  # fmt: skip
    final_eval = evaluate(replicate(result.params))
    save_model(
        output, model, result.params, tokenizer=manifest["tokenizer"], stage="sft",
        training=dataclasses.asdict(config), step=result.step,
    )  # fmt: skip
    return {**result.metrics, **{f"eval/{k}": v for k, v in final_eval.items()}}
