"""Bradley-Terry reward loss and its evaluation sums."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.model.scoring import pair_rewards


def pair_losses(
    chosen: jax.Array, rejected: jax.Array, batch: dict, *, center_coef: float, use_margin: bool
) -> jax.Array:
    """Per-pair loss: −log σ(r_chosen − r_rejected − margin) + centring of both rewards.

    Training takes its mean and evaluation its sum, so the eval loss is the training
    loss on held-out pairs.
    """
    margin = batch["margin"] if use_margin else 0.0
    loss = -jax.nn.log_sigmoid(chosen - rejected - margin)
    if center_coef:
        loss = loss + center_coef * (chosen + rejected) ** 2
    return loss


def make_reward_loss(graphdef: nnx.GraphDef, *, center_coef: float, use_margin: bool):
    """``loss_fn(params, batch, rng)``: the mean of :func:`pair_losses` on this device."""

    def loss_fn(params: Any, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        chosen, rejected = pair_rewards(graphdef, params, batch)
        loss = pair_losses(
            chosen, rejected, batch, center_coef=center_coef, use_margin=use_margin
        ).mean()
        # TRL's RewardTrainer's names where the quantity is the same (accuracy, margin,
        # mean_reward over both responses); the two sides apart as well.
        return loss, {
            "accuracy": jnp.mean(chosen > rejected),
            "margin": (chosen - rejected).mean(),
            "mean_reward": (chosen.mean() + rejected.mean()) / 2,
            "reward/chosen": chosen.mean(),
            "reward/rejected": rejected.mean(),
        }

    return loss_fn


def make_reward_eval_sums(graphdef: nnx.GraphDef, *, center_coef: float, use_margin: bool):
    """Per-device sums for eval accuracy (ties count half), the training loss, reward mean/std."""

    def sums(params: Any, batch: dict) -> dict:
        chosen, rejected = pair_rewards(graphdef, params, batch)
        both = jnp.concatenate([chosen, rejected])
        losses = pair_losses(
            chosen, rejected, batch, center_coef=center_coef, use_margin=use_margin
        )
        return {
            "pairs": jnp.float32(chosen.shape[0]),
            "correct": jnp.sum(chosen > rejected) + 0.5 * jnp.sum(chosen == rejected),
            "loss": jnp.sum(losses),
            "reward_sum": jnp.sum(both),
            "reward_sq_sum": jnp.sum(both**2),
        }

    return sums


def summarize_eval(totals: dict[str, float]) -> dict[str, float]:
    """Accuracy, mean loss and reward statistics from summed eval totals."""
    pairs = totals["pairs"]
    mean = totals["reward_sum"] / (2 * pairs)
    variance = max(totals["reward_sq_sum"] / (2 * pairs) - mean**2, 0.0)
    return {
        "accuracy": totals["correct"] / pairs,
        "loss": totals["loss"] / pairs,
        "reward_mean": mean,
        "reward_std": variance**0.5,
        "pairs": pairs,
    }
