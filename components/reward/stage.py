"""The reward stage: train a Bradley-Terry reward model and export it with reward statistics."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterator
from typing import Any

from components.core import fileio
from components.core.rewards import members
from components.core.training.checkpoint import CHECKPOINT_DIR_ENV
from components.core.training.distributed import is_primary
from components.core.training.trainer import train_on_preferences
from components.hf.importer import remove_import, resolve_base
from components.reward.config import RewardConfig
from components.reward.train import make_reward_eval_sums, make_reward_loss, summarize_eval

REWARD_STATS_FILE = members.STATS_FILE


class RewardAccuracyError(ValueError):
    """The reward model ranks held-out pairs worse than ``min_reward_accuracy`` asks."""


def run(config: RewardConfig, shards_dir: str, output: str) -> dict[str, Any]:
    """Train on ``shards_dir``'s train split; write the model artifact to ``output``, and
    beside it the held-out model (the shards' heldout split, when they have one) and the
    ensemble's other members (``ensemble_size``): members.py says where and why.

    Raises RewardAccuracyError after writing them when the eval accuracy of the model PPO
    trains against is below ``min_reward_accuracy``.
    """
    from components.core.data.input_pipeline import read_manifest

    splits = read_manifest(shards_dir)["splits"]
    heldout = members.HELDOUT in splits
    if heldout and splits[members.HELDOUT]["pairs"] < config.batch_size:
        raise ValueError(
            f"{shards_dir}'s heldout split has {splits[members.HELDOUT]['pairs']} pairs, fewer "
            f"than one batch ({config.batch_size}) of the held-out reward model: raise the "
            "shard stage's heldout_fraction (pipeline: heldout_reward), give more held-out data "
            "(heldout_data_uri), or lower batch_size"
        )
    # A Hugging Face folder is imported once into the task's work folder, for every model.
    base = resolve_base(config.base_policy, fileio.join(output, "work"))
    trained = {"": _train(config, shards_dir, output, base, "train")}
    if heldout:
        with _own_state(members.HELDOUT):
            folder = fileio.join(output, members.HELDOUT)
            trained[members.HELDOUT] = _train(config, shards_dir, folder, base, members.HELDOUT)
    for i in range(1, config.ensemble_size):
        with _own_state(f"{members.ENSEMBLE}-{i}"):
            seeded = dataclasses.replace(config, seed=config.seed + i)
            folder = members.ensemble_dir(output, i)
            trained[f"{members.ENSEMBLE}/{i}"] = _train(seeded, shards_dir, folder, base, "train")
    stats = trained[""][1]
    stats["members"] = members.members_entry(heldout, config.ensemble_size)
    for name, (training, own) in trained.items():
        folder = fileio.join(output, name) if name else output
        training.save(folder, "reward", reward_stats=own)
        if is_primary():
            fileio.write_text(fileio.join(folder, REWARD_STATS_FILE), json.dumps(own, indent=2))
    remove_import(fileio.join(output, "work"))
    check_accuracy(config, stats, output)
    summary = trained[""][0].summary()
    for name, (_, own) in trained.items():
        if name:  # the members' eval figures beside the proxy's
            summary[f"{name}/eval/accuracy"] = own["accuracy"]
    return summary


def _train(
    config: RewardConfig, shards_dir: str, output: str, base: str, split: str
) -> tuple[Any, dict[str, Any]]:
    """One reward model trained on ``split`` and evaluated on the eval split; with its
    score statistics (PPO normalizes its scores with them; the accuracy is on eval pairs)."""
    loss_terms = {"center_coef": config.center_rewards_coef, "use_margin": config.use_margin}
    trained = train_on_preferences(
        config,
        shards_dir,
        output,
        stage="reward",
        base=base,
        scalar_head=True,
        make_loss=lambda graphdef: make_reward_loss(graphdef, **loss_terms),
        make_eval_sums=lambda graphdef: make_reward_eval_sums(graphdef, **loss_terms),
        summarize_eval=summarize_eval,
        # Fingerprinted as given: an HF folder's import is redone in a new output.
        inputs={"--base-policy": config.base_policy},
        train_split=split,
    )
    final = trained.final_eval
    stats = {
        "mean": final["reward_mean"],
        "std": final["reward_std"],
        "pairs": final["pairs"],
        "accuracy": final["accuracy"],
        "split": "eval",
        "trained_on": split,
        "seed": config.seed,
    }
    return trained, stats


@contextlib.contextmanager
def _own_state(name: str) -> Iterator[None]:
    """A member's resumable state apart from the proxy's: under a durable state folder
    (``$ALIGNPIPE_CHECKPOINT_DIR``, the pipeline's checkpoint_root) its own subfolder; else
    it is in the member's own output folder already."""
    saved = os.environ.get(CHECKPOINT_DIR_ENV, "").strip()
    if saved:
        os.environ[CHECKPOINT_DIR_ENV] = fileio.join(saved, name)
    try:
        yield
    finally:
        if saved:
            os.environ[CHECKPOINT_DIR_ENV] = saved


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
