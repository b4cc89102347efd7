"""The dpo stage: direct preference optimization of a policy on the preference shards.

Inputs: the shard stage's preference pairs and a policy artifact (the sft output, any
policy model artifact, or a Hugging Face folder), which is both the starting policy and
the frozen reference. No reward model, no sampling. Output: the aligned policy as a
model artifact (``config.json`` with ``"stage": "dpo"``, ``params/``), ``metrics.jsonl``
(TRL's names: ``rewards/chosen``, ``rewards/margins``, ``logps/chosen``, …) and
TensorBoard events.

The reference's log-probs are computed for each batch before the train step, by a
forward-only pmapped pass over the frozen parameters (replicated, or in chunks with
``fsdp``), and travel in the batch: the step's gradient never reaches the reference,
and the trainer's loop (``fit``: checkpoints, exact resume, eval) runs unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx

from components.core import fileio, parallel
from components.core.checkpoint import read_model_config
from components.core.distributed import maybe_initialize
from components.core.input_pipeline import longest_lengths, read_manifest
from components.core.model_io import ModelMismatchError, is_pretrained, stage_model
from components.core.trainer import (
    PreferenceTraining,
    StreamBatches,
    eval_batch_count,
    fit,
    make_eval_step,
    preference_streams,
    run_eval,
)
from components.dpo.config import DPOConfig
from components.dpo.train import (
    REFERENCE_CHOSEN,
    REFERENCE_REJECTED,
    PairLogps,
    make_dpo_eval_sums,
    make_dpo_loss,
    make_reference_step,
    summarize_eval,
)
from components.hf.importer import resolve_base

log = logging.getLogger(__name__)
PyTree = Any


def run(config: DPOConfig, shards_dir: str, policy_dir: str, output: str) -> dict[str, Any]:
    """Train ``policy_dir`` with DPO on ``shards_dir``; write the aligned policy to ``output``."""
    # A Hugging Face folder is imported once into the task's work folder.
    policy = resolve_base(policy_dir, fileio.join(output, "work"))
    trained = train_dpo(config, shards_dir, policy, output)
    trained.save(output, "dpo")
    return trained.summary()


def check_policy(policy_dir: str) -> dict[str, Any]:
    """The policy artifact's ``config.json``; a reward model (scalar head) is refused."""
    info = read_model_config(policy_dir)
    if info.get("scalar_head"):
        raise ModelMismatchError(
            f"{policy_dir} is a reward model (stage {info.get('stage')!r}, with a scalar head), "
            "not a policy: DPO needs no reward model; pass a policy as --policy (the output "
            "of the sft stage, or of ppo or dpo)"
        )
    return info


class ReferenceScored(Iterator[dict[str, np.ndarray]]):
    """A preference stream's batches with the frozen reference's log-probs of both responses."""

    def __init__(self, batches: StreamBatches, score: Callable[[dict], PairLogps]) -> None:
        self.batches, self.score = batches, score

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self.batches)
        chosen, rejected = self.score(parallel.shard_batch(batch))
        # [devices, per device] back to the host batch's row order.
        return {
            **batch,
            REFERENCE_CHOSEN: np.asarray(chosen).reshape(-1),
            REFERENCE_REJECTED: np.asarray(rejected).reshape(-1),
        }

    def position(self) -> dict[str, Any]:
        return self.batches.position()

    def restore(self, position: dict[str, Any]) -> None:
        self.batches.restore(position)


def train_dpo(
    config: DPOConfig, shards_dir: str, policy_dir: str, output: str
) -> PreferenceTraining:
    """Train the policy of ``policy_dir`` against its frozen copy; evaluate on the eval split."""
    maybe_initialize()
    manifest = read_manifest(shards_dir)
    if not config.max_len:
        config = dataclasses.replace(config, max_len=sum(longest_lengths(manifest)))
    check_policy(policy_dir)
    pretrained = is_pretrained(policy_dir)
    config = config.resolved(pretrained=pretrained)
    start = "pretrained policy" if pretrained else "policy trained from scratch"
    log.info("dpo: learning rate %g (%s)", config.learning_rate, start)
    model = stage_model(
        manifest, base=policy_dir, preset=config.preset, scalar_head=False, seed=config.seed,
        remat=config.remat, dtype=config.dtype,
    )  # fmt: skip
    graphdef, params = nnx.split(model, nnx.Param)
    loss = {"beta": config.beta, "loss_type": config.loss_type}
    loss["label_smoothing"] = config.label_smoothing
    reference = parallel.place(jax.device_get(params), sharded=config.fsdp)
    reference_step = make_reference_step(graphdef, average=config.loss_type == "ipo")

    def scored(split: str, *, shuffle: bool, repeat: bool) -> ReferenceScored:
        batches = preference_streams(shards_dir, split, config, shuffle=shuffle, repeat=repeat)
        return ReferenceScored(batches, lambda batch: reference_step(reference, batch))

    eval_step = make_eval_step(make_dpo_eval_sums(graphdef, **loss))
    eval_count = eval_batch_count(manifest, "eval", config)

    def evaluate(placed_params: PyTree) -> dict[str, float]:
        batches = scored("eval", shuffle=False, repeat=False)
        return summarize_eval(run_eval(eval_step, placed_params, batches, eval_count))

    result = fit(
        config=config, output=output, stage="dpo", params=params,
        loss_fn=make_dpo_loss(graphdef, **loss),
        train_data=scored("train", shuffle=True, repeat=True), evaluate=evaluate,
    )  # fmt: skip
    final_eval = evaluate(parallel.place(result.params, sharded=config.fsdp))
    return PreferenceTraining(model, manifest, config, pretrained, result, final_eval)
