"""The dpo stage: direct preference optimization of a policy on the preference shards.

Inputs: the shard stage's preference pairs and a policy artifact (the sft output, any
policy model artifact, or a Hugging Face folder), which is both the starting policy and
the frozen reference. No reward model, no sampling. Output: the aligned policy as a
model artifact (``config.json`` with ``"stage": "dpo"``, ``params/``), ``metrics.jsonl``
(TRL's names: ``rewards/chosen``, ``rewards/margins``, ``logps/chosen``, …) and
TensorBoard events.

The reference's log-probs are computed for each batch before the train step, by a
forward-only pmapped pass over the frozen parameters (replicated, or in chunks with
``fsdp``), and travel in the batch: the step's gradient never reaches the reference, and
the sft and reward stages' trainer (``train_on_preferences``: checkpoints, exact resume,
eval) runs unchanged, the scoring passed to it as its ``wrap_batches`` hook.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx

from components.core import fileio
from components.core.model.artifact import require_policy
from components.core.training import parallel
from components.core.training.checkpoint import read_model_config
from components.core.training.trainer import BatchWrapper, StreamBatches, train_on_preferences
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
from components.hf.importer import remove_import, resolve_base

PyTree = Any


def run(config: DPOConfig, shards_dir: str, policy_dir: str, output: str) -> dict[str, Any]:
    """Train ``policy_dir`` with DPO on ``shards_dir``; write the aligned policy to ``output``."""
    # A Hugging Face folder is imported once into the task's work folder.
    policy = resolve_base(policy_dir, fileio.join(output, "work"))
    check_policy(policy)
    loss = {"beta": config.beta, "loss_type": config.loss_type}
    loss["label_smoothing"] = config.label_smoothing
    trained = train_on_preferences(
        config, shards_dir, output, stage="dpo", base=policy, scalar_head=False,
        make_loss=lambda graphdef: make_dpo_loss(graphdef, **loss),
        make_eval_sums=lambda graphdef: make_dpo_eval_sums(graphdef, **loss),
        summarize_eval=summarize_eval, wrap_batches=reference_scoring(config),
        inputs={"--policy": policy_dir},  # as given: an HF import is redone in a new output
    )  # fmt: skip
    trained.save(output, "dpo")
    remove_import(fileio.join(output, "work"))
    return trained.summary()


def check_policy(policy_dir: str) -> dict[str, Any]:
    """The policy artifact's ``config.json``; a reward model (scalar head) is refused."""
    info = read_model_config(policy_dir)
    require_policy(info, policy_dir, "--policy", ": DPO needs no reward model")
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


def reference_scoring(config: DPOConfig) -> Callable[[nnx.GraphDef, PyTree], BatchWrapper]:
    """The trainer's ``wrap_batches``: the starting policy, placed once as the frozen
    reference, scores every batch of every split."""

    def wrap_batches(graphdef: nnx.GraphDef, params: PyTree) -> BatchWrapper:
        reference = parallel.place(jax.device_get(params), sharded=config.fsdp)
        reference_step = make_reference_step(graphdef, average=config.loss_type == "ipo")
        return lambda batches: ReferenceScored(
            batches, lambda batch: reference_step(reference, batch)
        )

    return wrap_batches
