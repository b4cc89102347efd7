"""What the report's header says about the run: its id, the date, the algorithm and the
model it aligned, the judge that decided the gate and the key hyperparameters, read from
the aligned policy's own config.json (what trained it) at evaluation time."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

# The run an artifact belongs to; the trackers name their runs by it too.
from components.core.training.trackers import run_id_of as run_id_of

# The training fields a reader checks first, per algorithm (the stage config's names).
KEY_HYPERPARAMETERS = {
    "ppo": ("learning_rate", "kl_coef", "kl_target", "adaptive_kl", "rollout_batch_size",
            "iterations", "ppo_epochs", "minibatches", "lora_rank", "seed"),
    "grpo": ("learning_rate", "kl_coef", "kl_target", "group_size", "loss_type",
             "rollout_batch_size", "iterations", "lora_rank", "seed"),
    "rloo": ("learning_rate", "kl_coef", "kl_target", "group_size", "rollout_batch_size",
             "iterations", "lora_rank", "seed"),
    "dpo": ("learning_rate", "beta", "loss_type", "steps", "batch_size", "lora_rank", "seed"),
    "sft": ("learning_rate", "steps", "batch_size", "lora_rank", "seed"),
}  # fmt: skip


def describe(policy: Mapping[str, Any], run_id: str = "") -> dict[str, Any]:
    """The header's facts from the aligned policy's config.json (``policy``)."""
    training = policy.get("training") or {}
    stage = str(policy.get("stage") or "")
    algorithm = str(training.get("algorithm") or stage)
    keys = KEY_HYPERPARAMETERS.get(algorithm, ())
    return {
        "id": run_id,
        "evaluated": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "algorithm": algorithm,
        "stage": stage,
        "step": policy.get("step"),
        "base_model": policy.get("base_policy") or policy.get("hf_source") or "",
        "hyperparameters": {key: training[key] for key in keys if key in training},
    }
