"""The PPO run's checkpointer: what a checkpoint must match to be resumed, and which saves
it keeps (the latest, and with a held-out reward model the best it scored)."""

from __future__ import annotations

from components.core.training.checkpoint import (
    CheckpointConfig,
    TrainCheckpointer,
    training_state_dir,
)
from components.ppo.config import PPOConfig


def ppo_checkpointer(
    config: PPOConfig,
    output: str,
    inputs: dict[str, str] | None = None,
    heldout: bool = False,
) -> TrainCheckpointer:
    """The run's checkpointer. ``inputs`` (flag → folder: shards, policy, reward) are
    fingerprinted into the checkpoints' identity, so a resume with other ones is refused.
    With a ``heldout`` reward model and ``select_checkpoint`` heldout it also keeps the save
    the held-out model scored highest (monitors.py), which the run outputs."""
    identity = {
        "stage": "ppo",
        "algorithm": config.algorithm,
        "rollout_batch_size": config.rollout_batch_size,
        "seed": config.seed,
    }
    return TrainCheckpointer(
        training_state_dir(output),
        CheckpointConfig(
            save_every=config.save_every,
            keep=config.keep_checkpoints,
            keep_best=int(heldout and config.select_checkpoint == "heldout"),
        ),
        identity,
        inputs,
    )
