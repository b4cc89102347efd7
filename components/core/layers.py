"""Llama-style transformer layers: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

Parameter layouts follow the Hugging Face Llama checkpoints (kernels stored as
``[in, out]``, rotary embedding in the "rotate half" form), so real weights can
be loaded by transposing ``nn.Linear`` matrices and nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.model_config import ModelConfig

# Llama and Qwen2 initialise every matrix with N(0, 0.02); one place for that default.
INIT_STD = 0.02


def dense(in_features: int, out_features: int, config: ModelConfig, rngs: nnx.Rngs) -> nnx.Linear:
    """A bias-free projection with fp32 params that computes in the config's dtype."""
    return nnx.Linear(
        in_features,
        out_features,
        use_bias=False,
        dtype=config.compute_dtype,
        param_dtype=jnp.float32,
        kernel_init=nnx.initializers.normal(INIT_STD),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in fp32 (bf16 statistics drift), output in compute dtype."""

    def __init__(self, dim: int, config: ModelConfig):
        self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = config.norm_eps
        self.dtype = config.compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise the last axis and apply the learned scale."""
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...]).astype(self.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate ``x`` [B, T, N, Hd] by its ``positions`` [B, T] (HF "rotate half" layout)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, half]
    sin = jnp.sin(angles)[:, :, None, :]
    cos = jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """Grouped-query attention: q [B,T,H,Hd], k/v [B,S,Kv,Hd], allowed [B,T,S] -> [B,T,H,Hd]."""
    batch, length, n_heads, head_dim = q.shape
    n_kv = k.shape[2]
    # Each kv head serves n_heads // n_kv query heads; grouping avoids materialising repeats.
    q = q.reshape(batch, length, n_kv, n_heads // n_kv, head_dim) * (head_dim**-0.5)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    # A finite floor keeps fully masked rows (pad queries) finite instead of NaN.
    logits = jnp.where(allowed[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(batch, length, n_heads, head_dim)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary positions and an optional KV cache."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        head_dim = config.resolved_head_dim
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = head_dim
        self.rope_theta = config.rope_theta
        self.wq = dense(config.dim, config.n_heads * head_dim, config, rngs)
        self.wk = dense(config.dim, config.n_kv_heads * head_dim, config, rngs)
        self.wv = dense(config.dim, config.n_kv_heads * head_dim, config, rngs)
        self.wo = dense(config.n_heads * head_dim, config.dim, config, rngs)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        allowed: jax.Array,
        cache_kv: tuple[jax.Array, jax.Array] | None = None,
        cache_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attend from ``x`` [B,T,D]; returns the output and this call's new (k, v) [B,T,Kv,Hd].

        With ``cache_kv`` ([B,S,Kv,Hd] each), the new keys are written at ``cache_index``
        and the queries attend over the whole cache; ``allowed`` is then [B,T,S].
        """
        batch, length, _ = x.shape
        q = self.wq(x).reshape(batch, length, self.n_heads, self.head_dim)
        k = self.wk(x).reshape(batch, length, self.n_kv_heads, self.head_dim)
        v = self.wv(x).reshape(batch, length, self.n_kv_heads, self.head_dim)
        q = apply_rope(q, positions, self.rope_theta)
        k = apply_rope(k, positions, self.rope_theta)
        keys, values = k, v
        if cache_kv is not None:
            keys = jax.lax.dynamic_update_slice_in_dim(cache_kv[0], k, cache_index, axis=1)
            values = jax.lax.dynamic_update_slice_in_dim(cache_kv[1], v, cache_index, axis=1)
        out = attend(q, keys, values, allowed)
        return self.wo(out.reshape(batch, length, -1)), (k, v)


class SwiGLU(nnx.Module):
    """Gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.w_gate = dense(config.dim, config.hidden_dim, config, rngs)
        self.w_up = dense(config.dim, config.hidden_dim, config, rngs)
        self.w_down = dense(config.hidden_dim, config.dim, config, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the gated MLP."""
        return self.w_down(jax.nn.silu(self.w_gate(x)) * self.w_up(x))


class Block(nnx.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(config.dim, config)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.dim, config)
        self.mlp = SwiGLU(config, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        allowed: jax.Array,
        cache_kv: tuple[jax.Array, jax.Array] | None = None,
        cache_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Run the layer; returns the new residual stream and this call's (k, v)."""
        attn_out, kv = self.attn(self.attn_norm(x), positions, allowed, cache_kv, cache_index)
        x = x + attn_out
        x = x + self.mlp(self.mlp_norm(x))
        return x, kv
