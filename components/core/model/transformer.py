"""Decoder-only transformer (Flax NNX) with stacked, scanned, rematerialised layers.

The layers' parameters carry a leading ``n_layers`` axis and run under one
``lax.scan``: XLA compiles one layer, and ``jax.checkpoint`` around the scan body
keeps only each layer's input for the backward pass (see NOTES.md: remat of an
unrolled loop saves nothing on XLA CPU, the scanned form saves ~90%).

The model holds only ``nnx.Param`` state, so ``nnx.split(model, nnx.Param)`` /
``nnx.merge`` round-trip it inside ``jax.pmap``.

Without remat (``remat="none"``) and fsdp the scan is unrolled: nothing is recomputed to
save, and XLA:CPU then reads each layer's weights and saved activations where they lie instead of
copying a slice per layer and step (PPO update at bench_ppo_update.py's demo shape on 2 CPU
devices, against the scanned form in the same process: 620 → 515 ms).

The KV-cache decode runs the layers unrolled, each on its own cache array (``KVCache``).

Under fsdp (fsdp.py) the stack's parameters arrive as chunks: each scan step
gathers one layer's weights, inside the remat, so only one layer is whole at a time.

Sliding-window layers (Gemma 2 and 3, Mistral) run inside the same scan: each layer gets
a flag, and picks the windowed or the full attention mask with it, and, where the model
has two rotary tables (Gemma 3), its table.

A hybrid stack (Qwen3.5: three Gated DeltaNet layers, then one attention layer, repeated)
keeps two stacks, ``blocks`` (the attention layers) and ``linear_blocks`` (delta.py), each
with its leading layer axis. The scan walks the repeating period (``ModelConfig.
layer_period``): each step takes one period's slice of both stacks and runs its layers in
order, so XLA compiles one period (four layers), not the whole stack, and remat keeps only
each period's input. Decoding carries each DeltaNet layer's conv and recurrent state
(``KVCache.delta``) beside the attention layers' keys and values.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.model import kind_scan, layer_kinds, moe, vocab_tiles
from components.core.model.config import REMAT_POLICIES, ModelConfig
from components.core.model.delta import DeltaBlock, DeltaState
from components.core.model.latent_attention import LatentAttention
from components.core.model.layers import INIT_STD, Block, RMSNorm
from components.core.model.presets import PRESETS, model_config
from components.core.model.rotary_tables import Rotary, layer_rotary, rope_tables
from components.core.training import fsdp

__all__ = ["PRESETS", "KVCache", "ModelConfig", "Transformer", "model_config"]


class KVCache(NamedTuple):
    """Keys/values of every layer for incremental decoding (a plain pytree).

    One array per layer, not a stack: a decode loop carrying them writes each new key in
    place and attends over the layer's array where it lies. Sliced out of a stack, XLA:CPU
    copies the layer's cache every step (``benchmarks/bench_sampler.py``).
    """

    k: tuple[jax.Array, ...]  # per layer [B, Kv, Hd, S], compute dtype
    v: tuple[jax.Array, ...]  # per layer [B, Kv, S, Hd] (layers.attend: heads_major)
    key_mask: jax.Array  # [B, S] bool: slot holds a token that may be attended to
    next_position: jax.Array  # [B] int32: rotary position of the next token
    length: jax.Array  # [] int32: slots filled so far (same for the whole batch)
    # Per Gated DeltaNet layer (hybrid stacks): its conv inputs and recurrent state, whose
    # size does not grow with the sequence. k and v then hold the attention layers' only.
    delta: tuple[DeltaState, ...] = ()


def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Rotary positions cumsum(mask) - 1, clipped at 0 for leading pads."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def causal_allowed(mask: jax.Array) -> jax.Array:
    """[B, T, T] bool: query t may attend key s iff s <= t and key s is a real token."""
    length = mask.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    return causal[None] & mask.astype(bool)[:, None, :]


def last_real_index(mask: jax.Array) -> jax.Array:
    """[B] index of the last position with mask == 1 (works for left or right padding)."""
    length = mask.shape[-1]
    return length - 1 - jnp.argmax(mask[:, ::-1].astype(bool), axis=-1)


def sliding_allowed(
    config: ModelConfig, allowed: jax.Array, query_pos: jax.Array, key_pos: jax.Array
) -> jax.Array | None:
    """``allowed`` [B,T,S] narrowed to keys less than ``sliding_window`` positions back."""
    if config.sliding_window is None:
        return None
    near = (query_pos[:, :, None] - key_pos[:, None, :]) < config.sliding_window
    return allowed & near


def layer_allowed(allowed: jax.Array, window: jax.Array | None, is_sliding: jax.Array) -> jax.Array:
    """The attention mask of one scanned layer: windowed where the layer slides."""
    return allowed if window is None else jnp.where(is_sliding, window, allowed)


def _stack(config: ModelConfig, stack: str, count: int, rngs: nnx.Rngs) -> nnx.Module:
    """``count`` layers of ``stack``'s kind, created under vmap: every param gains a leading
    layer axis."""
    kind = layer_kinds.stack_kind(config, stack)

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs: nnx.Rngs) -> nnx.Module:
        if config.experts_beside_mlp:  # Gemma 4 26B-A4B
            return Block(config, rngs=rngs, kind=kind, experts=moe.BesideExperts(config, rngs=rngs))
        experts = moe.MoE(config, rngs=rngs) if config.n_experts else None
        if stack == "linear_blocks":
            return DeltaBlock(config, rngs=rngs, mlp=experts)
        latent = LatentAttention(config, rngs=rngs) if config.kv_lora_rank else None
        return Block(config, rngs=rngs, kind=kind, mlp=experts, attention=latent)

    return stacked(rngs)


def _lm_head(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Param:
    """An untied output projection [D, V]."""
    init = nnx.initializers.normal(INIT_STD)
    return nnx.Param(init(rngs.params(), (config.dim, config.vocab_size), jnp.float32))


def _scalar_head(config: ModelConfig, rngs: nnx.Rngs) -> nnx.Linear:
    """Reward/value head on one hidden state: kernel N(0, 1/(dim + 1)), bias 0, in fp32."""
    return nnx.Linear(
        config.dim,
        1,
        kernel_init=nnx.initializers.normal((config.dim + 1) ** -0.5),
        bias_init=nnx.initializers.zeros_init(),
        param_dtype=jnp.float32,
        rngs=rngs,
    )


class Transformer(nnx.Module):
    """Decoder: embeddings, scanned blocks, final norm, LM and scalar heads."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, scalar_head: bool = False):
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size,
            config.dim,
            dtype=config.compute_dtype,
            param_dtype=jnp.float32,
            embedding_init=nnx.initializers.normal(INIT_STD),
            rngs=rngs,
        )

        # Every stack of layer_kinds.STACKS as an attribute, None where the model has none.
        counts = layer_kinds.stack_counts(config)
        for stack in layer_kinds.STACKS:
            layers = _stack(config, stack, counts[stack], rngs) if stack in counts else None
            setattr(self, stack, layers)
        self.per_layer_inputs = (
            kind_scan.PerLayerEmbeddings(config, rngs=rngs) if config.per_layer_dim else None
        )
        self.final_norm = RMSNorm(config.dim, config)
        # Assigned once each: NNX fixes an attribute as data or static on first assignment.
        self.lm_head = None if config.tie_embeddings else _lm_head(config, rngs)
        self.scalar_head = _scalar_head(config, rngs) if scalar_head else None

    def _embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings in compute dtype, times sqrt(dim) for Gemma (rounded like HF's)."""
        x = self.embed(tokens)
        if self.config.embed_scale:
            x = x * jnp.asarray(self.config.dim**0.5, dtype=x.dtype)
        return x

    def _sliding_flags(self) -> jax.Array:
        """[L] bool: which scanned layers use the sliding window."""
        return jnp.asarray(self.config.sliding_layers(), dtype=bool)

    def __call__(
        self, tokens: jax.Array, mask: jax.Array, rotary: Rotary | None = None
    ) -> jax.Array:
        """Final-norm hidden states [B,T,D] (compute dtype) of ``tokens`` [B,T] under ``mask``.

        ``mask`` is 1 for real tokens and 0 for pads (left or right). Positions are
        cumsum(mask) - 1; attention is causal and never attends to pad keys. ``rotary``:
        :meth:`rotary` of this ``mask``, computed before (once for many passes), else here.
        """
        positions = positions_from_mask(mask)
        rotary = self.rotary(mask) if rotary is None else rotary
        allowed = causal_allowed(mask)
        window = sliding_allowed(self.config, allowed, positions, positions)
        if layer_kinds.uses_kinds(self.config):
            x, _ = self._kinds(tokens, mask, rotary, allowed, window)
            return self.final_norm(x)
        graphdef, layers = nnx.split(self.blocks)

        def layer(x: jax.Array, inputs: tuple[nnx.State, jax.Array]) -> tuple[jax.Array, None]:
            layer_params, is_sliding = inputs
            block = nnx.merge(graphdef, fsdp.gather(layer_params))
            x, _ = block(
                x, layer_rotary(rotary, is_sliding), layer_allowed(allowed, window, is_sliding)
            )
            return x, None

        # See the module's docstring. Sharded layers stay scanned: one whole at a time.
        unroll = self.config.remat == "none" and not fsdp.is_sharded(layers)
        if self.config.remat != "none":
            # prevent_cse=False: the scan already stops XLA from merging recomputation away.
            layer = jax.checkpoint(
                layer, policy=REMAT_POLICIES[self.config.remat], prevent_cse=False
            )
        x, _ = jax.lax.scan(
            layer, self._embed(tokens), (layers, self._sliding_flags()), unroll=unroll
        )
        return self.final_norm(x)

    def _kinds(self, tokens, mask, rotary, allowed, window, *, collect: bool = False):
        """A stack of several layer kinds (Qwen3.5, Gemma 4): kind_scan.scan over the
        embedded ``tokens`` and, for Gemma 4, their per-layer inputs."""
        x = self._embed(tokens)
        per_layer = None if self.per_layer_inputs is None else self.per_layer_inputs(tokens, x)
        return kind_scan.scan(self, x, mask, rotary, allowed, window, per_layer, collect=collect)

    def rotary(self, mask: jax.Array) -> Rotary:
        """The rotary tables (:func:`rotary_tables.rope_tables`) of the positions of ``mask``
        [..., T]."""
        return rope_tables(positions_from_mask(mask), self.config)

    def lm_logits(self, hidden: jax.Array) -> jax.Array:
        """Next-token logits [..., V] in float32 (fp32 accumulation of a compute-dtype matmul)."""
        return vocab_tiles.head_logits(vocab_tiles.head_of(self), hidden)

    def scalar(self, hidden: jax.Array, mask: jax.Array) -> jax.Array:
        """Scalar head (reward / value) [B] float32 on the hidden state of the last real token."""
        if self.scalar_head is None:
            raise ValueError("this Transformer was built without scalar_head=True")
        index = last_real_index(mask)
        last = jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]
        return self.scalar_head(last.astype(jnp.float32))[:, 0]

    def token_logprobs(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
        """log p(tokens[:, t+1] | tokens[:, :t+1]) as [B, T-1] float32 (pads not masked),
        a tile of logits at a time (``vocab_tiles``; ``ModelConfig.logits_tile``)."""
        hidden = self(tokens, mask)[:, :-1]
        head = vocab_tiles.head_of(self)
        return vocab_tiles.token_stats(
            head, hidden, tokens[:, 1:], tile=self.config.logits_tile
        ).logprobs

    def prefill(
        self, tokens: jax.Array, mask: jax.Array, cache_size: int
    ) -> tuple[jax.Array, KVCache]:
        """Run a prompt [B,P] and return its hidden states and a cache of ``cache_size`` slots."""
        batch, length = tokens.shape
        if cache_size < length:
            raise ValueError(f"cache_size ({cache_size}) must be >= prompt length ({length})")
        positions = positions_from_mask(mask)
        rotary = rope_tables(positions, self.config)
        allowed = causal_allowed(mask)
        delta: tuple[DeltaState, ...] = ()
        window = sliding_allowed(self.config, allowed, positions, positions)
        if layer_kinds.uses_kinds(self.config):
            x, (kvs, states) = self._kinds(tokens, mask, rotary, allowed, window, collect=True)
            k, v = [kv[0] for kv in kvs], [kv[1] for kv in kvs]
            delta = tuple(states)
        else:
            graphdef, layers = nnx.split(self.blocks)

            def layer(x: jax.Array, inputs: tuple[nnx.State, jax.Array]):
                layer_params, is_sliding = inputs
                block = nnx.merge(graphdef, fsdp.gather(layer_params))
                return block(
                    x, layer_rotary(rotary, is_sliding), layer_allowed(allowed, window, is_sliding)
                )

            x, (k, v) = jax.lax.scan(layer, self._embed(tokens), (layers, self._sliding_flags()))
        grow = cache_size - length

        def per_layer(stacked: Any, order: tuple[int, ...]) -> tuple[jax.Array, ...]:
            """[L,B,P,Kv,Hd] (or L such arrays) -> one [B,Kv,Hd,S] (k) or [B,Kv,S,Hd] (v)
            a layer."""
            pad = [(0, grow) if axis == 1 else (0, 0) for axis in order]
            return tuple(jnp.pad(one.transpose(order), pad) for one in stacked)

        cache = KVCache(
            k=per_layer(k, (0, 2, 3, 1)),
            v=per_layer(v, (0, 2, 1, 3)),
            key_mask=jnp.pad(mask.astype(bool), [(0, 0), (0, grow)]),
            next_position=jnp.sum(mask.astype(jnp.int32), axis=-1),
            length=jnp.asarray(length, jnp.int32),
            delta=delta,
        )
        return self.final_norm(x), cache

    def layer_params(self) -> tuple[nnx.State, ...]:
        """The stacked blocks' parameters one layer each (fsdp chunks stay chunks).

        The sampler's decode loop on CPU takes them split once, before it starts: sliced
        inside the loop, XLA:CPU copies every layer's weights each step. The split holds a
        second copy of the blocks' weights (this device's chunks under fsdp) while it runs.
        """
        return kind_scan.layer_params(self)

    def decode(
        self, tokens: jax.Array, cache: KVCache, layers: tuple[nnx.State, ...] | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Feed one token per sequence ([B] int32); returns its hidden state [B,D] and the cache.

        ``layers``: :meth:`layer_params`, split before the decode loop (split here if None).
        The layers run unrolled, each on its own cache array, written in place.
        """
        key_mask = jax.lax.dynamic_update_slice_in_dim(
            cache.key_mask, jnp.ones((tokens.shape[0], 1), bool), cache.length, axis=1
        )
        positions = cache.next_position[:, None]
        rotary = rope_tables(positions, self.config)
        allowed = key_mask[:, None, :]
        # Filled slots hold consecutive positions of real tokens, so cumsum recovers them.
        window = sliding_allowed(self.config, allowed, positions, positions_from_mask(key_mask))
        stacks = self.config.stack_places()
        graphdefs = {s: nnx.split(getattr(self, s))[0] for s, _ in dict(stacks).items()}
        x, keys, values, states = self._embed(tokens[:, None]), [], [], []
        per_layer = None
        if self.per_layer_inputs is not None:
            per_layer = self.per_layer_inputs(tokens[:, None], x)
        layers = self.layer_params() if layers is None else layers
        kv_cache, delta_cache = iter(zip(cache.k, cache.v, strict=True)), iter(cache.delta)
        stores = layer_kinds.store_layers(self.config) if self.config.kv_shared_layers else {}
        stored: dict[bool, tuple[jax.Array, jax.Array]] = {}
        real = jnp.ones((tokens.shape[0], 1), jnp.int32)
        for i, (params, sliding, (stack, _)) in enumerate(
            zip(layers, self.config.sliding_layers(), stacks, strict=True)
        ):
            # Sharded (fsdp): a layer is gathered after the last one ran, one whole at a time.
            block = nnx.merge(graphdefs[stack], fsdp.gather(fsdp.after(params, x)))
            if stack == "linear_blocks":
                x, state = block(x, real, next(delta_cache))
                states.append(state)
                continue
            layer_mask = layer_allowed(allowed, window, sliding)
            inputs = None if per_layer is None else per_layer[:, :, i]
            rotary_i = layer_rotary(rotary, sliding)
            if stack.startswith("shared_"):  # reads the storing layer's cache as it stands
                x, _ = block(x, rotary_i, layer_mask, stored[sliding], cache.length, inputs)
                continue
            kv = next(kv_cache)
            x, (k, v) = block(x, rotary_i, layer_mask, kv, cache.length, inputs)
            keys.append(k)
            values.append(v)
            if stores.get(sliding) == i:
                stored[sliding] = (k, v)
        cache = KVCache(
            k=tuple(keys),
            v=tuple(values),
            key_mask=key_mask,
            next_position=cache.next_position + 1,
            length=cache.length + 1,
            delta=tuple(states),
        )
        return self.final_norm(x)[:, 0], cache
