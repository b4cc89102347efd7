"""Qwen3.5's hybrid stack (``Qwen3_5ForCausalLM``, its multimodal and MoE checkpoints) as
``ModelConfig`` fields: its Gated DeltaNet layers and gated attention (families.py reads the
rest, hf/moe.py its experts)."""

from __future__ import annotations

from typing import Any

from components.hf.refusals import refuse


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's hybrid stack: Gated DeltaNet layers where ``layer_types`` (or the interval
    of full-attention layers) says, and its gated, q/k-normed, partially rotated attention."""
    n_layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types") or [
        "linear_attention"
        if (i + 1) % int(hf.get("full_attention_interval", 4))
        else "full_attention"
        for i in range(n_layers)
    ]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    refuse(bool(unknown), f"Qwen3.5 layer types {unknown}")
    refuse(len(types) != n_layers, f"{len(types)} layer_types for {n_layers} layers")
    return dict(
        layer_types=tuple(types),
        qk_norm=True,
        norm_scale_offset=1.0,
        attn_output_gate=True,
        delta_key_heads=int(hf["linear_num_key_heads"]),
        delta_value_heads=int(hf["linear_num_value_heads"]),
        delta_key_dim=int(hf["linear_key_head_dim"]),
        delta_value_dim=int(hf["linear_value_head_dim"]),
        delta_conv_kernel=int(hf["linear_conv_kernel_dim"]),
    )
