"""Scoring of prompt + response: log-probs, values, sequence and pair rewards, in one place.

A row is a LEFT-padded prompt [P] followed by a response [N] that is right-padded
after EOS. Response token ``i`` sits at sequence position ``P + i`` and is
predicted by the hidden state at ``P + i - 1``; its value (the critic's estimate
before emitting it) is read at the same position, as TRL does.

Log-probs take the sampling ``temperature``: the sampler draws from
softmax(logits / T), so the log-probs PPO's ratio, its KL penalty and its guard
read are those of the same tempered distribution (TRL divides the logits by T
in every forward pass too). PPO's rollout and update, the evaluation and the
reward stage call these functions, so rollout and update agree (first ratio 1).

Parameters may be sharded (fsdp.py): each pass gathers what it uses when it uses it,
so several networks' embeddings are never whole on a chip at the same time.

``trim_padding`` cuts the columns no row of a batch uses (the prompts' common left padding,
the responses' common right padding) before a pass that is run many times on it, such as
PPO's update: the results do not change, since attention is causal and never reads a pad
key, positions count real tokens only, and every loss is a masked mean.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from components.core.model import vocab_tiles
from components.core.model.rotary_tables import rotary_key
from components.core.training import fsdp

PyTree = Any


def sequence(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Tokens and mask [..., P + N] of prompt followed by response."""
    tokens = jnp.concatenate([batch["prompt_tokens"], batch["response_tokens"]], axis=-1)
    mask = jnp.concatenate(
        [batch["prompt_mask"].astype(jnp.int32), batch["response_mask"].astype(jnp.int32)],
        axis=-1,
    )
    return tokens, mask


def _response_hidden(
    graphdef: nnx.GraphDef, params: PyTree, batch: dict[str, jax.Array]
) -> tuple[nnx.Module, jax.Array]:
    """The merged model and its hidden states [B, N, D] that predict the response tokens."""
    model = nnx.merge(graphdef, fsdp.gather_outer(params))
    tokens, mask = sequence(batch)
    prompt_len = batch["prompt_tokens"].shape[1]
    hidden = model(tokens, mask, batch.get(rotary_key(model.config)))
    return model, hidden[:, prompt_len - 1 : -1]


def with_rotary(graphdef: nnx.GraphDef, params: PyTree, batch: dict[str, jax.Array]) -> dict:
    """``batch`` with the network's rotary tables of its rows (any leading axes) under the
    network's :func:`rotary_tables.rotary_key`: the passes over it read them instead of computing
    them (networks with the same frequencies share one entry). For a batch passed over many
    times, such as PPO's minibatches, computed before the loop over them."""
    model = nnx.merge(graphdef, params)  # for its config and tables: adds no computation
    key = rotary_key(model.config)
    if key in batch:
        return batch
    _, mask = sequence(batch)
    return {**batch, key: model.rotary(mask)}


def response_logits(
    graphdef: nnx.GraphDef, params: PyTree, batch: dict[str, jax.Array], temperature: float = 1.0
) -> jax.Array:
    """Float32 next-token logits [B, N, V] at the response positions, divided by ``temperature``."""
    model, hidden = _response_hidden(graphdef, params, batch)
    logits = model.lm_logits(hidden)
    # The sampler's own scaling (sampler.filter_logits): x / T, so T = 1 changes nothing.
    return logits if temperature == 1.0 else logits / temperature


def response_stats(
    graphdef: nnx.GraphDef,
    params: PyTree,
    batch: dict[str, jax.Array],
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    reference: PyTree | None = None,
) -> vocab_tiles.TokenStats:
    """log p_T(response token) [B, N], and where asked the entropy and, with ``reference``
    (the reference network's parameters, same graph), the exact KL and the reference's
    log-probs: reduced a tile of logits at a time (``vocab_tiles``), so no [B, N, V] tensor
    lives whole. Padding positions hold garbage; mask them. Under fsdp the reference's pass
    starts after the policy's (its parameters gathered then), and the two output heads
    are whole together while the tiles run."""
    model, hidden = _response_hidden(graphdef, params, batch)
    ref = None
    if reference is not None:
        ref_model, ref_hidden = _response_hidden(graphdef, fsdp.after(reference, hidden), batch)
        ref = (vocab_tiles.head_of(ref_model), ref_hidden)
    return vocab_tiles.token_stats(
        vocab_tiles.head_of(model), hidden, batch["response_tokens"],
        tile=model.config.logits_tile, temperature=temperature, entropy=entropy, ref=ref,
    )  # fmt: skip


def response_logprobs(
    graphdef: nnx.GraphDef, params: PyTree, batch: dict[str, jax.Array], temperature: float = 1.0
) -> jax.Array:
    """log p_T(response token) [B, N] (padding positions hold garbage; mask them)."""
    return response_stats(graphdef, params, batch, temperature).logprobs


def response_values(
    graphdef: nnx.GraphDef, params: PyTree, batch: dict[str, jax.Array]
) -> jax.Array:
    """Critic values [B, N] (float32) of the state before each response token."""
    model, hidden = _response_hidden(graphdef, params, batch)
    # The scalar head on every position (Transformer.scalar reads only the last one).
    return model.scalar_head(hidden.astype(jnp.float32))[..., 0]


def sequence_scores(
    graphdef: nnx.GraphDef, params: PyTree, batch: dict[str, jax.Array]
) -> jax.Array:
    """Reward-model scores [B] of prompt + response, read at the last real token."""
    model = nnx.merge(graphdef, fsdp.gather_outer(params))
    tokens, mask = sequence(batch)
    return model.scalar(model(tokens, mask), mask)


def pair_rewards(
    graphdef: nnx.GraphDef, params: PyTree, batch: dict
) -> tuple[jax.Array, jax.Array]:
    """Rewards of the chosen and rejected sequences, from one forward pass over both."""
    model = nnx.merge(graphdef, fsdp.gather_outer(params))
    tokens = jnp.concatenate([batch["chosen_tokens"], batch["rejected_tokens"]])
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    rewards = model.scalar(model(tokens, mask), mask)
    return jnp.split(rewards, 2)


def halved_width(width: int, used: int) -> int:
    """The narrowest of ``width``, ``width / 2``, ``width / 4``, … that holds ``used`` columns.

    Halving (rather than cutting to ``used``) keeps the shapes of a run to a handful, so a
    compiled pass is reused instead of compiled again for every batch.
    """
    while width % 2 == 0 and width // 2 >= max(used, 1):
        width //= 2
    return width


def trim_padding(batch: dict[str, Any], response_fields: Iterable[str]) -> dict[str, Any]:
    """``batch`` cut to the columns its rows use, in halves (``halved_width``): the prompt
    fields keep their last columns, the ``response_fields`` (``[..., N]`` each) their first.

    Reads both masks on the host (it waits for whatever computes them). With several hosts
    the batch is returned whole: each host sees only its rows, and every host must run
    the same program.
    """
    if jax.process_count() > 1:
        return batch
    prompt = np.asarray(batch["prompt_mask"]) != 0
    response = np.asarray(batch["response_mask"]) != 0
    prompt_used = prompt.reshape(-1, prompt.shape[-1]).any(axis=0)
    response_used = response.reshape(-1, response.shape[-1]).any(axis=0)
    # Left padding: columns before the first one any row uses; right padding: after the last.
    prompt_width = halved_width(prompt.shape[-1], prompt.shape[-1] - int(np.argmax(prompt_used)))
    response_last = response.shape[-1] - int(np.argmax(response_used[::-1]))
    response_width = halved_width(response.shape[-1], response_last if response_used.any() else 1)
    trimmed = dict(batch)
    if prompt_width < prompt.shape[-1]:
        for name in ("prompt_tokens", "prompt_mask"):
            trimmed[name] = batch[name][..., -prompt_width:]
    if response_width < response.shape[-1]:
        for name in response_fields:
            trimmed[name] = batch[name][..., :response_width]
    return trimmed
