"""A checkpoint's rotary embedding as ``ModelConfig`` fields: ``rope_parameters``
(transformers 5) or the older ``rope_theta`` and ``rope_scaling``, refusing what is not
modelled by name.

Modelled: plain rotary; ``linear`` scaling; Llama 3.1's ``llama3``; ``yarn`` (Ministral 3,
Devstral 2, and Qwen3 or Llama checkpoints configured for long context), with its
``attention_factor`` derived as transformers derives it; Ministral 3's query temperature
(``llama_4_scaling_beta``); Gemma 3's table per layer type; Qwen3.5's partial rotary.
Gemma 4's tables are read in gemma4.py.
"""

from __future__ import annotations

import math
from typing import Any

from components.hf.refusals import refuse

PLAIN_TABLE = ("llama", "mistral", "qwen2", "qwen3")
# Gemma3TextConfig.default_theta["global"]: the global layers' base when a config states none,
# and MixtralConfig.default_theta (every other family here defaults to 10,000).
GEMMA3_GLOBAL_THETA = 1_000_000.0
ARCHITECTURE_THETA = {"MixtralForCausalLM": 1_000_000.0}
ROPE_TYPES = {  # rope_type: families that model it
    "default": (*PLAIN_TABLE, "gemma2", "gemma3", "qwen3_5"),
    "linear": (*PLAIN_TABLE, "gemma2", "gemma3"),
    "llama3": ("llama",),
    "yarn": PLAIN_TABLE,
}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """transformers' ``yarn_get_mscale``: 0.1 · mscale · ln(factor) + 1 (1 for factor ≤ 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def original_context(rope: dict[str, Any], hf: dict[str, Any]) -> int:
    """The pretraining context a scaled table stretches, as transformers 5 standardises it: a
    top-level ``original_max_position_embeddings`` first (Phi-3 keeps it there), then the
    table's, then ``max_position_embeddings``."""
    top = hf.get("original_max_position_embeddings")
    return int(
        top
        or rope.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings", 8192)
    )


def yarn_fields(rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """The yarn table's fields, as transformers' ``_compute_yarn_parameters`` reads them:
    ``factor`` (or max_position_embeddings / original_max_position_embeddings when null),
    ``attention_factor`` (or the ratio of ``mscale`` and ``mscale_all_dim``'s scales when
    both are set and non-zero, else the scale of the factor), ``beta_fast`` and
    ``beta_slow`` (32 and 1 when unset or 0), ``truncate`` (true)."""
    original = original_context(rope, hf)
    factor = rope.get("factor")
    factor = float(hf.get("max_position_embeddings", 8192) / original if factor is None else factor)
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention = yarn_mscale(factor)
    return dict(
        rope_yarn_factor=factor,
        rope_yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
        rope_yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
        rope_yarn_truncate=bool(rope.get("truncate", True)),
        rope_attention_factor=float(attention),
        rope_original_max_len=original,
    )


def rope_table(rope: dict[str, Any], family: str, hf: dict[str, Any]) -> dict[str, Any]:
    """One rotary table's ModelConfig fields from its parameters, refusing unmodelled types."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    refuse(
        family not in ROPE_TYPES.get(rope_type, ()),
        f"rope_type {rope_type!r} for {family}; alignpipe models plain rotary, linear "
        "scaling, Llama 3.1's 'llama3' (Llama only) and 'yarn' (Llama, Mistral, Qwen2, Qwen3)",
    )
    partial = float(rope.get("partial_rotary_factor", 1.0))
    latent = hf.get("model_type") == "mistral4"  # the rotated part of latent attention's heads
    refuse(
        partial != 1.0 and family != "qwen3_5" and not latent,
        f"partial rotary embeddings for {family}",
    )
    architectures = hf.get("architectures") or []
    stated = next((ARCHITECTURE_THETA[a] for a in architectures if a in ARCHITECTURE_THETA), 1e4)
    default_theta = float(hf.get("rope_theta", stated))
    fields: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta", default_theta))}
    if partial != 1.0:
        fields["rotary_fraction"] = partial
    if rope_type == "linear":
        fields["rope_linear_factor"] = float(rope["factor"])
    if rope_type == "llama3":
        fields.update(
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_len=original_context(rope, hf),
        )
    if rope_type == "yarn":
        fields.update(yarn_fields(rope, hf))
    beta = float(rope.get("llama_4_scaling_beta") or 0.0)
    # Ministral 3's query temperature, past its original context only. transformers reads it
    # for ``ministral3`` alone: a Mistral's attention never does, so neither does its import.
    if beta and hf.get("model_type") != "mistral":
        refuse(
            hf.get("model_type") not in ("ministral3", "mistral4"),
            f"llama_4_scaling_beta for {family} (Ministral 3's and Mistral 4's query "
            "temperature, read for model_type ministral3 and mistral4)",
        )
        fields.update(query_scale_beta=beta, rope_original_max_len=original_context(rope, hf))
    return fields


def rope_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Rotary base and scaling from ``rope_parameters`` (v5) or the legacy keys; Gemma 3:
    the global table, and the sliding layers' own base."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    per_type = any(isinstance(v, dict) for v in rope.values())
    if family in ("qwen3", "qwen3_5"):
        # Text only, M-RoPE's three position streams (time, height, width) are one and the
        # same, so its sections rotate as 1-D rotary does: mrope_section is not needed
        # (Qwen3.5's, and Qwen3-VL's, read as a Qwen3).
        rope.pop("mrope_section", None), rope.pop("mrope_interleaved", None)
    if family == "qwen3_5":
        rope.setdefault("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    if family != "gemma3":
        refuse(per_type, f"rotary parameters per layer type for {family}")
        return rope_table(rope, family, hf)
    if per_type:  # transformers 5: {"full_attention": {...}, "sliding_attention": {...}}
        unknown = sorted(set(rope) - {"full_attention", "sliding_attention"})
        refuse(bool(unknown), f"rotary parameters for layer types {unknown}")
        full, local = dict(rope.get("full_attention") or {}), rope.get("sliding_attention") or {}
    else:  # 4.x: rope_theta and rope_scaling are the global layers', rope_local_base_freq
        full, local = dict(hf.get("rope_scaling") or {}), {"rope_type": "default"}
    full.setdefault("rope_theta", float(hf.get("rope_theta", GEMMA3_GLOBAL_THETA)))
    local_theta = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
    refuse(
        local.get("rope_type", "default") != "default" or "factor" in local,
        f"scaled rotary on Gemma 3's sliding layers ({local})",
    )
    return {**rope_table(full, family, hf), "rope_local_theta": local_theta}
