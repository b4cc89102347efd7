"""Autoregressive sampling with a KV cache: one prefill, then a decode loop that stops early.

The decode is a ``lax.while_loop`` that ends when every sequence has emitted EOS (or
after ``max_new_tokens``): the outputs keep their fixed shape [B, N], and the steps it
skips would only have written pads, so the results are those of the full-length loop.
With parameters sharded over devices (fsdp.py) each step gathers layers from every
device, so all devices run until the last sequence on any of them has ended.

Everything here is a pure function of ``(graphdef, params, arrays)`` with the
sampling settings as Python values, so it can be ``jax.jit``-ed (settings static)
or called inside ``jax.pmap`` with the graphdef and settings closed over::

    graphdef, params = nnx.split(model, nnx.Param)
    rollout = jax.pmap(
        lambda params, tokens, mask, rng: generate(
            (graphdef, params), tokens, mask, rng, max_new_tokens=64, eos_id=2, pad_id=0
        ),
        axis_name="data",
    )

Prompts must be LEFT-padded (the last prompt column is a real token for every row).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.model.transformer import KVCache, Transformer
from components.core.training import fsdp

ModelOrSplit = Transformer | tuple[nnx.GraphDef, nnx.State]


class SampleOutput(NamedTuple):
    """Generated continuation of each prompt.

    ``logprobs`` are under the untempered policy (temperature 1, no top-k/top-p),
    i.e. what ``Transformer.token_logprobs`` recomputes, which is what PPO needs.
    """

    tokens: jax.Array  # [B, N] int32; pad_id after EOS
    logprobs: jax.Array  # [B, N] float32; 0 where mask is 0
    mask: jax.Array  # [B, N] int32; 1 up to and including EOS


def _as_split(model: ModelOrSplit) -> tuple[nnx.GraphDef, nnx.State]:
    """Accept a model or its (graphdef, params) split."""
    if isinstance(model, Transformer):
        return nnx.split(model, nnx.Param)
    return model


def _check_settings(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """Reject sampling settings that would silently misbehave."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = disabled), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {top_p}")


def filter_logits(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> jax.Array:
    """Temperature-scaled logits with everything outside top-k / the top-p nucleus at -inf."""
    logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token if the mass strictly before it is < top_p: the first always survives.
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p
        n_keep = jnp.sum(keep, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_logits, n_keep - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return logits


StopIds = int | tuple[int, ...]  # the id, or ids, that end a response


def stop_tuple(eos_id: StopIds) -> tuple[int, ...]:
    """``eos_id`` as a tuple of ids (a tokenizer's ``stop_ids``, or one eos id)."""
    return (int(eos_id),) if isinstance(eos_id, int) else tuple(int(i) for i in eos_id)


def is_stop(tokens: jax.Array, eos_id: StopIds) -> jax.Array:
    """Where ``tokens`` are among the stop ids (the model's eos and end-of-turn tokens)."""
    stops = stop_tuple(eos_id)
    hit = tokens == stops[0]
    for stop in stops[1:]:
        hit = hit | (tokens == stop)
    return hit


class _Settings(NamedTuple):
    eos_id: tuple[int, ...]  # every id that ends a response
    pad_id: int
    temperature: float
    top_k: int
    top_p: float
    vocab_size: int  # ids at or past it are never chosen; 0 = every row of the embedding


def _choose(
    logits: jax.Array, rng: jax.Array, done: jax.Array, settings: _Settings
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pick the next token [B]; returns (token, logprob, mask, done after this token)."""
    choosable = logits
    if 0 < settings.vocab_size < logits.shape[-1]:
        # Embedding rows past the tokenizer (Qwen2.5 pads 151,665 ids to 151,936 rows) are
        # no token: no other model of the run, nor the tokenizer, can read them back.
        allowed = jnp.arange(logits.shape[-1]) < settings.vocab_size
        choosable = jnp.where(allowed, logits, -jnp.inf)
    if settings.temperature == 0:
        token = jnp.argmax(choosable, axis=-1)
    else:
        filtered = filter_logits(choosable, settings.temperature, settings.top_k, settings.top_p)
        token = jax.random.categorical(rng, filtered, axis=-1)
    token = token.astype(jnp.int32)
    policy_logprobs = jax.nn.log_softmax(logits, axis=-1)
    logprob = jnp.take_along_axis(policy_logprobs, token[:, None], axis=-1)[:, 0]
    token = jnp.where(done, settings.pad_id, token)
    logprob = jnp.where(done, 0.0, logprob)
    mask = (~done).astype(jnp.int32)
    return token, logprob, mask, done | is_stop(token, settings.eos_id)


class _Decoding(NamedTuple):
    """The decode loop's carry: next step, last token, which rows ended, the cache, outputs."""

    index: jax.Array  # [] int32: the response position this step writes
    token: jax.Array  # [B] int32: the token fed to this step
    done: jax.Array  # [B] bool
    all_done: jax.Array  # [] bool: every row ended (on every device sharing sharded params)
    cache: KVCache
    columns: SampleOutput  # [N, B] each


def _sharded_axes(params: nnx.State) -> tuple[str, ...]:
    """The device axes the parameters are sharded over (fsdp.Sharded chunks); () if none."""
    leaves = jax.tree.leaves(params, is_leaf=lambda node: isinstance(node, fsdp.Sharded))
    return tuple(sorted({leaf.axis for leaf in leaves if isinstance(leaf, fsdp.Sharded)}))


def _all_done(done: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Whether no row is still running, here and on every device of ``axes``.

    Sharded parameters are gathered from every device at each decode step, so those
    devices must agree on when to stop: the running rows are counted over them.
    """
    running = jnp.sum((~done).astype(jnp.int32))
    for axis in axes:
        running = jax.lax.psum(running, axis)
    return running == 0


def generate(
    model: ModelOrSplit,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    eos_id: StopIds,
    pad_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    vocab_size: int = 0,
    stop_when_done: bool = True,
) -> SampleOutput:
    """Sample ``max_new_tokens`` after LEFT-padded prompts [B, P] with a KV cache.

    ``temperature == 0`` is greedy; ``top_k=0`` and ``top_p=1.0`` disable those filters.
    ``vocab_size`` (the tokenizer's; 0 = no limit) keeps ids past it from being chosen; the
    logprobs stay those of the whole, untempered distribution.
    After a sequence emits ``eos_id`` (an id, or the tokenizer's ``stop_ids``: eos and the
    template's end-of-turn token) it emits ``pad_id`` with mask 0. The decode stops
    once every sequence has ended; ``stop_when_done=False`` runs all ``max_new_tokens``
    steps (same outputs: tests and benchmarks measure the difference).
    """
    _check_settings(max_new_tokens, temperature, top_k, top_p)
    graphdef, params = _as_split(model)
    params = fsdp.gather_outer(params)  # sharded (fsdp.py): the layers gather per step
    model = nnx.merge(graphdef, params)
    config = model.config
    batch, prompt_len = prompt_tokens.shape
    if prompt_len + max_new_tokens > config.max_seq_len:
        raise ValueError(
            f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} exceeds "
            f"max_seq_len {config.max_seq_len}: shorten one or raise ModelConfig.max_seq_len"
        )
    settings = _Settings(stop_tuple(eos_id), pad_id, temperature, top_k, top_p, vocab_size)
    keys = jax.random.split(rng, max_new_tokens)
    # The last sampled token is never fed back, so the cache needs N - 1 decode slots.
    hidden, cache = model.prefill(prompt_tokens, prompt_mask, prompt_len + max_new_tokens - 1)
    logits = model.lm_logits(hidden[:, -1])
    token, logprob, mask, done = _choose(logits, keys[0], jnp.zeros((batch,), bool), settings)
    # One row per step ([N, B]); the rows the loop never reaches keep pad / 0 / 0.
    columns = SampleOutput(
        tokens=jnp.full((max_new_tokens, batch), pad_id, jnp.int32).at[0].set(token),
        logprobs=jnp.zeros((max_new_tokens, batch), jnp.float32).at[0].set(logprob),
        mask=jnp.zeros((max_new_tokens, batch), jnp.int32).at[0].set(mask),
    )
    axes = _sharded_axes(params)
    first = _Decoding(jnp.asarray(1, jnp.int32), token, done, _all_done(done, axes), cache, columns)
    # On CPU the layers are split once, before the loop: XLA:CPU copies a layer sliced inside
    # it every step (0.92 against 1.14 ms a step at bench_sampler.py's real shape). On an
    # accelerator the slice is left to its compiler, and no second copy of the weights held.
    layers = model.layer_params() if jax.default_backend() == "cpu" else None
    last = _decode((graphdef, params), layers, first, keys, settings, axes, stop_when_done)
    return SampleOutput(*(column.T for column in last.columns))


def _decode(
    model: tuple[nnx.GraphDef, nnx.State],
    layers: tuple[nnx.State, ...],
    first: _Decoding,
    keys: jax.Array,
    settings: _Settings,
    axes: tuple[str, ...],
    stop_when_done: bool,
) -> _Decoding:
    """Feed each sampled token back until step ``len(keys)`` or, if asked, every row has ended."""
    graphdef, params = model

    def running(carry: _Decoding) -> jax.Array:
        more = carry.index < len(keys)
        return more & ~carry.all_done if stop_when_done else more

    def step(carry: _Decoding) -> _Decoding:
        model = nnx.merge(graphdef, params)
        hidden, cache = model.decode(carry.token, carry.cache, layers)
        logits = model.lm_logits(hidden)
        token, logprob, mask, done = _choose(logits, keys[carry.index], carry.done, settings)
        new = (token, logprob, mask)
        columns = SampleOutput(
            *(
                jax.lax.dynamic_update_index_in_dim(column, value, carry.index, axis=0)
                for column, value in zip(carry.columns, new, strict=True)
            )
        )
        return _Decoding(carry.index + 1, token, done, _all_done(done, axes), cache, columns)

    return jax.lax.while_loop(running, step, first)


def generate_without_cache(
    model: ModelOrSplit,
    prompt_tokens: jax.Array,
    prompt_mask: jax.Array,
    *,
    max_new_tokens: int,
    eos_id: StopIds,
    pad_id: int,
) -> SampleOutput:
    """Greedy reference: recompute the whole sequence each step (no cache). Tests and benchmarks.

    The sequence buffer has the fixed shape [B, P + N] (so it compiles once); slots not yet
    generated are masked out, so each step costs a full forward pass over P + N tokens.
    """
    _check_settings(max_new_tokens, 0.0, 0, 1.0)
    graphdef, params = _as_split(model)
    batch, prompt_len = prompt_tokens.shape
    settings = _Settings(stop_tuple(eos_id), pad_id, 0.0, 0, 1.0, 0)
    pad = [(0, 0), (0, max_new_tokens)]
    tokens = jnp.pad(prompt_tokens.astype(jnp.int32), pad, constant_values=pad_id)
    mask = jnp.pad(prompt_mask.astype(jnp.int32), pad)

    def step(carry, index):
        tokens, mask, done = carry
        model = nnx.merge(graphdef, params)
        hidden = model(tokens, mask)
        last = jax.lax.dynamic_index_in_dim(hidden, prompt_len + index - 1, axis=1, keepdims=False)
        token, logprob, out_mask, done = _choose(model.lm_logits(last), None, done, settings)
        slot = prompt_len + index
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], slot, axis=1)
        # Same as the cached sampler: every generated slot is attendable (pads only follow EOS).
        mask = jax.lax.dynamic_update_slice_in_dim(mask, jnp.ones((batch, 1), jnp.int32), slot, 1)
        return (tokens, mask, done), (token, logprob, out_mask)

    init = (tokens, mask, jnp.zeros((batch,), bool))
    _, (new_tokens, logprobs, out_mask) = jax.lax.scan(step, init, jnp.arange(max_new_tokens))
    return SampleOutput(tokens=new_tokens.T, logprobs=logprobs.T, mask=out_mask.T)
