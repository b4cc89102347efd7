"""Rotary positions: each model's frequency tables (plain, Llama 3.1's, linear, yarn, Gemma 3's
local table, Gemma 4's proportional one), their sin and cos at given positions, Ministral 3's
and Mistral 4's query temperature, and the rotation ("rotate half", as Hugging Face stores
the weights)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# config.py's ModelConfig (read, never imported: this module sits below it, as layer_kinds).
ModelConfig = Any


def rope_inv_freq(config: ModelConfig, *, local: bool = False) -> np.ndarray:
    """Rotary inverse frequencies [head_dim / 2] (fp32) of the global layers, with Llama
    3.1's or linear scaling if set; ``local``: of the sliding layers when they have their
    own base (Gemma 3's ``rope_local_base_freq``: plain, unscaled)."""
    half = config.rotary_dim // 2  # partial rotary (Qwen3.5): only the leading dims rotate
    exponents = np.arange(half, dtype=np.float32) / half
    if local and config.rope_local_theta is not None:
        return (1.0 / (config.rope_local_theta**exponents)).astype(np.float32)
    inv_freq = 1.0 / (config.rope_theta**exponents) / config.rope_linear_factor
    if config.rope_yarn_factor is not None:
        return yarn_inv_freq(inv_freq, config)
    if config.rope_scaling_factor is None:
        return inv_freq.astype(np.float32)
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    factor, low, high = (
        config.rope_scaling_factor,
        config.rope_low_freq_factor,
        config.rope_high_freq_factor,
    )
    old_len = config.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def yarn_inv_freq(inv_freq: np.ndarray, config: ModelConfig) -> np.ndarray:
    """YaRN (Peng et al. 2023) as transformers' ``_compute_yarn_parameters`` computes it: the
    dims that turn more than ``beta_fast`` times within the original context keep their
    frequency, those under ``beta_slow`` times are divided by the factor, a linear ramp
    between (its ends rounded outward when ``truncate``)."""
    dim, base = 2 * len(inv_freq), config.rope_theta
    original = config.rope_original_max_len

    def dim_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(config.rope_yarn_beta_fast), dim_of(config.rope_yarn_beta_slow)
    if config.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against 0 / 0
    ramp = np.clip((np.arange(len(inv_freq), dtype=np.float32) - low) / (high - low), 0, 1)
    kept = 1.0 - ramp
    interpolated = inv_freq / config.rope_yarn_factor
    return (interpolated * (1 - kept) + inv_freq * kept).astype(np.float32)


# (sin, cos) [B, T, K, head_dim / 2] float32: K = 1 table, or 2 when the sliding layers
# rotate with their own base (index 0 global, 1 local); ``layer_rotary`` picks a layer's.
# A model with a query temperature (Ministral 3) has a third member: the queries' scale
# [B, T] at each position (:func:`query_scale`).
Rotary = tuple[jax.Array, ...]


def proportional_inv_freq(config: ModelConfig) -> np.ndarray:
    """Gemma 4's full layers (rope_type "proportional"): [global head_dim / 2] frequencies,
    the first ``rotary_fraction`` of them ``theta ** (-2i / head_dim)`` (exponents over the
    whole head, not the rotated part), the rest 0: those pairs do not turn."""
    head_dim = config.global_head_dim or config.resolved_head_dim
    turning = int(config.rotary_fraction * head_dim // 2)
    exponents = np.arange(0, 2 * turning, 2, dtype=np.float32) / head_dim
    inv_freq = np.zeros(head_dim // 2, np.float32)
    inv_freq[:turning] = 1.0 / config.rope_theta**exponents
    return (inv_freq / config.rope_linear_factor).astype(np.float32)


def _inv_freq_tables(config: ModelConfig) -> np.ndarray:
    """[K, width]: the global frequencies, and the local ones when they differ. Tables of
    different widths (Gemma 4: full layers' heads twice as wide) are padded with zero
    frequencies; a layer takes its head's half (:meth:`Attention.__call__`)."""
    if config.rope_proportional:
        local = dataclasses.replace(config, rotary_fraction=1.0, rope_proportional=False)
        tables = [proportional_inv_freq(config), rope_inv_freq(local, local=True)]
    else:
        tables = [rope_inv_freq(config)]
        if config.rope_local_theta is not None:
            tables.append(rope_inv_freq(config, local=True))
    width = max(len(t) for t in tables)
    return np.stack([np.pad(t, (0, width - len(t))) for t in tables])


def rope_tables(positions: jax.Array, config: ModelConfig) -> Rotary:
    """sin and cos of ``positions`` [B, T] times the rotary frequencies, [B, T, K, half] each.

    Computed once per pass and given to every layer. A caller that runs many passes over
    the same rows (PPO's update: every epoch and minibatch) computes them once for all:
    XLA:CPU fuses them into each layer's rotation and evaluates sin and cos for every
    element of q and k (every head), which at the demo shape cost ~12% of the update.
    """
    frequencies = jnp.asarray(_inv_freq_tables(config))
    angles = positions[..., None, None].astype(jnp.float32) * frequencies
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    if config.rope_attention_factor != 1.0:  # yarn's scale on sin and cos (transformers')
        sin, cos = sin * config.rope_attention_factor, cos * config.rope_attention_factor
    if not config.query_scale_beta:
        return sin, cos
    return sin, cos, query_scale(positions, config)


def query_scale(positions: jax.Array, config: ModelConfig) -> jax.Array:
    """Ministral 3's query temperature at ``positions`` [..., T]: 1 + beta · log(1 +
    floor(p / rope_original_max_len)), 1 within the original context, at each token's
    position (as transformers 5.25 takes it, at ``position_ids``), so a row's result does
    not depend on its padding."""
    blocks = jnp.floor(positions.astype(jnp.float32) / config.rope_original_max_len)
    return 1.0 + config.query_scale_beta * jnp.log1p(blocks)


def layer_rotary(rotary: Rotary, is_sliding: jax.Array | bool) -> Rotary:
    """One layer's (sin, cos) [..., T, half]: the local table for a sliding layer when the
    model has two, else the one table (``is_sliding`` may be traced, inside a scan); a
    query scale, when there is one, as it is."""
    sin, cos, *scale = rotary
    if sin.shape[-2] == 1:
        return sin[..., 0, :], cos[..., 0, :], *scale
    index = jnp.asarray(is_sliding, jnp.int32)
    return jnp.take(sin, index, axis=-2), jnp.take(cos, index, axis=-2), *scale


def rotary_key(config: ModelConfig) -> str:
    """Names ``config``'s rotary tables: networks whose keys match share them."""
    key = "rotary-" + _inv_freq_tables(config).tobytes().hex()
    if config.rope_attention_factor == 1.0 and not config.query_scale_beta:
        return key
    scales = (config.rope_attention_factor, config.query_scale_beta, config.rope_original_max_len)
    return key + "-" + np.asarray(scales, np.float64).tobytes().hex()


def apply_rope(x: jax.Array, rotary: Rotary) -> jax.Array:
    """Rotate ``x`` [B, T, N, Hd] by its positions' ``rotary`` tables (HF "rotate half").

    Tables narrower than half a head (partial rotary) rotate its leading 2 × width dims and
    pass the rest through, as transformers' ``apply_rotary_pos_emb`` does.
    """
    sin, cos = (table[:, :, None, :] for table in rotary)
    width = 2 * sin.shape[-1]
    x1, x2 = jnp.split(x[..., :width].astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if width < x.shape[-1]:
        return jnp.concatenate([rotated.astype(x.dtype), x[..., width:]], axis=-1)
    return rotated.astype(x.dtype)
