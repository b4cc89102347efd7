"""Multi-head latent attention (MLA: DeepSeek-V2, 2024), as Mistral 4 computes it.

Keys and values come from one latent a token: ``wkv_a`` (HF ``kv_a_proj_with_mqa``) emits
``kv_lora_rank`` latent values and one rotary key part shared by every head; the latent,
RMS-normed (``kv_a_layernorm``), goes through ``wkv_b`` (``kv_b_proj``) to each head's
unrotated key part and its value. Queries go through a ``q_lora_rank`` latent too (``q_a_proj``,
``q_a_layernorm``, ``q_b_proj``; one ``q_proj`` without it). A head's query and key are its
unrotated part, then its rotated part (the last ``rotary_dim`` dims), as transformers'
``Mistral4Attention`` concatenates them.

Mistral 4's checkpoints store the rotated rows in interleaved pairs (``rope_interleave``);
the importer reorders them to the rotate-half form this module applies (hf/mistral4.py), so
the products ``q · k`` are the same numbers transformers computes.

The KV cache holds each head's expanded key and value, the layout of every other layer
(layers.attend): decoding is plain attention over them. Caching the latent instead would
hold (kv_lora_rank + rotary_dim) values a token where this holds 2 · heads · head_dim
(Mistral 4: 320 against 8,192); the planner counts the expanded cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.model.config import ModelConfig
from components.core.model.layers import RMSNorm, attend, dense, on_rows, write_cache
from components.core.model.rotary_tables import Rotary, apply_rope

# transformers' Mistral4RMSNorm default: the latents' norms do not read rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class LatentAttention(nnx.Module):
    """Causal latent attention with :class:`layers.Attention`'s call and KV cache."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dim, heads, head_dim = config.dim, config.n_heads, config.resolved_head_dim
        self.n_heads, self.head_dim, self.rotary = heads, head_dim, config.rotary_dim
        self.scale = (config.query_pre_attn_scalar or head_dim) ** -0.5
        rank = config.q_lora_rank
        if rank:
            self.wq_a = dense(dim, rank, config, rngs, target="q_a_proj")
            self.q_a_norm = RMSNorm(rank, config)
            self.q_a_norm.eps = LATENT_NORM_EPS
            self.wq_b = dense(rank, heads * head_dim, config, rngs, target="q_b_proj")
        else:
            self.wq = dense(dim, heads * head_dim, config, rngs, target="q_proj")
        latent = config.kv_lora_rank
        self.wkv_a = dense(dim, latent + self.rotary, config, rngs, target="kv_a_proj_with_mqa")
        self.kv_a_norm = RMSNorm(latent, config)
        self.kv_a_norm.eps = LATENT_NORM_EPS
        unrotated = head_dim - self.rotary
        self.wkv_b = dense(latent, heads * (unrotated + head_dim), config, rngs, target="kv_b_proj")
        self.wo = dense(heads * head_dim, dim, config, rngs, target="o_proj")

    def _queries(self, x: jax.Array) -> jax.Array:
        if self.config.q_lora_rank:
            return on_rows(lambda rows: self.wq_b(self.q_a_norm(self.wq_a(rows))), x)
        return on_rows(self.wq, x)

    def __call__(
        self,
        x: jax.Array,
        rotary: Rotary,
        allowed: jax.Array,
        cache_kv: tuple[jax.Array, jax.Array] | None = None,
        cache_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """As :meth:`layers.Attention.__call__`: the output and this call's (k, v)
        [B,T,H,Hd], or with ``cache_kv`` the cache with them written at ``cache_index``."""
        batch, length, _ = x.shape
        heads, head_dim, unrotated = self.n_heads, self.head_dim, self.head_dim - self.rotary
        sin, cos, *query_scale = rotary
        q = self._queries(x).reshape(batch, length, heads, head_dim)
        q = jnp.concatenate([q[..., :unrotated], apply_rope(q[..., unrotated:], (sin, cos))], -1)
        if query_scale:  # Mistral 4's temperature past the original context (llama_4_scaling)
            q = q * query_scale[0][:, :, None, None].astype(q.dtype)
        latent = on_rows(self.wkv_a, x)
        rank = self.config.kv_lora_rank
        shared = apply_rope(latent[..., None, rank:], (sin, cos))  # [B,T,1,R]: every head's
        kv = on_rows(self.wkv_b, self.kv_a_norm(latent[..., :rank]))
        kv = kv.reshape(batch, length, heads, unrotated + head_dim)
        shared = jnp.broadcast_to(shared, (batch, length, heads, self.rotary))
        k = jnp.concatenate([kv[..., :unrotated], shared.astype(kv.dtype)], axis=-1)
        v = kv[..., unrotated:]
        if cache_kv is None:
            out = attend(q, k, v, allowed, self.scale)
            return self._output(out), (k, v)
        k, v = write_cache(cache_kv, k, v, cache_index)
        out = attend(q, k, v, allowed, self.scale, heads_major=True)
        return self._output(out), (k, v)

    def _output(self, out: jax.Array) -> jax.Array:
        return on_rows(self.wo, out.reshape(*out.shape[:2], -1))
