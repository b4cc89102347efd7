"""The layer stack of a model with layers of several kinds (layer_kinds.py), scanned one
repeating period at a time, and Gemma 4's per-layer input embeddings.

Qwen3.5 keeps ``blocks`` (attention) and ``linear_blocks`` (Gated DeltaNet); Gemma 4 keeps
``blocks`` (sliding), ``global_blocks`` (full attention, other shapes) and, for the layers
that reuse keys and values, ``shared_blocks`` and ``shared_global_blocks``. Each segment
(layer_kinds.segments) is one ``lax.scan`` whose step takes one period's slice of every
stack in it and runs its layers in order: XLA compiles one period, not the stack, and remat
keeps only each period's input. Two layer kinds, or four, cost one period's compile each
segment; the whole stack is never unrolled (except without remat, where unrolling is what
XLA:CPU runs fastest, as for a plain stack).

KV sharing: the scan of the layers owning their keys and values also returns, per period,
the keys and values of the positions that store them (the last sliding and the last full
layer of the period); the last period's are those of the storing layers, and the shared
segment's scan attends over them (they are constants of its step). Decoding does the same
on the cache: a shared layer reads the storing layer's cache arrays as they stand after
that layer wrote this step's keys.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.model import layer_kinds
from components.core.model.config import REMAT_POLICIES, ModelConfig
from components.core.model.layers import INIT_STD, RMSNorm, dense, on_rows
from components.core.model.rotary_tables import Rotary, layer_rotary
from components.core.training import fsdp

# transformer.py's Transformer, which imports this module.
Transformer = Any


class PerLayerEmbeddings(nnx.Module):
    """Gemma 4's per-layer inputs [B,T,L,P]: a token's own embedding per layer (a packed
    [V, L·P] table, times sqrt(P)) and a projection of its input embedding (times
    1/sqrt(D), normed per layer), summed and scaled by 1/sqrt(2), as transformers'
    ``get_per_layer_inputs`` and ``project_per_layer_inputs``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        width = config.n_layers * config.per_layer_dim
        init = nnx.initializers.normal(INIT_STD)
        self.table = nnx.Param(init(rngs.params(), (config.per_layer_vocab, width), jnp.float32))
        self.project = dense(config.dim, width, config, rngs, target="per_layer_model_projection")
        self.norm = RMSNorm(config.per_layer_dim, config)

    def __call__(self, tokens: jax.Array, embedded: jax.Array) -> jax.Array:
        config = self.config
        dtype, width = config.compute_dtype, config.per_layer_dim
        shape = (*tokens.shape, config.n_layers, width)
        # Ids past the table (a tokenizer grown beyond it) read row 0, as Tunix does.
        ids = jnp.where(tokens < config.per_layer_vocab, tokens, 0)
        table = self.table.get_value()
        if isinstance(table, fsdp.Sharded):  # fsdp: this device's chunk of the table
            own = fsdp.sharded_rows(table, ids)
        else:
            own = jnp.take(table, ids, axis=0)
        own = own.astype(dtype).reshape(shape)
        own = own * jnp.asarray(width**0.5, dtype)
        projected = on_rows(self.project, embedded) * jnp.asarray(config.dim**-0.5, dtype)
        projected = self.norm(projected.reshape(shape))
        return (projected + own) * jnp.asarray(2**-0.5, dtype)


def _by_period(stack: nnx.State, periods: int) -> nnx.State:
    """A layer stack [L, ...] as [periods, L / periods, ...] (fsdp chunks included)."""
    return jax.tree.map(lambda a: a.reshape(periods, -1, *a.shape[1:]), stack)


def _segment_params(
    model: Transformer, segment: layer_kinds.Segment, states: dict[str, nnx.State]
) -> dict[str, nnx.State]:
    """Each stack's layers in ``segment``, as [periods, per period, ...]."""
    stacks = layer_kinds.layer_stacks(model.config)
    params = {}
    for stack in dict.fromkeys(s for s, _ in segment.period):
        before = stacks[: segment.start].count(stack)
        count = stacks[segment.start : segment.end].count(stack)
        sliced = jax.tree.map(lambda a, b=before, c=count: a[b : b + c], states[stack])
        params[stack] = _by_period(sliced, segment.periods)
    return params


def _store_positions(config: ModelConfig, segment: layer_kinds.Segment) -> dict[bool, int]:
    """Per layer type: the position in ``segment``'s period of its storing layer."""
    stores = layer_kinds.store_layers(config) if config.kv_shared_layers else {}
    last_start = segment.end - len(segment.period)
    return {s: i - last_start for s, i in stores.items() if last_start <= i < segment.end}


def scan(
    model: Transformer,
    x: jax.Array,
    mask: jax.Array,
    rotary: Rotary,
    allowed: jax.Array,
    window: jax.Array | None,
    per_layer: jax.Array | None,
    *,
    collect: bool = False,
) -> tuple[jax.Array, tuple[list[Any], list[Any]]]:
    """The stack over ``x`` [B,T,D], a segment at a time (module docstring).

    Returns the residual stream and, with ``collect``, in layer order the (k, v) of every
    layer owning them and the state of every Gated DeltaNet layer.
    """
    config = model.config
    split = {s: nnx.split(getattr(model, s)) for s in layer_kinds.stack_counts(config)}
    graphdefs = {s: g for s, (g, _) in split.items()}
    states = {s: state for s, (_, state) in split.items()}
    stored: dict[bool, tuple[jax.Array, jax.Array]] = {}
    kvs, deltas = [], []
    for segment in layer_kinds.segments(config):
        period = segment.period
        store_at, shared = _store_positions(config, segment), dict(stored)

        def one_period(x, xs, period=period, store_at=store_at, shared=shared):
            params, inputs = xs
            taken: dict[str, int] = {}
            own_kvs, layer_states, stores = [], [], {}
            for position, (stack, sliding) in enumerate(period):
                index = taken.get(stack, 0)
                taken[stack] = index + 1
                layer = jax.tree.map(lambda a, i=index: a[i], params[stack])
                block = nnx.merge(graphdefs[stack], fsdp.gather(layer))
                if stack == "linear_blocks":
                    x, state = block(x, mask)
                    layer_states.append(state)
                    continue
                reused = shared.get(sliding) if stack.startswith("shared_") else None
                x, kv = block(
                    x,
                    layer_rotary(rotary, sliding),
                    window if sliding and window is not None else allowed,
                    reused,
                    per_layer=None if inputs is None else inputs[position],
                )
                if reused is None:
                    own_kvs.append(kv)
                if store_at.get(sliding) == position:
                    stores[sliding] = kv
            return x, ((own_kvs, layer_states) if collect else None, stores)

        unroll = config.remat == "none" and not fsdp.is_sharded(states)
        if config.remat != "none":
            one_period = jax.checkpoint(
                one_period, policy=REMAT_POLICIES[config.remat], prevent_cse=False
            )
        inputs = None
        if per_layer is not None:  # [B,T,L,P] -> [periods, per period, B, T, P]
            inputs = jnp.moveaxis(per_layer[:, :, segment.start : segment.end], 2, 0)
            inputs = inputs.reshape(segment.periods, len(period), *inputs.shape[1:])
        xs = (_segment_params(model, segment, states), inputs)
        x, (collected, stores) = jax.lax.scan(one_period, x, xs, unroll=unroll)
        stored.update({s: jax.tree.map(lambda a: a[-1], kv) for s, kv in stores.items()})
        if collect:
            own_kvs, layer_states = collected
            for j in range(segment.periods):
                kvs.extend(jax.tree.map(lambda a, j=j: a[j], kv) for kv in own_kvs)
                deltas.extend(jax.tree.map(lambda a, j=j: a[j], s) for s in layer_states)
    return x, (kvs, deltas)


def layer_params(model: Transformer) -> tuple[nnx.State, ...]:
    """Every stack's parameters one layer each, in the checkpoint's layer order."""
    stacks = {s: nnx.split(getattr(model, s))[1] for s in layer_kinds.stack_counts(model.config)}
    return tuple(
        jax.tree.map(lambda a, i=index: a[i], stacks[stack])
        for stack, index in model.config.stack_places()
    )
