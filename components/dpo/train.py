"""DPO's pair loss, its metrics (TRL's names) and the per-device steps that compute them.

A preference batch holds prompt + chosen and prompt + rejected as whole sequences,
one prompt cut shared by both (input_pipeline.py); ``loss_mask`` marks the chosen
response. The prompt is the part of the chosen sequence outside ``loss_mask``, at the
same positions in the rejected sequence, so each response is scored alone:

    logp(y) = Σ_t log π(y_t | x, y_<t)     over the response tokens t only
    h       = (logp_π(y_w) − logp_ref(y_w)) − (logp_π(y_l) − logp_ref(y_l))
    sigmoid: −(1 − ε)·log σ(β·h) − ε·log σ(−β·h)       (ε = label_smoothing)
    ipo:     (h − 1/(2β))²   with logp the per-token MEAN, as TRL computes IPO

averaged over pairs. The implicit rewards β·(logp_π − logp_ref) give TRL's metrics.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.training import fsdp

PyTree = Any
REFERENCE_CHOSEN = "reference_chosen_logps"
REFERENCE_REJECTED = "reference_rejected_logps"


class PairLogps(NamedTuple):
    """Log-probabilities [B] of each pair's chosen and rejected responses."""

    chosen: jax.Array
    rejected: jax.Array


class DPOTerms(NamedTuple):
    """Per-pair loss [B] and implicit rewards [B] of chosen and rejected."""

    losses: jax.Array
    chosen_rewards: jax.Array
    rejected_rewards: jax.Array


def response_weights(batch: dict) -> tuple[jax.Array, jax.Array]:
    """Float weights [B, T − 1] of the log-prob at position t: 1 where token t + 1 is a
    response token, of the chosen and of the rejected sequence."""
    chosen = batch["loss_mask"].astype(bool)
    prompt = batch["chosen_mask"].astype(bool) & ~chosen
    rejected = batch["rejected_mask"].astype(bool) & ~prompt
    return chosen[:, 1:].astype(jnp.float32), rejected[:, 1:].astype(jnp.float32)


def sequence_logps(token_logps: jax.Array, weights: jax.Array, *, average: bool) -> jax.Array:
    """Per-sequence sum (``average``: mean) of ``token_logps`` [B, T − 1] under ``weights``."""
    logps = jnp.sum(token_logps * weights, axis=-1)
    return logps / jnp.maximum(jnp.sum(weights, axis=-1), 1.0) if average else logps


def pair_logps(graphdef: nnx.GraphDef, params: PyTree, batch: dict, *, average: bool) -> PairLogps:
    """Response log-probs of chosen and rejected (:func:`sequence_logps`), one forward over both."""
    model = nnx.merge(graphdef, fsdp.gather_outer(params))
    tokens = jnp.concatenate([batch["chosen_tokens"], batch["rejected_tokens"]])
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    weights = jnp.concatenate(response_weights(batch))
    logps = sequence_logps(model.token_logprobs(tokens, mask), weights, average=average)
    return PairLogps(*jnp.split(logps, 2))


def dpo_terms(
    policy: PairLogps,
    reference: PairLogps,
    *,
    beta: float,
    loss_type: str,
    label_smoothing: float = 0.0,
) -> DPOTerms:
    """The DPO (sigmoid) or IPO loss of each pair and its implicit rewards (module docstring)."""
    chosen_ratio = policy.chosen - reference.chosen
    rejected_ratio = policy.rejected - reference.rejected
    h = chosen_ratio - rejected_ratio
    if loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(beta * h)
        if label_smoothing:
            losses = losses - label_smoothing * jax.nn.log_sigmoid(-beta * h)
    return DPOTerms(losses, beta * chosen_ratio, beta * rejected_ratio)


def reference_logps(batch: dict) -> PairLogps:
    """The frozen reference's log-probs that the stage added to ``batch``."""
    return PairLogps(batch[REFERENCE_CHOSEN], batch[REFERENCE_REJECTED])


def _terms(graphdef: nnx.GraphDef, params: PyTree, batch: dict, loss: dict[str, Any]):
    policy = pair_logps(graphdef, params, batch, average=loss["loss_type"] == "ipo")
    return policy, dpo_terms(policy, reference_logps(batch), **loss)


def make_dpo_loss(graphdef: nnx.GraphDef, **loss: Any):
    """``loss_fn(params, batch, rng)``: the mean DPO loss of this device's pairs, TRL's metrics.

    ``loss`` holds :func:`dpo_terms`' keywords (beta, loss_type, label_smoothing).
    """

    def loss_fn(params: PyTree, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        policy, terms = _terms(graphdef, params, batch, loss)
        chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
        return terms.losses.mean(), {
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/accuracies": jnp.mean(chosen > rejected),
            "rewards/margins": jnp.mean(chosen - rejected),
            "logps/chosen": policy.chosen.mean(),
            "logps/rejected": policy.rejected.mean(),
        }

    return loss_fn


def make_dpo_eval_sums(graphdef: nnx.GraphDef, **loss: Any):
    """Per-device sums of the same quantities on the eval split."""

    def sums(params: PyTree, batch: dict) -> dict:
        policy, terms = _terms(graphdef, params, batch, loss)
        chosen, rejected = terms.chosen_rewards, terms.rejected_rewards
        return {
            "pairs": jnp.float32(chosen.shape[0]),
            "loss": jnp.sum(terms.losses),
            "rewards/chosen": jnp.sum(chosen),
            "rewards/rejected": jnp.sum(rejected),
            "rewards/accuracies": jnp.sum(chosen > rejected).astype(jnp.float32),
            "logps/chosen": jnp.sum(policy.chosen),
            "logps/rejected": jnp.sum(policy.rejected),
        }

    return sums


def summarize_eval(totals: dict[str, float]) -> dict[str, float]:
    """Means per eval pair of the summed totals, and the reward margin."""
    pairs = totals["pairs"]
    means = {name: total / pairs for name, total in totals.items() if name != "pairs"}
    means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
    return {**means, "pairs": pairs}


def make_reference_step(graphdef: nnx.GraphDef, *, average: bool):
    """A pmapped ``(params, batch) -> PairLogps`` of the frozen reference (no gradient)."""

    def step(params: PyTree, batch: dict) -> PairLogps:
        return pair_logps(graphdef, params, batch, average=average)

    return jax.pmap(step, axis_name="data")
