"""Decoder layers: RMSNorm, grouped-query attention, gated MLP (rotary tables: rotary_tables.py).

Parameter layouts follow the Hugging Face checkpoints (kernels stored as
``[in, out]``, rotary embedding in the "rotate half" form), so real weights can
be loaded by transposing ``nn.Linear`` matrices and nothing else. The family
differences (Qwen2's q/k/v biases; Gemma 2's (1 + w) norms, extra post-norms, soft-capping,
query scalar and GeGLU) are fields of ``ModelConfig``; the defaults are Llama.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.model.config import ModelConfig
from components.core.model.layer_kinds import LayerKind, kind_of
from components.core.model.rotary_tables import Rotary, apply_rope

# Llama and Qwen2 initialise every matrix with N(0, 0.02); one place for that default.
INIT_STD = 0.02

ACTIVATIONS = {
    "silu": jax.nn.silu,
    # Gemma's gelu_pytorch_tanh is the tanh approximation of GELU.
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def dense(
    in_features: int,
    out_features: int,
    config: ModelConfig,
    rngs: nnx.Rngs,
    bias: bool = False,
    *,
    target: str,
) -> nnx.Linear:
    """A projection (bias only if asked) with fp32 params, computing in the config dtype.

    ``target`` is its Hugging Face name (``q_proj`` …); a targeted one carries an adapter.
    """
    kwargs = dict(
        use_bias=bias,
        dtype=config.compute_dtype,
        param_dtype=jnp.float32,
        kernel_init=nnx.initializers.normal(INIT_STD),
        rngs=rngs,
    )
    if config.lora_rank and target in config.lora_targets:
        return LoRADense(
            in_features, out_features, lora_rank=config.lora_rank, scale=config.lora_scale,
            **kwargs,
        )  # fmt: skip
    return nnx.Linear(in_features, out_features, **kwargs)


def on_rows(project: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """``project`` applied to ``x`` [..., in] as one [rows, in] matrix, reshaped back.

    The reshapes are free (bitcasts), and XLA:CPU's backward is faster: the weight-gradient
    dot wants the activation gradient transposed, and XLA:CPU transposes a [B, T, F] one
    inside the elementwise fusion that makes it, element by element (1.5 ms a layer for the
    demo MLP's [16, 48, 384] in the update's profile), but a [B·T, F] one as a matrix. The
    demo shape's PPO update: 506 → 402 ms (``bench_ppo_update.py --baseline 2af694d``).
    """
    return project(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


class LoRADense(nnx.LoRALinear):
    """Flax NNX's LoRALinear with PEFT's scale: ``x·W + b + (x·A·B)·alpha/rank``.

    ``nnx.LoRALinear`` adds ``x·A·B`` unscaled; the scale is what PEFT and the LoRA paper
    apply, so adapters move to and from PEFT unchanged. A starts as PEFT's (Kaiming-uniform,
    bound 1/sqrt(in)), B at zero: a fresh adapter leaves the projection as it was.
    """

    def __init__(self, in_features: int, out_features: int, *, scale: float, **kwargs):
        super().__init__(
            in_features,
            out_features,
            lora_dtype=kwargs["dtype"],
            a_initializer=nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
            **kwargs,
        )
        self.scale = scale

    def __call__(self, x: jax.Array) -> jax.Array:
        """The base projection plus the scaled adapter."""
        return nnx.Linear.__call__(self, x) + self.lora(x) * jnp.asarray(self.scale, x.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square norm computed in fp32 (bf16 statistics drift), output in compute dtype.

    The applied scale is ``norm_scale_offset + scale``: Gemma stores ``w`` and applies
    ``1 + w``, so its weights load unchanged; a fresh norm starts as the identity either way.
    """

    def __init__(self, dim: int, config: ModelConfig, *, scaled: bool = True):
        self.offset = config.norm_scale_offset
        # Gemma 4's value norm has no scale: it only normalises.
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - self.offset, jnp.float32)) if scaled else None
        self.eps = config.norm_eps
        self.dtype = config.compute_dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalise the last axis and apply the learned scale."""
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.eps)
        if self.scale is None:
            return x.astype(self.dtype)
        return (x * (self.offset + self.scale[...])).astype(self.dtype)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    allowed: jax.Array,
    scale: float,
    softcap: float | None = None,
    *,
    heads_major: bool = False,
) -> jax.Array:
    """Grouped-query attention: q [B,T,H,Hd], k/v [B,S,Kv,Hd], allowed [B,T,S] -> [B,T,H,Hd].

    ``heads_major``: k comes as [B,Kv,Hd,S] and v as [B,Kv,S,Hd], a KV cache's layout: per
    (batch, kv head) the products are then q [G·T,Hd] @ k [Hd,S] and p [G·T,S] @ v [S,Hd],
    plain matrix products on the cache where it lies. With k as [S,Hd] and v as [Hd,S] a
    decode step multiplied [S,Hd] @ [Hd,G] (G = 2 columns), slower on XLA:CPU: 1.50 → 1.35
    ms a step at ``benchmarks/bench_sampler.py``'s real shape, 16 sequences a device.
    """
    batch, length, n_heads, head_dim = q.shape
    n_kv = k.shape[1 if heads_major else 2]
    keys, values = ("bkds", "bksd") if heads_major else ("bskd", "bskd")
    group = n_heads // n_kv  # query heads per kv head: grouping avoids materialising repeats
    # A kv head's queries as one [G·T, Hd] matrix: every product is one matrix product per
    # (batch, kv head), whose operands XLA:CPU transposes as matrices. Grouped as
    # [B, T, Kv, G, Hd] the backward transposed 5-d arrays element by element (demo
    # attention forward and backward: 1.09 → 0.84 ms).
    q = q.reshape(batch, length, n_kv, group, head_dim) * scale
    q = q.transpose(0, 2, 3, 1, 4).reshape(batch, n_kv, group * length, head_dim)
    logits = jnp.einsum(f"bkqd,{keys}->bkqs", q, k, preferred_element_type=jnp.float32)
    logits = logits.reshape(batch, n_kv, group, length, -1)
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    # A finite floor keeps fully masked rows (pad queries) finite instead of NaN.
    logits = jnp.where(allowed[:, None, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    probs = probs.reshape(batch, n_kv, group * length, -1)
    out = jnp.einsum(f"bkqs,{values}->bkqd", probs, v)
    out = out.reshape(batch, n_kv, group, length, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, length, n_heads, head_dim)


def write_cache(
    cache_kv: tuple[jax.Array, jax.Array], k: jax.Array, v: jax.Array, index: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """A layer's cache (k [B,Kv,Hd,S], v [B,Kv,S,Hd]) with this call's k and v [B,T,Kv,Hd]
    written at slot ``index``, where they lie."""
    k = jax.lax.dynamic_update_slice_in_dim(cache_kv[0], k.transpose(0, 2, 3, 1), index, 3)
    v = jax.lax.dynamic_update_slice_in_dim(cache_kv[1], v.transpose(0, 2, 1, 3), index, 2)
    return k, v


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary positions and an optional KV cache.

    ``kind`` (layer_kinds.py) gives the layer's head width and KV heads (Gemma 4's full
    layers differ from its sliding ones), whether keys serve as values, and whether the
    layer owns keys and values or reuses those a storing layer computed.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, kind: LayerKind | None = None):
        kind = kind_of(config, kind)
        head_dim = kind.head_dim
        self.config = config
        self.n_heads = config.n_heads
        self.n_kv_heads = kind.n_kv_heads
        self.head_dim = head_dim
        self.scale = (config.query_pre_attn_scalar or head_dim) ** -0.5
        dim, n_heads, n_kv, qkv_bias = config.dim, config.n_heads, kind.n_kv_heads, config.qkv_bias
        # Qwen3.5's q_proj emits, per head, the queries then as many gate values.
        self.gated = config.attn_output_gate
        q_width = n_heads * head_dim * (2 if self.gated else 1)
        self.wq = dense(dim, q_width, config, rngs, qkv_bias, target="q_proj")
        owns, own_values = kind.owns_kv, kind.owns_kv and not kind.k_eq_v
        kv_width = n_kv * head_dim
        self.wk = dense(dim, kv_width, config, rngs, qkv_bias, target="k_proj") if owns else None
        self.wv = (
            dense(dim, kv_width, config, rngs, qkv_bias, target="v_proj") if own_values else None
        )
        self.wo = dense(n_heads * head_dim, dim, config, rngs, target="o_proj")
        # Qwen3 and Gemma 3 norm each head's queries and keys (one [head_dim] scale each).
        self.q_norm = RMSNorm(head_dim, config) if config.qk_norm else None
        self.k_norm = RMSNorm(head_dim, config) if config.qk_norm and owns else None
        # Gemma 4 normalises each head's values, without a scale.
        self.v_norm = RMSNorm(head_dim, config, scaled=False) if config.v_norm and owns else None

    def __call__(
        self,
        x: jax.Array,
        rotary: Rotary,
        allowed: jax.Array,
        cache_kv: tuple[jax.Array, jax.Array] | None = None,
        cache_index: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attend from ``x`` [B,T,D] at the positions of ``rotary`` (:func:`rope_tables`);
        returns the output and this call's (k, v) [B,T,Kv,Hd].

        With ``cache_kv`` (k [B,Kv,Hd,S], v [B,Kv,S,Hd]: :class:`KVCache`'s layout), the
        new keys are written at ``cache_index``, the queries attend over the whole cache
        (``allowed`` is then [B,T,S]), and the cache with the new keys is returned instead.

        A layer that reuses keys and values (Gemma 4's shared layers) takes them as
        ``cache_kv``: the storing layer's (k, v) [B,T,Kv,Hd], or with ``cache_index`` its
        cache, read and returned unchanged.
        """
        batch, length, _ = x.shape
        # Tables wider than this head's half (Gemma 4's full layers' are) are sliced to it.
        sin, cos, *query_scale = rotary
        rotary = (sin[..., : self.head_dim // 2], cos[..., : self.head_dim // 2])
        q = on_rows(self.wq, x).reshape(batch, length, self.n_heads, -1)
        gate = None
        if self.gated:
            q, gate = jnp.split(q, 2, axis=-1)
            gate = gate.reshape(batch, length, -1)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q, rotary)
        if query_scale:  # Ministral 3's temperature, after the rotation as transformers'
            q = q * query_scale[0][:, :, None, None].astype(q.dtype)  # rounded as theirs
        softcap = self.config.attn_logit_softcap
        if self.wk is None:  # keys and values of the storing layer
            k, v = cache_kv
            heads_major = cache_index is not None
            out = attend(q, k, v, allowed, self.scale, softcap, heads_major=heads_major)
            return self._output(out, gate), (k, v)
        k = on_rows(self.wk, x).reshape(batch, length, self.n_kv_heads, self.head_dim)
        v = k if self.wv is None else on_rows(self.wv, x).reshape(k.shape)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        k = apply_rope(k, rotary)
        if cache_kv is None:
            out = attend(q, k, v, allowed, self.scale, softcap)
            return self._output(out, gate), (k, v)
        k, v = write_cache(cache_kv, k, v, cache_index)
        out = attend(q, k, v, allowed, self.scale, softcap, heads_major=True)
        return self._output(out, gate), (k, v)

    def _output(self, out: jax.Array, gate: jax.Array | None) -> jax.Array:
        """The heads [B,T,H,Hd] joined, gated where the model gates them, projected."""
        out = out.reshape(*out.shape[:2], -1)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return on_rows(self.wo, out)


class GatedMLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU with silu, GeGLU with gelu_tanh."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, hidden_dim: int | None = None):
        hidden = hidden_dim or config.hidden_dim
        self.activation = config.mlp_activation
        self.w_gate = dense(config.dim, hidden, config, rngs, target="gate_proj")
        self.w_up = dense(config.dim, hidden, config, rngs, target="up_proj")
        self.w_down = dense(hidden, config.dim, config, rngs, target="down_proj")

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the gated MLP to ``x`` [..., dim], its rows as one matrix (:func:`on_rows`)."""

        def mlp(rows: jax.Array) -> jax.Array:
            return self.w_down(ACTIVATIONS[self.activation](self.w_gate(rows)) * self.w_up(rows))

        return on_rows(mlp, x)


class PerLayerInput(nnx.Module):
    """Gemma 4's per-layer input: x + norm(proj(act(gate(x)) * input)), ``input`` [B,T,P]
    this layer's slice of the per-layer embeddings (transformer.py)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.activation = config.mlp_activation
        dim, width = config.dim, config.per_layer_dim
        self.gate = dense(dim, width, config, rngs, target="per_layer_input_gate")
        self.project = dense(width, dim, config, rngs, target="per_layer_projection")
        self.norm = RMSNorm(dim, config)

    def __call__(self, x: jax.Array, per_layer: jax.Array) -> jax.Array:
        gated = ACTIVATIONS[self.activation](on_rows(self.gate, x)) * per_layer.astype(x.dtype)
        return x + self.norm(on_rows(self.project, gated))


class Block(nnx.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)).

    With ``post_norms`` (Gemma 2) each sub-layer's output is normed again before the add.
    Gemma 4 then adds its per-layer input and scales the layer's output by a fixed scalar
    (a checkpoint value transformers keeps as a buffer: its gradient is stopped here).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        kind: LayerKind | None = None,
        mlp: nnx.Module | None = None,
        experts: nnx.Module | None = None,
        attention: nnx.Module | None = None,
    ):
        """In place of the gated MLP ``mlp`` (moe.MoE), of :class:`Attention` ``attention``
        (LatentAttention); beside the MLP ``experts`` (moe.BesideExperts)."""
        kind = kind_of(config, kind)
        self.attn_norm = RMSNorm(config.dim, config)
        self.attn = attention if attention is not None else Attention(config, rngs=rngs, kind=kind)
        self.mlp_norm = RMSNorm(config.dim, config)
        self.mlp = (
            mlp if mlp is not None else GatedMLP(config, rngs=rngs, hidden_dim=kind.hidden_dim)
        )
        self.post_attn_norm = RMSNorm(config.dim, config) if config.post_norms else None
        self.post_mlp_norm = RMSNorm(config.dim, config) if config.post_norms else None
        self.experts = experts
        self.per_layer = PerLayerInput(config, rngs=rngs) if config.per_layer_dim else None
        self.scalar = nnx.Param(jnp.ones((1,), jnp.float32)) if config.layer_scalar else None

    def __call__(
        self,
        x: jax.Array,
        rotary: Rotary,
        allowed: jax.Array,
        cache_kv: tuple[jax.Array, jax.Array] | None = None,
        cache_index: jax.Array | None = None,
        per_layer: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Run the layer; returns the new residual stream and this call's (k, v), or with
        ``cache_kv`` the cache with them written (:meth:`Attention.__call__`).
        ``per_layer``: this layer's per-layer input [B,T,P] (Gemma 4)."""
        attn_out, kv = self.attn(self.attn_norm(x), rotary, allowed, cache_kv, cache_index)
        if self.post_attn_norm is not None:
            attn_out = self.post_attn_norm(attn_out)
        x = x + attn_out
        mlp_out = self.mlp(self.mlp_norm(x))
        if self.experts is not None:  # routed on the residual stream, beside the MLP
            mlp_out = self.experts(x, mlp_out)
        if self.post_mlp_norm is not None:
            mlp_out = self.post_mlp_norm(mlp_out)
        x = x + mlp_out
        if self.per_layer is not None:
            x = self.per_layer(x, per_layer)
        if self.scalar is not None:
            x = x * jax.lax.stop_gradient(self.scalar[...]).astype(x.dtype)
        return x, kv
