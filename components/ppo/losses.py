"""Pure PPO math on per-token [B, T] arrays with a response mask, as TRL's PPOTrainer computes it
but for where the score goes: on the last real token (EOS), with the value after it 0, as
OpenRLHF does. TRL adds it one position later, on the first pad, and bootstraps and trains a
value there; with a critic started from the reward model that value is close to the score,
so the advantages differ little.

Conventions shared by every function here:

- ``mask`` is [B, T], 1 (or True) on real response tokens and 0 on padding after EOS; any
  dtype is accepted.
- Means are per-token: the sum over every real token of the batch divided by the number of
  real tokens, not a mean of per-sequence means (TRL's ``masked_mean``).
- Values at masked positions are never read: they are replaced with ``jnp.where`` (not a
  multiply), so padding that holds garbage, even ``inf`` or ``nan``, cannot leak.
- Statistics take ``axis_name``: given inside ``jax.pmap(..., axis_name=...)`` they are
  global over the devices (``lax.psum`` of sums and counts); without it they are local.
- Losses are computed in float32 whatever the input dtype.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

from components.core.model.vocab_tiles import exact_kl, token_entropy  # noqa: F401 (re-exported)

KLEstimator = Literal["k1", "k3"]

# TRL's whitening epsilon: keeps rsqrt finite when every real token has the same value.
_WHITEN_EPS = 1e-8


def _is_real(mask: jax.Array) -> jax.Array:
    """The mask as booleans."""
    return jnp.asarray(mask) != 0


def _zero_padding(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``x`` in float32 with 0 at masked positions."""
    return jnp.where(_is_real(mask), jnp.asarray(x, jnp.float32), 0.0)


def _sum_and_count(
    x: jax.Array, mask: jax.Array, axis_name: str | None
) -> tuple[jax.Array, jax.Array]:
    """Sum of ``x`` over real tokens and their count, psum'd over ``axis_name`` if given."""
    total = jnp.sum(_zero_padding(x, mask))
    count = jnp.sum(_is_real(mask).astype(jnp.float32))
    if axis_name is not None:
        total, count = lax.psum((total, count), axis_name)
    return total, count


def masked_mean(x: jax.Array, mask: jax.Array, axis_name: str | None = None) -> jax.Array:
    """Mean of ``x`` over real tokens (global over ``axis_name`` if given); 0 if there are none."""
    total, count = _sum_and_count(x, mask, axis_name)
    return total / jnp.maximum(count, 1.0)


def masked_var(
    x: jax.Array, mask: jax.Array, unbiased: bool = True, axis_name: str | None = None
) -> jax.Array:
    """Variance of ``x`` over real tokens, Bessel-corrected by default as TRL's ``masked_var``."""
    total, count = _sum_and_count(x, mask, axis_name)
    mean = total / jnp.maximum(count, 1.0)
    # Two passes (mean, then squared deviations) rather than E[x²] − E[x]², which cancels badly.
    squared_total, _ = _sum_and_count(
        jnp.square(jnp.asarray(x, jnp.float32) - mean), mask, axis_name
    )
    variance = squared_total / jnp.maximum(count, 1.0)
    if unbiased:
        # TRL raises for fewer than two tokens; under jit we cannot, so fall back to biased.
        variance = variance * jnp.where(count > 1.0, count / jnp.maximum(count - 1.0, 1.0), 1.0)
    return variance


def masked_whiten(
    x: jax.Array, mask: jax.Array, shift_mean: bool = True, axis_name: str | None = None
) -> jax.Array:
    """``x`` at unit variance (and zero mean if ``shift_mean``) over real tokens; 0 on padding."""
    mean = masked_mean(x, mask, axis_name)
    variance = masked_var(x, mask, unbiased=True, axis_name=axis_name)
    whitened = (jnp.asarray(x, jnp.float32) - mean) * lax.rsqrt(variance + _WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return _zero_padding(whitened, mask)


def kl_penalty(
    logprobs: jax.Array,
    ref_logprobs: jax.Array,
    mask: jax.Array,
    estimator: KLEstimator = "k1",
) -> jax.Array:
    """Per-token estimate of KL(policy ‖ reference) from sampled-token logprobs; 0 on padding."""
    # log r with r = p_ref / p; zeroed first so padding garbage cannot reach exp().
    log_ratio = _zero_padding(jnp.asarray(ref_logprobs, jnp.float32) - logprobs, mask)
    if estimator == "k1":
        kl = -log_ratio
    elif estimator == "k3":
        # (r − 1) − log r ≥ 0; expm1 keeps precision when r is close to 1.
        kl = jnp.expm1(log_ratio) - log_ratio
    else:
        raise ValueError(f"estimator={estimator!r} is not a KL estimator; use 'k1' or 'k3'.")
    return _zero_padding(kl, mask)


def last_token_index(mask: jax.Array) -> jax.Array:
    """Index [B] of the last real token of each row (T − 1 for a row with none)."""
    is_real = _is_real(mask)
    # argmax finds the first True of the reversed row, i.e. the last True of the row.
    return is_real.shape[-1] - 1 - jnp.argmax(is_real[..., ::-1], axis=-1)


def token_rewards(
    score: jax.Array, kl: jax.Array, mask: jax.Array, kl_coef: float | jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Rewards −kl_coef·kl plus ``score`` [B] at the last real token; and −kl_coef·Σkl [B]."""
    non_score = _zero_padding(-kl_coef * jnp.asarray(kl, jnp.float32), mask)
    last = jax.nn.one_hot(last_token_index(mask), non_score.shape[-1], dtype=jnp.float32)
    # A row with no real token gets no score: the one-hot lands on padding and is masked away.
    at_last = _zero_padding(last, mask)
    rewards = non_score + at_last * jnp.asarray(score, jnp.float32)[:, None]
    return rewards, jnp.sum(non_score, axis=-1)


def gae(
    rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[jax.Array, jax.Array]:
    """Generalized advantage estimates and returns = advantages + values, [B, T], 0 on padding."""
    is_real = _is_real(mask)
    rewards = _zero_padding(rewards, mask)
    values = _zero_padding(values, mask)
    # Value after the last real token is 0: the episode ends at EOS, nothing to bootstrap.
    next_values = jnp.concatenate([values[:, 1:], jnp.zeros_like(values[:, :1])], axis=1)
    deltas = rewards + gamma * next_values - values

    def backward_step(next_advantage: jax.Array, step: tuple[jax.Array, jax.Array]):
        """One step back in time: A_t = δ_t + γλ·A_{t+1}, reset to 0 on padding."""
        delta, real = step
        # Resetting on padding stops a masked position from leaking into earlier ones.
        advantage = jnp.where(real, delta + gamma * lam * next_advantage, 0.0)
        return advantage, advantage

    _, advantages_tb = lax.scan(
        backward_step, jnp.zeros_like(deltas[:, 0]), (deltas.T, is_real.T), reverse=True
    )
    advantages = advantages_tb.T
    return advantages, advantages + values


LOSS_TYPES = ("dapo", "grpo", "dr_grpo")


def aggregate(
    per_token: jax.Array, mask: jax.Array, loss_type: str = "dapo", max_len: int = 0
) -> jax.Array:
    """A [b, N] per-token loss as one number, as TRL's GRPOTrainer names the ways:

    - ``dapo``: the mean over every real token of the batch (long responses weigh more);
    - ``grpo``: each response's mean over its tokens, then the mean over responses (the
      GRPO paper's; a token of a short response weighs more);
    - ``dr_grpo``: the sum over real tokens / (responses × ``max_len``), a constant
      normalizer (Dr. GRPO, Liu et al. 2025: neither length bias).

    Over devices holding equal numbers of responses, the pmean of ``grpo`` and ``dr_grpo``
    is the global figure; ``dapo`` needs each device weighted by its share of the tokens.
    """
    real = (mask != 0).astype(jnp.float32)
    total = jnp.sum(jnp.where(real != 0, per_token, 0.0), axis=-1)
    if loss_type == "dapo":
        return jnp.sum(total) / jnp.maximum(jnp.sum(real), 1.0)
    if loss_type == "grpo":
        return jnp.mean(total / jnp.maximum(jnp.sum(real, axis=-1), 1.0))
    if loss_type == "dr_grpo":
        if max_len < 1:
            raise ValueError(f"dr_grpo needs the longest response length, got max_len={max_len}")
        return jnp.sum(total) / (per_token.shape[0] * max_len)
    raise ValueError(f"loss_type={loss_type!r} is not one of {', '.join(LOSS_TYPES)}")


def policy_loss(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    clip_eps: float = 0.2,
    *,
    loss_type: str = "dapo",
    max_len: int = 0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate loss with ``policy/approxkl``, ``policy/clipfrac``.

    The per-token losses are aggregated as ``loss_type`` says (``aggregate``); the default
    is the mean over real tokens.
    """
    log_ratio = _zero_padding(jnp.asarray(logprobs, jnp.float32) - old_logprobs, mask)
    ratio = jnp.exp(log_ratio)
    advantages = _zero_padding(advantages, mask)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    loss = aggregate(jnp.maximum(unclipped, clipped), mask, loss_type, max_len)
    metrics = {
        "loss/policy": loss,
        # TRL's estimator of KL(old ‖ new), averaged over real tokens only.
        "policy/approxkl": 0.5 * masked_mean(jnp.square(log_ratio), mask),
        "policy/clipfrac": masked_mean((clipped > unclipped).astype(jnp.float32), mask),
        "val/ratio": masked_mean(ratio, mask),
    }
    return loss, metrics


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    clip_eps: float = 0.2,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss 0.5·mean(max((v−R)², (clip(v)−R)²)) over real tokens; ``val/clipfrac``."""
    values = _zero_padding(values, mask)
    old_values = _zero_padding(old_values, mask)
    returns = _zero_padding(returns, mask)
    values_clipped = jnp.clip(values, old_values - clip_eps, old_values + clip_eps)
    unclipped = jnp.square(values - returns)
    clipped = jnp.square(values_clipped - returns)
    loss = 0.5 * masked_mean(jnp.maximum(unclipped, clipped), mask)
    metrics = {
        "loss/value": loss,
        "val/clipfrac": masked_mean((clipped > unclipped).astype(jnp.float32), mask),
    }
    return loss, metrics


def entropy_from_logits(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean entropy (nats) of the next-token distributions ``logits`` [B, T, V] over real tokens."""
    return masked_mean(token_entropy(logits), mask)


REWARD_SCALINGS = ("group", "batch", "none")


def group_advantages(
    scores: jax.Array,
    group_size: int,
    kind: str,
    scale: str = "group",
    axis_name: str | None = None,
) -> jax.Array:
    """Per-sequence advantages [B] from groups of ``group_size`` consecutive responses to one
    prompt: GRPO's s − group mean, scaled as ``scale`` says, or RLOO's s − mean of the other
    k − 1.

    GRPO's ``scale`` (TRL's ``scale_rewards``): ``group`` divides by the group's std + 1e-4
    (Bessel-corrected, as TRL's GRPOTrainer computes it), ``batch`` by the std + 1e-4 of
    every score of the batch (global over ``axis_name``'s devices), ``none`` not at all
    (Dr. GRPO). RLOO's leave-one-out baseline is k / (k − 1) · (s − group mean).
    """
    grouped = jnp.asarray(scores, jnp.float32).reshape(-1, group_size)
    centred = grouped - jnp.mean(grouped, axis=1, keepdims=True)
    if kind == "rloo":
        return (centred * (group_size / (group_size - 1))).reshape(-1)
    if kind != "grpo":
        raise ValueError(f"kind={kind!r} is not a group advantage; use 'grpo' or 'rloo'.")
    if scale == "none":
        return centred.reshape(-1)
    if scale == "group":
        std = jnp.std(grouped, axis=1, ddof=1, keepdims=True)
    elif scale == "batch":
        std = _batch_std(grouped, axis_name)
    else:
        raise ValueError(f"scale={scale!r} is not a reward scaling; use one of {REWARD_SCALINGS}")
    return (centred / (std + 1e-4)).reshape(-1)


def _batch_std(scores: jax.Array, axis_name: str | None) -> jax.Array:
    """The Bessel-corrected std of every element of ``scores``, over ``axis_name``'s devices."""
    every = jnp.ones_like(scores)
    mean = masked_mean(scores, every, axis_name)
    squares, count = _sum_and_count(jnp.square(scores - mean), every, axis_name)
    return jnp.sqrt(squares / jnp.maximum(count - 1.0, 1.0))
