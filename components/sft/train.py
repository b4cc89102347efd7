"""Next-token loss on the chosen response (prompt tokens masked out) and its eval sums."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def response_nll(graphdef: nnx.GraphDef, params: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
    """Summed negative log-likelihood of the response tokens, and their count."""
    model = nnx.merge(graphdef, params)
    logprobs = model.token_logprobs(batch["chosen_tokens"], batch["chosen_mask"])
    # Position t predicts token t+1: weight it by whether t+1 is a response token.
    weights = batch["loss_mask"][:, 1:].astype(jnp.float32)
    return -jnp.sum(logprobs * weights), jnp.sum(weights)


def make_sft_loss(graphdef: nnx.GraphDef):
    """``loss_fn(params, batch, rng)``: mean NLL per response token on this device."""

    def loss_fn(params: Any, batch: dict, rng: jax.Array) -> tuple[jax.Array, dict]:
        total, count = response_nll(graphdef, params, batch)
        return total / jnp.maximum(count, 1.0), {"tokens": count}

    return loss_fn


def make_sft_eval_sums(graphdef: nnx.GraphDef):
    """Per-device summed NLL and token count of the eval split."""

    def sums(params: Any, batch: dict) -> dict:
        total, count = response_nll(graphdef, params, batch)
        return {"nll": total, "tokens": count}

    return sums


def summarize_eval(totals: dict[str, float]) -> dict[str, float]:
    """Mean eval loss per response token and its perplexity."""
    import math

    loss = totals["nll"] / max(totals["tokens"], 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": totals["tokens"]}
