"""The update phase: ``ppo_epochs`` × ``minibatches`` clipped PPO steps, one compiled call.

Loss = clipped surrogate + ``vf_coef`` · clipped value loss (ppo) − ``entropy_coef``
· entropy (+ ``kl_coef`` · k3 KL to the reference for grpo), per-token means over
the GLOBAL minibatch (TRL's ``dapo``; grpo may take the per-response ``grpo`` or
``dr_grpo`` aggregation, ``loss_type``): each device weights its
local mean by its share of the real tokens, so the ``lax.pmean`` of the
gradients is the gradient of the global mean whatever the device count.

All three algorithms clip the ratio per token. TRL's RLOOTrainer clips the
sequence's ratio exp(Σ new − Σ old) and averages over sequences instead;
OpenRLHF's PolicyLoss, like this one, clips per token. Per token keeps one
surrogate for ppo, grpo and rloo; it clips less than per sequence does as the
per-token ratios drift (a sequence's log-ratio is their sum), so rloo here is
less constrained than TRL's RLOO across the epochs of one update.

Every epoch draws new minibatches: each block of M consecutive rows of the global
batch sends one row to each of the M minibatches, in an order drawn from a key
shared by all devices and the block's global index (``shuffled_minibatches``).
This makes the global minibatches independent of how the batch is laid out over
devices: 8 devices compute the same update as 1 on the same global batch.

What runs, and what does not (``benchmarks/bench_ppo_update.py`` measures it): every
epoch's minibatches are drawn up front (one pmean weighs their tokens); a step's only
collective is the all-reduce of its loss and gradients, and the metrics are averaged over
devices once, after the last step; the entropy shares the log-probs' logsumexp and is
differentiated only when it is in the loss; a non-finite step branches around the
optimizer; and the batch is cut to the columns its rows use (``scoring.trim_padding``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax import lax

from components.core.model import lora, scoring
from components.core.training import fsdp, parallel
from components.core.training.optim import make_optimizer
from components.core.training.parallel import TrainState
from components.ppo import losses
from components.ppo.config import PPOConfig
from components.ppo.rollout import AXIS, Frozen, Models

PyTree = Any
BATCH_FIELDS = (
    "prompt_tokens",
    "prompt_mask",
    "response_tokens",
    "response_mask",
    "logprobs",
    "advantages",
)


def update_fields(config: PPOConfig) -> tuple[str, ...]:
    """The rollout batch's fields the update reads: the critic's targets (ppo), or the
    reference's log-probs for the loss's KL term (grpo)."""
    if config.algorithm == "ppo":
        return (*BATCH_FIELDS, "values", "returns")
    return (*BATCH_FIELDS, "ref_logprobs") if config.algorithm == "grpo" else BATCH_FIELDS


@flax.struct.dataclass
class PPOState:
    """What the update changes: the policy's and the critic's parameters and optimizer states
    (``critic`` None for grpo and rloo, which have none)."""

    policy: TrainState
    critic: TrainState | None

    @classmethod
    def create(
        cls, policy_params: PyTree, critic_params: PyTree | None, config: PPOConfig
    ) -> PPOState:
        """Fresh optimizer states for both networks (the policy's only without a critic)."""
        policy_opt, critic_opt = optimizers(config)
        critic = None if critic_params is None else TrainState.create(critic_params, critic_opt)
        return cls(policy=TrainState.create(policy_params, policy_opt), critic=critic)


def optimizers(config: PPOConfig) -> tuple[optax.GradientTransformation, ...]:
    """AdamW (clipped, warmed up) of the policy and of the critic."""
    return make_optimizer(config.policy_optim()), make_optimizer(config.critic_optim())


def _value_loss(
    critic_params: PyTree | None, minibatch: dict, models: Models, config: PPOConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The critic's clipped value loss and metrics; nothing without a critic."""
    if critic_params is None:
        return jnp.zeros((), jnp.float32), {}
    values = scoring.response_values(models.critic, critic_params, minibatch)
    return losses.value_loss(
        values, minibatch["values"], minibatch["returns"], minibatch["response_mask"],
        config.value_clip_eps,
    )  # fmt: skip


def _policy_terms(
    policy_params: PyTree, minibatch: dict, models: Models, config: PPOConfig
) -> tuple[jax.Array, jax.Array]:
    """Log-probs [b, N] of the response tokens, and the policy's mean entropy over real tokens.

    One logsumexp serves both, in each tile of logits. The entropy is differentiated only
    when it is in the loss (``entropy_coef`` > 0); otherwise it is a logged figure and its
    backward pass is dropped.
    """
    # Tempered as the sampler drew them (TRL divides the logits by T here too); a tile of
    # logits at a time (vocab_tiles), recomputed in the backward pass.
    stats = scoring.response_stats(
        models.policy, policy_params, minibatch, config.temperature, entropy=True
    )
    logprobs, token_entropy = stats.logprobs, stats.entropy
    if config.entropy_coef == 0:
        token_entropy = lax.stop_gradient(token_entropy)
    return logprobs, losses.masked_mean(token_entropy, minibatch["response_mask"])


def _ppo_loss(
    params: tuple[PyTree, PyTree | None],
    minibatch: dict,
    kl_coef: jax.Array,
    models: Models,
    config: PPOConfig,
) -> tuple[jax.Array, tuple[dict[str, jax.Array], jax.Array]]:
    """This device's share of the global minibatch loss, its metrics (same weighting, not yet
    averaged over devices), and the largest |log-prob now − log-prob at rollout| on its real
    tokens."""
    policy_params, critic_params = params
    mask = minibatch["response_mask"]
    logprobs, entropy = _policy_terms(policy_params, minibatch, models, config)
    pg_loss, pg_metrics = losses.policy_loss(
        logprobs, minibatch["logprobs"], minibatch["advantages"], mask, config.clip_eps,
        loss_type=config.loss_type, max_len=config.max_new_tokens,
    )  # fmt: skip
    vf_loss, vf_metrics = _value_loss(critic_params, minibatch, models, config)
    loss = pg_loss + config.vf_coef * vf_loss
    metrics = {**pg_metrics, **vf_metrics, "policy/entropy": entropy}
    if config.algorithm == "grpo":
        # GRPO's KL in the loss: k3 of the current policy to the reference, per token,
        # aggregated as the surrogate is (TRL's GRPOTrainer adds them per token first; the
        # aggregations are linear, so the loss is the same).
        kl_terms = losses.kl_penalty(logprobs, minibatch["ref_logprobs"], mask, "k3")
        kl = losses.aggregate(kl_terms, mask, config.loss_type, config.max_new_tokens)
        loss = loss + kl_coef * kl
        metrics["kl"] = losses.masked_mean(kl_terms, mask)  # TRL GRPO's name: per token
    mismatch = jnp.max(jnp.where(mask != 0, jnp.abs(logprobs - minibatch["logprobs"]), 0.0))
    # Local token mean × (local tokens / mean tokens per device): pmean gives the global mean.
    # A per-response loss_type needs no weight: every device holds as many responses. The
    # entropy is a token mean whatever the loss_type: weighted by tokens, the pmean is
    # Σ entropy / Σ tokens over the devices, not the mean of the devices' means.
    weight = minibatch["weight"]
    metrics["loss/total"] = loss - config.entropy_coef * entropy
    weighted = {name: value * weight for name, value in metrics.items()}
    loss_weight = weight if config.loss_type == "dapo" else 1.0
    loss = loss * loss_weight - config.entropy_coef * entropy * weight
    return loss, (weighted, lax.stop_gradient(mismatch))


def _token_weights(minibatches: dict) -> jax.Array:
    """[E, M] local real tokens / mean real tokens per device of every epoch's minibatches
    (one pmean for the whole update)."""
    counts = jnp.sum((minibatches["response_mask"] != 0).astype(jnp.float32), axis=(2, 3))
    return counts / jnp.maximum(lax.pmean(counts, AXIS), 1.0)


class StepFigures(NamedTuple):
    """What one minibatch step reports: this device's weighted loss figures (averaged over
    devices once, after the last step), figures already global, and its log-prob mismatch."""

    local: dict[str, jax.Array]
    shared: dict[str, jax.Array]
    mismatch: jax.Array


def minibatch_step(
    state: PPOState,
    minibatch: dict,
    lr_scale: jax.Array,
    kl_coef: jax.Array,
    models: Models,
    config: PPOConfig,
    frozen: Frozen | None = None,
) -> tuple[PPOState, StepFigures]:
    """One optimizer step of both networks; skipped (state kept) when anything is non-finite.

    One collective: the all-reduce of the loss and the gradients. The metrics need no
    device agreement here, so they are averaged over devices once per update.
    """

    def loss_fn(params: tuple[PyTree, PyTree | None], *args: Any):
        policy, critic = params
        if frozen is not None:  # LoRA: the loss reads the bases, the gradient skips them
            policy = lora.join(policy, frozen.policy)
            critic = None if critic is None else lora.join(critic, frozen.shared)
        return _ppo_loss((policy, critic), *args)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    critic_params = None if state.critic is None else state.critic.params
    params = (state.policy.params, critic_params)
    (loss, (metrics, mismatch)), grads = grad_fn(params, minibatch, kl_coef, models, config)
    # One all-reduce of everything replicated; sharded gradients come back summed.
    loss, grads = fsdp.mean_over_devices((loss, grads), AXIS)
    policy_norm, critic_norm = fsdp.global_norm(grads[0]), fsdp.global_norm(grads[1])
    # Decided after pmean: every device takes the same branch.
    finite = jnp.isfinite(loss) & jnp.isfinite(policy_norm) & jnp.isfinite(critic_norm)
    # Skipped by adamw_step's selects of new and old, not by a lax.cond around it: a cond with
    # the clipping's all-reduce inside hung the two-process (gloo) fsdp run resumed in
    # tests/test_ppo_multihost.py (beb1b8c). AdamW's update is linear in the learning rate:
    # lr_scale (the guard's reductions) scales it.
    policy = parallel.apply_adamw(
        state.policy, config.policy_optim(), grads[0], finite,
        lr_scale=lr_scale, grad_norm=policy_norm,
    )  # fmt: skip
    critic = state.critic
    if critic is not None:
        critic = parallel.apply_adamw(
            critic, config.critic_optim(), grads[1], finite,
            lr_scale=lr_scale, grad_norm=critic_norm,
        )  # fmt: skip
    state = PPOState(policy=policy, critic=critic)
    shared = {"policy/grad_norm": policy_norm, "skipped": 1.0 - finite.astype(jnp.float32)}
    if state.critic is not None:
        shared["val/grad_norm"] = critic_norm
    return state, StepFigures(metrics, shared, mismatch)


def _summary(figures: StepFigures) -> dict[str, jax.Array]:
    """The update's metrics from every step's [E, M] figures: means over the steps (the loss
    figures averaged over devices in one all-reduce), skipped steps counted, and the log-prob
    mismatch of the first step, before any parameter moved."""
    names = sorted(figures.local)
    step_means = jnp.stack([jnp.mean(figures.local[name]) for name in names])
    summary = dict(zip(names, lax.pmean(step_means, AXIS), strict=True))
    summary.update({name: jnp.mean(value) for name, value in figures.shared.items()})
    summary["skipped"] = jnp.sum(figures.shared["skipped"])
    summary["policy/logprob_mismatch"] = lax.pmax(figures.mismatch[0, 0], AXIS)
    return summary


def _with_rotary(minibatches: dict, state: PPOState, frozen: Frozen | None, models: Models):
    """Every minibatch's rotary tables for the policy and the critic, computed here, before
    the loop over the steps (``scoring.with_rotary``): in the loop XLA:CPU would evaluate
    sin and cos for every element of every layer's q and k, every step, and their
    backward too. Same values as computed in the passes, so the same update."""
    policy = state.policy.params
    policy = policy if frozen is None else lora.join(policy, frozen.policy)
    minibatches = scoring.with_rotary(models.policy, policy, minibatches)
    if state.critic is not None:
        critic = state.critic.params
        critic = critic if frozen is None else lora.join(critic, frozen.shared)
        minibatches = scoring.with_rotary(models.critic, critic, minibatches)
    return minibatches


def shuffled_minibatches(batch: dict, key: jax.Array, count: int) -> dict:
    """[b, ...] → [count, b / count, ...]: each block of ``count`` consecutive rows gives one
    row to every minibatch, in an order drawn from ``key`` and the block's GLOBAL index.

    TRL reshuffles the whole batch every epoch. Shuffling inside blocks of ``count`` rows
    also draws new minibatches every epoch (the rollout rows are already a random draw of
    prompts), and keeps them independent of the layout: block *k* of the global batch is
    the same rows with the same draw on 1 device or 8, so both compute the same update.
    """
    rows = next(iter(batch.values())).shape[0]
    blocks = rows // count
    first = lax.axis_index(AXIS) * blocks
    block_keys = jax.vmap(lambda block: jax.random.fold_in(key, block))(first + jnp.arange(blocks))
    order = jax.vmap(lambda k: jax.random.permutation(k, count))(block_keys)  # [blocks, count]
    index = (jnp.arange(blocks)[:, None] * count + order).T  # [count, blocks]: rows of each
    return {name: value[index] for name, value in batch.items()}


def update_step(
    state: PPOState,
    batch: dict,
    rng: jax.Array,
    lr_scale: jax.Array,
    kl_coef: jax.Array,
    frozen: Frozen | None = None,
    *,
    models: Models,
    config: PPOConfig,
) -> tuple[PPOState, dict[str, jax.Array]]:
    """All epochs and minibatches of one iteration; metrics averaged over the steps.

    ``policy/logprob_mismatch`` is that of the first step, before any parameter moved:
    rollout and update score with one function, so it is ~0 unless they disagree.
    """
    fields = {k: batch[k] for k in update_fields(config)}
    # Same keys on every device: the global minibatches are layout-free. Every epoch's are
    # drawn up front, so one pmean weighs all their tokens.
    keys = jax.random.split(rng, config.ppo_epochs)
    minibatches = jax.vmap(lambda key: shuffled_minibatches(fields, key, config.minibatches))(keys)
    minibatches["weight"] = _token_weights(minibatches)
    minibatches = _with_rotary(minibatches, state, frozen, models)

    def one_step(carry: PPOState, minibatch: dict):
        return minibatch_step(carry, minibatch, lr_scale, kl_coef, models, config, frozen)

    def epoch(carry: PPOState, epoch_minibatches: dict):
        return lax.scan(one_step, carry, epoch_minibatches)

    state, figures = lax.scan(epoch, state, minibatches)
    return state, _summary(figures)


class Update:
    """The pmapped update, run on the batch cut to the columns its rows use.

    Cutting (``scoring.trim_padding``) changes no result; it spares the passes over padding
    when every response of a batch stops early. Each width met compiles once.
    ``lower`` lowers the full-width program, the largest a run may compile.
    """

    def __init__(self, program: Callable[..., tuple[PPOState, dict]], config: PPOConfig) -> None:
        self.program = program
        self.fields = update_fields(config)

    def _fields(self, batch: dict, trim: bool) -> dict:
        fields = {name: batch[name] for name in self.fields}
        responses = [name for name in self.fields if not name.startswith("prompt_")]
        return scoring.trim_padding(fields, responses) if trim else fields

    def __call__(self, state: PPOState, batch: dict, *args: Any) -> tuple[PPOState, dict]:
        return self.program(state, self._fields(batch, trim=True), *_with_frozen(args))

    def lower(self, state: PPOState, batch: dict, *args: Any) -> Any:
        return self.program.lower(state, self._fields(batch, trim=False), *_with_frozen(args))


def _with_frozen(args: tuple) -> tuple:
    """(rng, lr_scale, kl_coef[, frozen]) with frozen None when not given (no LoRA)."""
    return args if len(args) == 4 else (*args, None)


def make_update(
    models: Models, config: PPOConfig, devices: Sequence[jax.Device] | None = None
) -> Update:
    """``update(state, batch, rng, lr_scale, kl_coef[, frozen]) -> (state, metrics)`` pmapped;
    donates ``state``. ``kl_coef`` weighs grpo's KL term in the loss (ppo and rloo ignore it);
    ``frozen`` holds a LoRA run's bases (placed, not donated)."""

    def step(state: PPOState, batch: dict, rng: jax.Array, lr_scale: jax.Array, kl_coef, frozen):
        return update_step(
            state, batch, rng, lr_scale, kl_coef, frozen, models=models, config=config
        )

    program = jax.pmap(
        step,
        axis_name=AXIS,
        in_axes=(0, 0, None, None, None, 0),
        donate_argnums=0,
        devices=None if devices is None else list(devices),
    )
    return Update(program, config)


def make_ema_update(decay: float) -> Callable[[PyTree, PyTree], PyTree]:
    """``reference ← decay · reference + (1 − decay) · policy``, pmapped (EMA reference)."""

    def step(reference: PyTree, policy: PyTree) -> PyTree:
        return jax.tree.map(lambda r, p: decay * r + (1.0 - decay) * p, reference, policy)

    return jax.pmap(step, axis_name=AXIS, donate_argnums=0)
