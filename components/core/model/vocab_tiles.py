"""Per-token statistics of next-token distributions, a tile of positions at a time.

Log-probs of sampled tokens, entropies and the exact KL to a reference need the whole
vocabulary per position, but never all positions' logits at once: at a 151,936-token
vocabulary, a PPO minibatch of 64 × 512 response tokens holds 20 GB of fp32 logits per
[B, N, V] tensor. Here the positions are cut into tiles of ``ModelConfig.logits_tile``
elements (positions × vocabulary, at least one position a tile), and a ``lax.map`` over
the tiles computes each tile's logits from the hidden states, reduces them to the
statistics, and drops them; under ``jax.checkpoint`` the backward pass recomputes a
tile's logits instead of keeping them, so one [tile, V] block lives at a time, forward
and backward (MaxText's vocabulary tiling does the same; TRL's fused linear GRPO loss
chunks the sequence the same way). A model whose positions fit one tile (the demo's
vocabulary of a few hundred words) runs the plain, untiled computation.

The statistics are the same as the whole tensor gives, up to float32 rounding of the
matmul (tests: within 1e-6, gradients included).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Head(NamedTuple):
    """A network's output projection as plain arrays: what ``Transformer.lm_logits`` uses."""

    table: jax.Array  # [V, D] (tied to the embedding) or [D, V] (untied), compute dtype
    rows: bool  # True: the table is [V, D]
    softcap: float | None  # Gemma 2's final-logit soft cap


class TokenStats(NamedTuple):
    """Per position [..., N]: log p(target), and where asked the entropy, and with a
    reference KL(p ‖ ref) and log ref(target)."""

    logprobs: jax.Array
    entropy: jax.Array | None
    kl: jax.Array | None
    ref_logprobs: jax.Array | None


def head_of(model) -> Head:
    """``model``'s output projection (a merged ``Transformer``; fsdp: gathered already)."""
    dtype, cap = model.config.compute_dtype, model.config.final_logit_softcap
    if model.lm_head is None:
        return Head(model.embed.embedding[...].astype(dtype), True, cap)
    return Head(model.lm_head[...].astype(dtype), False, cap)


def head_logits(head: Head, hidden: jax.Array, temperature: float = 1.0) -> jax.Array:
    """Float32 logits [..., V] of ``hidden`` [..., D] (fp32 accumulation), divided by T."""
    equation = "...d,vd->...v" if head.rows else "...d,dv->...v"
    logits = jnp.einsum(equation, hidden, head.table, preferred_element_type=jnp.float32)
    if head.softcap is not None:
        logits = jnp.tanh(logits / head.softcap) * head.softcap
    return logits if temperature == 1.0 else logits / temperature


def token_entropy(logits: jax.Array, log_z: jax.Array | None = None) -> jax.Array:
    """Entropy (nats) [...] of each next-token distribution ``logits`` [..., V], in float32.

    ``log_z`` is logsumexp(logits) when the caller has it already (the log-probs need it too):
    one full-vocabulary reduction instead of two.
    """
    logits = jnp.asarray(logits, jnp.float32)
    if log_z is None:
        log_z = jax.nn.logsumexp(logits, axis=-1)
    log_probs = logits - log_z[..., None]
    # where(): a −inf logit has p = 0, and 0·(−inf) would be nan instead of 0.
    plogp = jnp.where(log_probs > -jnp.inf, jnp.exp(log_probs) * log_probs, 0.0)
    return -jnp.sum(plogp, axis=-1)


def exact_kl(logits: jax.Array, ref_logits: jax.Array) -> jax.Array:
    """KL(p ‖ q) in nats [...] of each pair of next-token distributions ``logits`` and
    ``ref_logits`` [..., V], summed over the whole vocabulary, in float32.

    Along sampled responses, its sum over a response's tokens is an unbiased estimate of the
    sequence KL (the chain rule), like k1's and k3's, but without their noise of the sampled
    token: on the demo's final policy a sequence's spread is 0.04 nats, k3's 0.11, k1's 0.5.
    """
    log_p = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    log_q = jax.nn.log_softmax(jnp.asarray(ref_logits, jnp.float32), axis=-1)
    # where(): a token p gives no mass adds nothing, even where q gives it none either.
    terms = jnp.where(log_p > -jnp.inf, jnp.exp(log_p) * (log_p - log_q), 0.0)
    return jnp.sum(terms, axis=-1)


def positions_per_tile(tile: int, vocab_size: int) -> int:
    """Positions whose logits fit ``tile`` elements (at least one); 0: every position."""
    return 0 if tile <= 0 else max(1, tile // vocab_size)


def _stats(
    head: Head,
    hidden: jax.Array,
    targets: jax.Array,
    temperature: float,
    entropy: bool,
    ref: tuple[Head, jax.Array] | None,
) -> TokenStats:
    """The statistics of whole logits: one tile, or the untiled computation."""
    logits = head_logits(head, hidden, temperature)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    logprobs = _picked(logits, targets) - log_z
    kl = ref_logprobs = None
    if ref is not None:
        ref_logits = head_logits(ref[0], ref[1], temperature)
        kl = exact_kl(logits, ref_logits)
        ref_logprobs = _picked(ref_logits, targets) - jax.nn.logsumexp(ref_logits, axis=-1)
    return TokenStats(logprobs, token_entropy(logits, log_z) if entropy else None, kl, ref_logprobs)


def _picked(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


def token_stats(
    head: Head,
    hidden: jax.Array,
    targets: jax.Array,
    *,
    tile: int,
    temperature: float = 1.0,
    entropy: bool = False,
    ref: tuple[Head, jax.Array] | None = None,
) -> TokenStats:
    """log p_T(``targets``) [..., N] from ``hidden`` [..., N, D] under ``head``, and where
    asked the entropy and, with ``ref`` (the reference's head and hidden states at the same
    positions), the exact KL(p_T ‖ ref_T) and log ref_T(``targets``), computed ``tile``
    elements of logits at a time (``ModelConfig.logits_tile``; 0: whole)."""
    vocab = head.table.shape[0] if head.rows else head.table.shape[1]
    shape = targets.shape
    count = targets.size
    per_tile = positions_per_tile(tile, vocab)
    if per_tile == 0 or per_tile >= count:
        return _stats(head, hidden, targets, temperature, entropy, ref)
    tiles = -(-count // per_tile)
    pad = tiles * per_tile - count

    def tiled(x: jax.Array) -> jax.Array:  # [..., N, *rest] → [tiles, per_tile, *rest]
        rest = x.shape[len(shape) :]
        flat = x.reshape(count, *rest)
        flat = jnp.pad(flat, [(0, pad)] + [(0, 0)] * len(rest))
        return flat.reshape(tiles, per_tile, *rest)

    def one(inputs: tuple) -> TokenStats:
        h, t, ref_h = inputs
        return _stats(head, h, t, temperature, entropy, None if ref is None else (ref[0], ref_h))

    ref_hidden = None if ref is None else tiled(ref[1])
    out = jax.lax.map(jax.checkpoint(one), (tiled(hidden), tiled(targets), ref_hidden))
    return TokenStats(*(None if x is None else x.reshape(-1)[:count].reshape(shape) for x in out))
