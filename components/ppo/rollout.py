"""The rollout phase: sample responses, score them, and turn scores into advantages.

One pmapped function per iteration: the KV-cache sampler draws a response per
row (grpo/rloo: ``group_size`` rows per prompt, side by side on one device); the
policy, the reference, the critic (ppo only) and the reward model each run one
forward pass over prompt + response; scores are normalized with the reward
model's ``reward_stats.json``, clipped and penalized when EOS is missing; the
per-token KL penalty is added, weighed by the coefficient the KL controller sets
from this very rollout's KL; GAE gives advantages, whitened with statistics
global over every device (``axis_name``). Metrics come back averaged over all
devices, named as TRL names them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from components.core.model import lora, scoring
from components.core.model.sampler import generate, is_stop
from components.core.rewards.scoring import weighted_total
from components.core.training import fsdp
from components.ppo import losses
from components.ppo.config import PPOConfig
from components.ppo.kl_control import KLControllerState, update_kl_controller
from components.ppo.monitors import Monitors, member_scores, monitor

PyTree = Any
AXIS = "data"


class Models(NamedTuple):
    """The graph definitions (static structure) of the three networks."""

    policy: nnx.GraphDef
    critic: nnx.GraphDef
    reward: nnx.GraphDef | None  # None: reward functions alone score the rollouts


class Frozen(NamedTuple):
    """The frozen bases of a LoRA run, one copy each (lora.py): the policy's, which the
    reference shares (the reference is the policy's base with its own, zero or EMA,
    adapters), and the reward model's, which the critic shares."""

    policy: PyTree
    shared: PyTree


class RolloutParams(NamedTuple):
    """Parameters one rollout reads (each with a leading device axis under pmap).

    With ``frozen`` (LoRA) the four hold only what is not frozen: the adapters (and the
    critic's head) of policy, reference and critic, and the reward model's head.
    """

    policy: PyTree
    reference: PyTree
    critic: PyTree
    reward: PyTree
    frozen: Frozen | None = None
    # The reward artifact's other models, whole and stacked (monitors.py); None = none.
    monitors: PyTree = None

    def joined(self) -> RolloutParams:
        """Every network's whole parameters (no-op without frozen bases)."""
        if self.frozen is None:
            return self
        policy, shared = self.frozen
        return RolloutParams(
            policy=lora.join(self.policy, policy),
            reference=lora.join(self.reference, policy),
            critic=None if self.critic is None else lora.join(self.critic, shared),
            reward=None if self.reward is None else lora.join(self.reward, shared),
            monitors=self.monitors,
        )


class TokenIds(NamedTuple):
    """Special token ids of the tokenizer, and its vocabulary size (0 = the embedding's)."""

    eos_id: int | tuple[int, ...]  # the tokenizer's stop ids (eos and end-of-turn)
    pad_id: int
    vocab_size: int = 0


class ScoreNorm(NamedTuple):
    """How raw reward-model scores become the scalar reward of a response."""

    mean: float
    std: float
    missing_eos_penalty: float
    clip: float  # 0 = none
    # score_norm quantile: the starting policy's sample scores, ascending; () = (raw − mean) / std.
    quantiles: tuple[float, ...] = ()


def quantile_scores(raw: jax.Array, quantiles: tuple[float, ...]) -> jax.Array:
    """√12 · (F(raw) − ½), F the share of ``quantiles`` below raw (ties half): F's mean over
    a sample of the starting policy is the chance of beating one of its responses, ½, and
    √12 gives it unit variance there, the scale ``kl_coef`` and ``reward_clip`` expect."""
    table = jnp.asarray(quantiles, jnp.float32)
    below = jnp.searchsorted(table, raw, side="left") + jnp.searchsorted(table, raw, side="right")
    share = below.astype(jnp.float32) / (2.0 * table.size)
    return jnp.sqrt(12.0) * (share - 0.5)


def normalize_scores(raw: jax.Array, has_eos: jax.Array, norm: ScoreNorm) -> jax.Array:
    """(raw − mean) / std, or the calibrated ``quantile_scores`` when ``norm.quantiles`` are
    given, clipped to [−clip, clip], minus the penalty where EOS is missing.

    The penalty comes after the clip: subtracted before it, a truncated response whose score
    lies past clip + penalty would be clipped back to a finished one's score.
    """
    if norm.quantiles:
        scores = quantile_scores(raw, norm.quantiles)
    else:
        scores = (raw - norm.mean) / max(norm.std, 1e-6)
    if norm.clip > 0:
        scores = jnp.clip(scores, -norm.clip, norm.clip)
    return scores - norm.missing_eos_penalty * (~has_eos).astype(jnp.float32)


def _sample(
    models: Models, params: RolloutParams, prompts: dict, rng: jax.Array, config: PPOConfig, ids
) -> dict[str, jax.Array]:
    """Prompts plus one sampled response each (tokens and mask)."""
    sample = generate(
        (models.policy, params.policy),
        prompts["prompt_tokens"],
        prompts["prompt_mask"],
        rng,
        max_new_tokens=config.max_new_tokens,
        eos_id=ids.eos_id,
        pad_id=ids.pad_id,
        temperature=config.temperature,
        vocab_size=ids.vocab_size,
    )
    return {
        "prompt_tokens": prompts["prompt_tokens"].astype(jnp.int32),
        "prompt_mask": prompts["prompt_mask"].astype(jnp.int32),
        "response_tokens": sample.tokens,
        "response_mask": sample.mask,
    }


def _advantages(
    rewards: jax.Array, values: jax.Array, mask: jax.Array, config: PPOConfig
) -> tuple[jax.Array, jax.Array]:
    """Whitened GAE advantages and returns (statistics global over the devices)."""
    if config.whiten_rewards:
        rewards = losses.masked_whiten(rewards, mask, shift_mean=False, axis_name=AXIS)
    advantages, returns = losses.gae(rewards, values, mask, config.gamma, config.lam)
    return losses.masked_whiten(advantages, mask, axis_name=AXIS), returns


def _metrics(batch: dict, kl: jax.Array, logprobs: jax.Array, extra: dict) -> dict[str, jax.Array]:
    """TRL-named rollout metrics, averaged over every device.

    ``objective/kl`` is the penalty's estimator summed per response, as TRL logs it, and so
    is ``objective/entropy`` (the sampled tokens' −log p; ``objective/entropy_per_token``
    averages it over the real tokens, a monitor that a length drift cannot hide a collapse
    in);
    ``objective/kl_per_token``, which the KL controller steers and the guard watches, is the
    exact KL of each position's next-token distributions per real token: >= 0, so noise
    cannot hide a divergence behind a sign, and free of the sampled token's noise (a
    response's spread 0.04 nats on the demo, k3's 0.11).
    """
    mask = batch["response_mask"]
    real = mask != 0
    metrics = {
        "objective/kl": jnp.mean(jnp.sum(kl, axis=1)),
        "objective/kl_per_token": extra["exact_kl"],
        "objective/entropy": jnp.mean(jnp.sum(jnp.where(real, -logprobs, 0.0), axis=1)),
        # Per real token: the drift monitor, which a longer response does not raise.
        "objective/entropy_per_token": losses.masked_mean(-logprobs, mask, axis_name=AXIS),
        "objective/non_score_reward": jnp.mean(extra["non_score"]),
        "objective/rlhf_reward": jnp.mean(extra["scores"] + extra["non_score"]),
        "objective/scores": jnp.mean(extra["scores"]),
        "objective/raw_scores": jnp.mean(extra["raw_scores"]),
        "response_length": jnp.mean(jnp.sum(mask, axis=1).astype(jnp.float32)),
        "eos_fraction": jnp.mean(extra["has_eos"].astype(jnp.float32)),
    }
    if "values" in extra:
        metrics["val/mean"] = losses.masked_mean(extra["values"], mask, axis_name=AXIS)
    if "group_std" in extra:
        metrics["reward_std"] = jnp.mean(extra["group_std"])  # TRL GRPO's name
    # Every device holds the same number of sequences: pmean of means is the global mean.
    return {name: lax.pmean(value, AXIS) for name, value in metrics.items()}


def _group_advantages(
    scores: jax.Array, kl: jax.Array, mask: jax.Array, kl_coef: jax.Array, config: PPOConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """grpo/rloo: per-token advantages [B, N], the KL part of the reward [B], group stds [G].

    RLOO puts the KL in the sequence's reward (−kl_coef · Σ kl, as TRL's RLOOTrainer); GRPO
    keeps it out of the reward and adds k3 · kl_coef to the loss instead (update.py).
    """
    non_score = -kl_coef * jnp.sum(kl, axis=1)
    if config.algorithm == "grpo":
        non_score = jnp.zeros_like(non_score)
    sequence = losses.group_advantages(
        scores + non_score, config.group_size, config.algorithm, config.reward_scaling, AXIS
    )
    group_std = jnp.std(scores.reshape(-1, config.group_size), axis=1, ddof=1)
    advantages = jnp.where(mask != 0, sequence[:, None], 0.0)
    return advantages, non_score, group_std


def _score(
    models: Models, params: RolloutParams, batch: dict, config: PPOConfig, after: jax.Array
) -> tuple[jax.Array | None, jax.Array]:
    """Critic values (None without a critic) and raw reward-model scores (zeros without a
    reward model: reward functions alone), one net at a time."""
    values = None
    if not config.uses_groups:
        values = scoring.response_values(models.critic, fsdp.after(params.critic, after), batch)
        after = values
    if models.reward is None:
        return values, jnp.zeros(batch["response_tokens"].shape[0], jnp.float32)
    return values, scoring.sequence_scores(models.reward, fsdp.after(params.reward, after), batch)


def sample_step(
    models: Models,
    params: RolloutParams,
    prompts: dict[str, jax.Array],
    rng: jax.Array,
    controller: KLControllerState,
    *,
    config: PPOConfig,
    ids: TokenIds,
    monitors: Monitors | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array], KLControllerState]:
    """The device half of a rollout before any host scoring: one device's sampled batch, what
    the networks say of it (log-probs of policy and reference, KL, values, reward-model
    scores; with ``monitors``, the other reward models' figures and the scores to train on:
    monitors.py) and the KL controller after it observed this rollout's KL.

    The coefficient the controller sets from this rollout's KL weighs this rollout's penalty.
    TRL and OpenRLHF weigh it with the coefficient of the rollout before and update the
    controller after the step: a delay of one iteration in the loop, which on the demo kept
    the KL swinging ±40% around its target with a period of about 10 iterations.
    """
    rng = jax.random.fold_in(rng, lax.axis_index(AXIS))
    params = params.joined()
    batch = _sample(models, params, prompts, rng, config, ids)
    mask = batch["response_mask"]
    # One network's pass at a time: under fsdp each pass gathers its network only once the
    # previous pass is done (the two output heads are then whole together in the tiles).
    policy = fsdp.after(params.policy, batch["response_tokens"])
    # Both networks' log-probs and the KL of their whole next-token distributions (the
    # controller's and the guard's measure), a tile of logits at a time (vocab_tiles).
    stats = scoring.response_stats(
        models.policy, policy, batch, config.temperature, reference=params.reference
    )
    exact_kl = losses.masked_mean(stats.kl, mask, axis_name=AXIS)
    controller = update_kl_controller(controller, exact_kl, config.rollout_batch_size)
    values, raw_scores = _score(models, params, batch, config, stats.ref_logprobs)
    has_eos = jnp.any(is_stop(batch["response_tokens"], ids.eos_id) & (mask != 0), axis=1)
    figures = {}
    if monitors is not None:
        members = member_scores(models.reward, params.monitors, batch)
        raw_scores, figures = monitor(raw_scores, members, monitors)
    extra = dict(
        logprobs=stats.logprobs, ref_logprobs=stats.ref_logprobs, raw_scores=raw_scores,
        has_eos=has_eos, exact_kl=exact_kl, monitors=figures,
    )  # fmt: skip
    if values is not None:
        extra["values"] = values
    return batch, extra, controller


def combine_scores(
    raw_scores: jax.Array,
    has_eos: jax.Array,
    norm: ScoreNorm,
    functions: jax.Array | None,
    *,
    reward_model: bool,
) -> tuple[jax.Array, jax.Array]:
    """Each response's score [B] and whether anything judged it [B].

    The reward model's normalized score (``normalize_scores``; without a reward model, only
    the missing-EOS penalty) plus the reward functions' weighted total (``functions``, NaN
    where no function judged a response), used as the functions return it, as TRL does.
    A response no function judged and no reward model scored is unscorable.
    """
    if reward_model:
        scores = normalize_scores(raw_scores, has_eos, norm)
    else:
        scores = -norm.missing_eos_penalty * (~has_eos).astype(jnp.float32)
    if functions is None:
        return scores, jnp.ones_like(has_eos)
    judged = ~jnp.isnan(functions)
    scores = scores + jnp.where(judged, functions, 0.0)
    return scores, judged | reward_model


def _fill_unscorable(scores: jax.Array, scorable: jax.Array, group_size: int) -> jax.Array:
    """Each unscorable score replaced by its group's mean over the scorable ones (0 when
    none is): the baseline is then TRL's (``nanmean``); the std counts it at zero distance
    (docs/algorithms.md says why, and how that differs from TRL's ``nanstd``)."""
    grouped = scores.reshape(-1, group_size)
    ok = scorable.reshape(-1, group_size)
    count = jnp.maximum(jnp.sum(ok, axis=1, keepdims=True), 1)
    mean = jnp.sum(jnp.where(ok, grouped, 0.0), axis=1, keepdims=True) / count
    return jnp.where(ok, grouped, mean).reshape(-1)


def function_stats(per_function: jax.Array, total: jax.Array) -> dict[str, jax.Array]:
    """The reward functions' figures over every device's responses: each function's mean
    and std [F] over the responses it judged (TRL's ``rewards/<name>/mean`` and ``/std``,
    Bessel-corrected), the weighted total's mean over the judged responses and the share
    none judged."""
    judged = ~jnp.isnan(per_function)
    count = lax.psum(jnp.sum(judged, axis=0), AXIS).astype(jnp.float32)
    total_sum = lax.psum(jnp.sum(jnp.where(judged, per_function, 0.0), axis=0), AXIS)
    squares = lax.psum(jnp.sum(jnp.where(judged, per_function**2, 0.0), axis=0), AXIS)
    mean = total_sum / jnp.maximum(count, 1.0)
    variance = (squares - count * mean**2) / jnp.maximum(count - 1.0, 1.0)
    scored = ~jnp.isnan(total)
    scored_count = lax.psum(jnp.sum(scored), AXIS).astype(jnp.float32)
    responses = lax.psum(total.shape[0], AXIS)
    return {
        "means": jnp.where(count > 0, mean, jnp.nan),
        "stds": jnp.where(count > 1, jnp.sqrt(jnp.maximum(variance, 0.0)), 0.0),
        "reward": lax.psum(jnp.sum(jnp.where(scored, total, 0.0)), AXIS) / scored_count,
        "unscorable_fraction": 1.0 - scored_count / responses,
    }


def finish_step(
    batch: dict[str, jax.Array],
    extra: dict[str, jax.Array],
    per_function: jax.Array | None,
    controller: KLControllerState,
    *,
    config: PPOConfig,
    norm: ScoreNorm,
    reward_model: bool = True,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """The rest of a rollout: scores (``combine_scores`` of the reward functions' weighted
    total of ``per_function`` [B, F], the host's rewards, or None), the KL penalty weighed
    by the controller's coefficient, advantages (GAE, or the groups'; zero for an
    unscorable response: no learning signal, TRL's convention) and the global metrics (with
    reward functions, ``functions``: :func:`function_stats`)."""
    mask = batch["response_mask"]
    real = mask != 0
    logprobs, ref_logprobs = extra["logprobs"], extra["ref_logprobs"]
    functions = None
    if per_function is not None:
        functions = weighted_total(per_function, config.reward_function_weights, xp=jnp)
    scores, scorable = combine_scores(
        extra["raw_scores"], extra["has_eos"], norm, functions, reward_model=reward_model
    )
    kl = losses.kl_penalty(logprobs, ref_logprobs, mask, config.kl_estimator)
    kl_coef = controller.kl_coef
    out = dict(scores=scores, raw_scores=extra["raw_scores"], has_eos=extra["has_eos"],
               exact_kl=extra["exact_kl"])  # fmt: skip
    if config.uses_groups:
        filled = _fill_unscorable(scores, scorable, config.group_size)
        advantages, out["non_score"], out["group_std"] = _group_advantages(
            filled, kl, mask, kl_coef, config
        )
        batch.update(ref_logprobs=jnp.where(real, ref_logprobs, 0.0))
    else:
        values = extra["values"]
        rewards, out["non_score"] = losses.token_rewards(scores, kl, mask, kl_coef)
        advantages, returns = _advantages(rewards, values, mask, config)
        out["values"] = values
        batch.update(values=jnp.where(real, values, 0.0), returns=returns)
    advantages = jnp.where(scorable[:, None], advantages, 0.0)
    metrics = {**_metrics(batch, kl, logprobs, out), **extra["monitors"]}
    if per_function is not None:
        metrics["functions"] = function_stats(per_function, functions)
    batch.update(logprobs=jnp.where(real, logprobs, 0.0), advantages=advantages)
    return batch, metrics


def rollout_step(
    models: Models,
    params: RolloutParams,
    prompts: dict[str, jax.Array],
    rng: jax.Array,
    controller: KLControllerState,
    *,
    config: PPOConfig,
    ids: TokenIds,
    norm: ScoreNorm,
    monitors: Monitors | None = None,
) -> tuple[dict[str, jax.Array], dict[str, jax.Array], KLControllerState]:
    """One device's rollout batch for the update, the global rollout metrics, and the KL
    controller after it observed this rollout's KL, scored by the reward model alone
    (:func:`sample_step`, then :func:`finish_step`, in one program)."""
    batch, extra, controller = sample_step(
        models, params, prompts, rng, controller, config=config, ids=ids, monitors=monitors
    )
    batch, metrics = finish_step(batch, extra, None, controller, config=config, norm=norm)
    return batch, metrics, controller


def make_rollout(
    models: Models,
    config: PPOConfig,
    ids: TokenIds,
    norm: ScoreNorm,
    monitors: Monitors | None = None,
) -> Callable[..., tuple[dict, dict, KLControllerState]]:
    """``rollout(params, prompts, rng, controller) -> (batch, metrics, controller)`` pmapped
    over devices (:func:`rollout_step`).

    ``params`` and ``prompts`` carry a leading device axis; ``rng`` and ``controller``
    are shared (each device folds its index into the key); the metrics and the controller
    come back replicated.
    """

    def step(params: RolloutParams, prompts: dict, rng: jax.Array, controller):
        return rollout_step(
            models, params, prompts, rng, controller, config=config, ids=ids, norm=norm,
            monitors=monitors,
        )  # fmt: skip

    return jax.pmap(step, axis_name=AXIS, in_axes=(0, 0, None, None))


class RolloutPhases(NamedTuple):
    """A rollout in two pmapped programs, for reward functions scored on the host between
    them: ``sample(params, prompts, rng, controller) -> (batch, extra, controller)`` and
    ``finish(batch, extra, per_function, controller) -> (batch, metrics)``."""

    sample: Callable[..., tuple[dict, dict, KLControllerState]]
    finish: Callable[..., tuple[dict, dict]]


def make_rollout_phases(
    models: Models,
    config: PPOConfig,
    ids: TokenIds,
    norm: ScoreNorm,
    monitors: Monitors | None = None,
) -> RolloutPhases:
    """:class:`RolloutPhases` of this configuration (no reward model when ``models.reward``
    is None). ``per_function`` [devices, rows, F] carries a leading device axis like the
    batch."""

    def sample(params: RolloutParams, prompts: dict, rng: jax.Array, controller):
        return sample_step(
            models, params, prompts, rng, controller, config=config, ids=ids, monitors=monitors
        )

    def finish(batch: dict, extra: dict, per_function: jax.Array, controller):
        return finish_step(
            batch, extra, per_function, controller, config=config, norm=norm,
            reward_model=models.reward is not None,
        )  # fmt: skip

    return RolloutPhases(
        jax.pmap(sample, axis_name=AXIS, in_axes=(0, 0, None, None)),
        jax.pmap(finish, axis_name=AXIS, in_axes=(0, 0, 0, None)),
    )
