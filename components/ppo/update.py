"""The update phase: ``ppo_epochs`` × ``minibatches`` clipped PPO steps, one compiled call.

Loss = clipped surrogate + ``vf_coef`` · clipped value loss − ``entropy_coef`` ·
entropy, per-token means over the GLOBAL minibatch: each device weights its
local mean by its share of the real tokens, so the ``lax.pmean`` of the
gradients is the gradient of the global mean whatever the device count.

Minibatch ``j`` holds rows ``j, j + M, j + 2M, …`` of every device's batch (the
rollout order is already a random draw of prompts), and each epoch visits the
minibatches in an order drawn from a key shared by all devices. Both choices
make the global minibatches independent of how the batch is laid out over
devices: 8 devices compute the same update as 1 on the same global batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax

from components.core import fsdp
from components.core.optim import make_optimizer
from components.core.parallel import TrainState
from components.core import scoring
from components.ppo import losses
from components.ppo.config import PPOConfig
from components.ppo.rollout import AXIS, Models

PyTree = Any
UPDATE_FIELDS = (
    "prompt_tokens",
    "prompt_mask",
    "response_tokens",
    "response_mask",
    "logprobs",
    "values",
    "advantages",
    "returns",
)


@flax.struct.dataclass
class PPOState:
    """What the update changes: the policy's and the critic's parameters and optimizer states."""

    policy: TrainState
    critic: TrainState

    @classmethod
    def create(cls, policy_params: PyTree, critic_params: PyTree, config: PPOConfig) -> PPOState:
        """Fresh optimizer states for both networks."""
        policy_opt, critic_opt = optimizers(config)
        return cls(
            policy=TrainState.create(policy_params, policy_opt),
            critic=TrainState.create(critic_params, critic_opt),
        )


def optimizers(config: PPOConfig) -> tuple[optax.GradientTransformation, ...]:
    """AdamW (clipped, warmed up) of the policy and of the critic."""
    return make_optimizer(config.policy_optim()), make_optimizer(config.critic_optim())


def _ppo_loss(
    params: tuple[PyTree, PyTree], minibatch: dict, models: Models, config: PPOConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This device's share of the global minibatch loss, and its metrics (same weighting)."""
    policy_params, critic_params = params
    mask = minibatch["response_mask"]
    logits = scoring.response_logits(models.policy, policy_params, minibatch)
    logprobs = scoring.logprobs_of(logits, minibatch["response_tokens"])
    values = scoring.response_values(models.critic, critic_params, minibatch)
    pg_loss, pg_metrics = losses.policy_loss(
        logprobs, minibatch["logprobs"], minibatch["advantages"], mask, config.clip_eps
    )
    vf_loss, vf_metrics = losses.value_loss(
        values, minibatch["values"], minibatch["returns"], mask, config.value_clip_eps
    )
    entropy = losses.entropy_from_logits(logits, mask)
    loss = pg_loss + config.vf_coef * vf_loss - config.entropy_coef * entropy
    # Local token mean × (local tokens / mean tokens per device): pmean gives the global mean.
    weight = minibatch["weight"]
    metrics = {**pg_metrics, **vf_metrics, "policy/entropy": entropy, "loss/total": loss}
    return loss * weight, {name: value * weight for name, value in metrics.items()}


def _apply(
    state: TrainState, grads: PyTree, optimizer: optax.GradientTransformation, lr_scale: jax.Array
) -> TrainState:
    """One optimizer step with the updates scaled by ``lr_scale`` (the guard's reductions)."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    # AdamW's update (weight decay included) is linear in the learning rate.
    updates = jax.tree.map(lambda u: u * lr_scale, updates)
    params = optax.apply_updates(state.params, updates)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state)


def _token_weights(minibatches: dict) -> jax.Array:
    """[M] local real tokens / mean real tokens per device, of each minibatch (one pmean)."""
    counts = jnp.sum((minibatches["response_mask"] != 0).astype(jnp.float32), axis=(1, 2))
    return counts / jnp.maximum(lax.pmean(counts, AXIS), 1.0)


def minibatch_step(
    state: PPOState, minibatch: dict, lr_scale: jax.Array, models: Models, config: PPOConfig
) -> tuple[PPOState, dict[str, jax.Array]]:
    """One optimizer step of both networks; skipped (state kept) when anything is non-finite."""
    grad_fn = jax.value_and_grad(_ppo_loss, has_aux=True)
    params = (state.policy.params, state.critic.params)
    (loss, metrics), grads = grad_fn(params, minibatch, models, config)
    # One all-reduce of everything replicated; sharded gradients come back summed.
    loss, metrics, grads = fsdp.mean_over_devices((loss, metrics, grads), AXIS)
    policy_norm, critic_norm = fsdp.global_norm(grads[0]), fsdp.global_norm(grads[1])
    # Decided after pmean: every device takes the same branch.
    finite = jnp.isfinite(loss) & jnp.isfinite(policy_norm) & jnp.isfinite(critic_norm)
    policy_opt, critic_opt = optimizers(config)
    updated = PPOState(
        policy=_apply(state.policy, grads[0], policy_opt, lr_scale),
        critic=_apply(state.critic, grads[1], critic_opt, lr_scale),
    )
    state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, state)
    metrics.update(
        {
            "policy/grad_norm": policy_norm,
            "val/grad_norm": critic_norm,
            "skipped": 1.0 - finite.astype(jnp.float32),
        }
    )
    return state, metrics


def strided_minibatches(batch: dict, count: int) -> dict:
    """[b, ...] → [count, b / count, ...] with minibatch j = rows j, j + count, …."""
    return {
        name: value.reshape(value.shape[0] // count, count, *value.shape[1:]).swapaxes(0, 1)
        for name, value in batch.items()
    }


def update_step(
    state: PPOState,
    batch: dict,
    rng: jax.Array,
    lr_scale: jax.Array,
    *,
    models: Models,
    config: PPOConfig,
) -> tuple[PPOState, dict[str, jax.Array]]:
    """All epochs and minibatches of one iteration; metrics averaged over the steps."""
    minibatches = strided_minibatches({k: batch[k] for k in UPDATE_FIELDS}, config.minibatches)
    minibatches["weight"] = _token_weights(minibatches)

    def one_step(carry: PPOState, minibatch: dict):
        return minibatch_step(carry, minibatch, lr_scale, models, config)

    def epoch(carry: PPOState, key: jax.Array):
        # Same key on every device: the order of the global minibatches is layout-free.
        order = jax.random.permutation(key, config.minibatches)
        shuffled = jax.tree.map(lambda x: x[order], minibatches)
        return lax.scan(one_step, carry, shuffled)

    state, metrics = lax.scan(epoch, state, jax.random.split(rng, config.ppo_epochs))
    summary = {name: jnp.mean(value) for name, value in metrics.items()}
    summary["skipped"] = jnp.sum(metrics["skipped"])
    return state, summary


def make_update(
    models: Models, config: PPOConfig, devices: Sequence[jax.Device] | None = None
) -> Callable[[PPOState, dict, jax.Array, jax.Array], tuple[PPOState, dict]]:
    """``update(state, batch, rng, lr_scale) -> (state, metrics)`` pmapped; donates ``state``."""

    def step(state: PPOState, batch: dict, rng: jax.Array, lr_scale: jax.Array):
        return update_step(state, batch, rng, lr_scale, models=models, config=config)

    return jax.pmap(
        step,
        axis_name=AXIS,
        in_axes=(0, 0, None, None),
        donate_argnums=0,
        devices=None if devices is None else list(devices),
    )


def make_ema_update(decay: float) -> Callable[[PyTree, PyTree], PyTree]:
    """``reference ← decay · reference + (1 − decay) · policy``, pmapped (EMA reference)."""

    def step(reference: PyTree, policy: PyTree) -> PyTree:
        return jax.tree.map(lambda r, p: decay * r + (1.0 - decay) * p, reference, policy)

    return jax.pmap(step, axis_name=AXIS, donate_argnums=0)
