"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", ICLR 2025): Qwen3.5's
linear-attention layers.

Each value head keeps a state ``S`` [Dk, Dv]. Per token, with its key ``k`` and query ``q``
L2-normed, its decay ``a = exp(g)`` and its write strength ``beta``::

    S = a·S + beta·k ⊗ (v − a·Sᵀk)        (the gated delta rule)
    o = Sᵀq / sqrt(Dk)

Training and prefill run the chunked parallel form transformers' torch reference
(``torch_chunk_gated_delta_rule``) and FLA's kernels use: within a chunk of C tokens the
updates are condensed by the WY/UT transform (the inverse of a unit-lower-triangular matrix,
the keys' decayed Gram matrix, :func:`unit_lower_inverse`) into matrix products, and a
``lax.scan`` carries ``S`` from chunk to chunk, so a sequence of T tokens costs T/C
sequential steps of [C, C] and [C, D] matmuls.
Decoding applies the rule one token at a time to the state the sampler carries
(:func:`recurrent_step`), beside the depthwise causal conv's last ``kernel - 1`` inputs.

Pads: the layer's input is zeroed at pad positions (as transformers does), and there the
decay is 1 and the write 0, so a pad leaves the state as it was. Left pads, the sampler's,
give exactly transformers' result.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.model.config import ModelConfig
from components.core.model.layers import GatedMLP, RMSNorm, dense, on_rows

L2_EPS = 1e-6  # transformers' and FLA's l2norm epsilon
F32 = jnp.float32  # the rule's dtype (tests raise it to float64 to measure rounding)


class DeltaState(NamedTuple):
    """A DeltaNet layer's decoding state: the conv's last inputs and the recurrent state."""

    conv: jax.Array  # [B, kernel - 1, conv channels], compute dtype
    recurrent: jax.Array  # [B, value heads, Dk, Dv] float32


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def causal_conv(window: jax.Array, weight: jax.Array, length: int) -> jax.Array:
    """Depthwise causal conv1d then silu: ``window`` [B, K-1+T, C] (K-1 earlier inputs,
    then T new), ``weight`` [C, 1, K] (torch's layout) -> [B, T, C] float32."""
    kernel = weight.shape[-1]
    out = sum(window[:, j : j + length].astype(F32) * weight[:, 0, j] for j in range(kernel))
    return jax.nn.silu(out)


INVERSE_BLOCK = 16  # rows inverted by substitution at once; larger blocks are merged


def _substitute(strict: jax.Array) -> jax.Array:
    """(I + strict)⁻¹ of strictly lower-triangular [..., n, n], a row at a time: row i of
    the inverse is e_i − A[i]·(I + A)⁻¹, whose rows above i are already final."""
    size = strict.shape[-1]
    eye = jnp.eye(size, dtype=strict.dtype)

    def row(i: int, inverse: jax.Array) -> jax.Array:
        new = eye[i] - jnp.einsum("...j,...jk->...k", strict[..., i, :], inverse)
        return inverse.at[..., i, :].set(new)

    return jax.lax.fori_loop(1, size, row, jnp.broadcast_to(eye, strict.shape))


@jax.custom_vjp
def unit_lower_inverse(strict: jax.Array) -> jax.Array:
    """(I + strict)⁻¹ of strictly lower-triangular matrices [..., C, C].

    The diagonal blocks of INVERSE_BLOCK rows are inverted together by substitution, then
    merged in pairs up to C with matrix products: [[A, 0], [B, D]]⁻¹ = [[A⁻¹, 0],
    [−D⁻¹·B·A⁻¹, D⁻¹]]. At C = 64 this is 3x faster than substituting all 64 rows.

    Not ``lax.linalg.triangular_solve``: on XLA:CPU a 64-row solve under ``jax.pmap``, its
    gradient taken, hangs once two devices run it at once (measured: 2 devices, jax 0.10).
    The gradient is the inverse's own, d(T) = −T·d(A)·T: the loop is not differentiated.
    """
    size = strict.shape[-1]
    block = INVERSE_BLOCK
    count = size // block
    if size % block or count & (count - 1):  # not a power-of-two number of blocks
        return _substitute(strict)
    diagonal = [strict[..., i * block : (i + 1) * block, i * block : (i + 1) * block]
                for i in range(count)]  # fmt: skip
    inverse = _substitute(jnp.stack(diagonal, axis=-3))  # [..., count, block, block]
    while block < size:
        pairs = inverse.reshape(*inverse.shape[:-3], -1, 2, block, block)
        upper, lower = pairs[..., 0, :, :], pairs[..., 1, :, :]
        starts = range(0, size, 2 * block)  # each pair's first row and column
        below = jnp.stack(
            [strict[..., i + block : i + 2 * block, i : i + block] for i in starts], axis=-3
        )
        corner = -(lower @ below @ upper)
        top = jnp.concatenate([upper, jnp.zeros_like(upper)], axis=-1)
        inverse = jnp.concatenate([top, jnp.concatenate([corner, lower], axis=-1)], axis=-2)
        block *= 2
    return inverse[..., 0, :, :]


def _inverse_forward(strict: jax.Array) -> tuple[jax.Array, jax.Array]:
    inverse = unit_lower_inverse(strict)
    return inverse, inverse


def _inverse_backward(inverse: jax.Array, grad: jax.Array) -> tuple[jax.Array]:
    transposed = jnp.swapaxes(inverse, -1, -2)
    full = -(transposed @ grad @ transposed)
    return (jnp.tril(full, -1),)


unit_lower_inverse.defvjp(_inverse_forward, _inverse_backward)


def chunked_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a sequence, a chunk at a time (see the module docstring).

    q, k [B,T,H,Dk] (normed, q scaled), v [B,T,H,Dv], g (log decay) and beta [B,T,H], all
    float32, ``state`` [B,H,Dk,Dv]; returns the outputs [B,T,H,Dv] and the final state.
    """
    batch, length, heads, _ = k.shape
    pad = (-length) % chunk
    n = (length + pad) // chunk

    def chunks(x: jax.Array) -> jax.Array:  # [B,T,H,...] -> [N,B,H,C,...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, n, chunk, heads, *x.shape[3:])
        return jnp.moveaxis(x, (1, 2), (0, 3))

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # [N,B,H,C]: log of the decay since the chunk began
    lower = jnp.tril(jnp.ones((chunk, chunk), bool))
    # decay[i, j] = exp(cum_i - cum_j) for j <= i: what token j's write has decayed by at i.
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k * beta[..., None]
    gram = jnp.einsum("...id,...jd->...ij", k_beta, k) * decay
    # The UT transform: (I + strictly lower part of gram)⁻¹ applied to β·v and to the
    # decayed β·k (unit diagonal: the solve ignores gram's own diagonal).
    inverse = unit_lower_inverse(jnp.where(jnp.tril(lower, -1), gram, 0.0))
    values = inverse @ (v * beta[..., None])
    decayed_keys = inverse @ (k_beta * jnp.exp(cum)[..., None])
    inner = jnp.einsum("...id,...jd->...ij", q, k) * decay
    q = q * jnp.exp(cum)[..., None]
    k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def step(state: jax.Array, inputs: tuple[jax.Array, ...]):
        q, k, values, decayed_keys, inner, chunk_decay = inputs
        new = values - decayed_keys @ state
        out = q @ state + inner @ new
        return state * chunk_decay + jnp.swapaxes(k, -1, -2) @ new, out

    state, out = jax.lax.scan(step, state, (q, k, values, decayed_keys, inner, chunk_decay))
    out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(batch, n * chunk, heads, -1)
    return out[:, :length], state


def recurrent_step(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token of the rule: q, k [B,H,Dk], v [B,H,Dv], g and beta [B,H], state
    [B,H,Dk,Dv] (float32); returns the output [B,H,Dv] and the new state."""
    state = state * jnp.exp(g)[..., None, None]
    remembered = jnp.einsum("bhk,bhkv->bhv", k, state)
    state = state + k[..., :, None] * ((v - remembered) * beta[..., None])[..., None, :]
    return jnp.einsum("bhk,bhkv->bhv", q, state), state


class GatedDeltaNet(nnx.Module):
    """Qwen3.5's linear-attention mixer, with transformers' parameter names mapped in
    ``components/hf/families.py`` (``in_proj_qkv`` … ``out_proj``, ``conv1d``, ``A_log``)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dim = config.dim
        self.key_heads, self.value_heads = config.delta_key_heads, config.delta_value_heads
        self.key_dim, self.value_dim = config.delta_key_dim, config.delta_value_dim
        self.chunk, self.dtype, self.eps = config.delta_chunk, config.compute_dtype, config.norm_eps
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        channels = 2 * keys + values
        self.w_qkv = dense(dim, channels, config, rngs, target="in_proj_qkv")
        self.w_z = dense(dim, values, config, rngs, target="in_proj_z")
        self.w_b = dense(dim, self.value_heads, config, rngs, target="in_proj_b")
        self.w_a = dense(dim, self.value_heads, config, rngs, target="in_proj_a")
        kernel = config.delta_conv_kernel
        bound = kernel**-0.5  # torch's Conv1d default for a depthwise conv (fan-in = kernel)
        self.conv = nnx.Param(
            jax.random.uniform(rngs.params(), (channels, 1, kernel), F32, -bound, bound)
        )
        self.dt_bias = nnx.Param(jnp.ones((self.value_heads,), F32))
        # Decay rates A in [1, 16] (FLA's initialisation), stored as log A.
        rates = jax.random.uniform(rngs.params(), (self.value_heads,), F32, 1.0, 16.0)
        self.a_log = nnx.Param(jnp.log(rates))
        self.norm = nnx.Param(jnp.ones((self.value_dim,), F32))
        self.w_out = dense(values, dim, config, rngs, target="out_proj")

    def __call__(
        self, x: jax.Array, mask: jax.Array, state: DeltaState | None = None
    ) -> tuple[jax.Array, DeltaState]:
        """Mix ``x`` [B,T,D] (``mask`` [B,T]: 0 at pads); with ``state``, continue from it
        (decoding: T = 1). Returns the output [B,T,D] and the state after the last token."""
        batch, length, _ = x.shape
        kernel = self.conv.shape[-1]
        real = mask.astype(bool)
        x = jnp.where(real[..., None], x, 0).astype(x.dtype)
        mixed = on_rows(self.w_qkv, x)
        earlier = (
            jnp.zeros((batch, kernel - 1, mixed.shape[-1]), mixed.dtype)
            if state is None
            else state.conv
        )
        window = jnp.concatenate([earlier, mixed], axis=1)
        conv = causal_conv(window, self.conv[...], length).astype(self.dtype)
        keys = self.key_heads * self.key_dim
        q, k, v = jnp.split(conv, [keys, 2 * keys], axis=-1)
        group = self.value_heads // self.key_heads  # a key head serves consecutive value heads

        def heads(x: jax.Array, width: int, repeat: int = 1) -> jax.Array:
            x = x.reshape(batch, length, -1, width).astype(F32)
            return jnp.repeat(x, repeat, axis=2) if repeat > 1 else x

        q = _l2norm(heads(q, self.key_dim, group)) * self.key_dim**-0.5
        k = _l2norm(heads(k, self.key_dim, group))
        v = heads(v, self.value_dim)
        beta = jax.nn.sigmoid(on_rows(self.w_b, x).astype(F32))
        a = on_rows(self.w_a, x).astype(F32)
        g = -jnp.exp(self.a_log[...]) * jax.nn.softplus(a + self.dt_bias[...])
        g, beta = jnp.where(real[..., None], g, 0.0), jnp.where(real[..., None], beta, 0.0)
        recurrent = (
            jnp.zeros((batch, self.value_heads, self.key_dim, self.value_dim), F32)
            if state is None
            else state.recurrent
        )
        if state is not None and length == 1:
            out, recurrent = recurrent_step(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], recurrent
            )
            out = out[:, None]
        else:
            out, recurrent = chunked_delta_rule(q, k, v, g, beta, recurrent, self.chunk)
        z = on_rows(self.w_z, x).reshape(batch, length, self.value_heads, self.value_dim)
        out = self._gated_norm(out.astype(self.dtype), z)
        out = on_rows(self.w_out, out.reshape(batch, length, -1))
        return out, DeltaState(window[:, -(kernel - 1) :] if kernel > 1 else earlier, recurrent)

    def _gated_norm(self, out: jax.Array, z: jax.Array) -> jax.Array:
        """Each head's output RMS-normed (fp32 statistics), scaled, times silu(z)."""
        x = out.astype(F32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        x = self.norm[...].astype(self.dtype) * x.astype(self.dtype)
        return (x.astype(F32) * jax.nn.silu(z.astype(F32))).astype(self.dtype)


class DeltaBlock(nnx.Module):
    """A pre-norm decoder layer around :class:`GatedDeltaNet`: x + mixer(norm(x)), then
    x + mlp(norm(x)); the norms and the MLP are the attention layers' (layers.py), or
    ``mlp`` given (moe.py's experts)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mlp: nnx.Module | None = None):
        self.attn_norm = RMSNorm(config.dim, config)
        self.delta = GatedDeltaNet(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.dim, config)
        self.mlp = mlp if mlp is not None else GatedMLP(config, rngs=rngs)

    def __call__(
        self, x: jax.Array, mask: jax.Array, state: DeltaState | None = None
    ) -> tuple[jax.Array, DeltaState]:
        """Run the layer on ``x`` [B,T,D]; returns the new residual stream and the state."""
        out, state = self.delta(self.attn_norm(x), mask, state)
        x = x + out
        return x + self.mlp(self.mlp_norm(x)), state
