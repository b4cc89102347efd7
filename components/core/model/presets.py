"""Named model shapes: the tiny and demo configs of the tests and the local run, and the
published models' shapes the run presets and memory plans use (``model_config``)."""

from __future__ import annotations

import math
from typing import Any

from components.core.model.config import ModelConfig

# What every Gemma 4 layer does (components/hf/gemma4.py reads the same from a checkpoint).
GEMMA4_LAYERS: dict[str, Any] = dict(
    head_dim=256,
    global_head_dim=512,
    norm_eps=1e-6,
    mlp_activation="gelu_tanh",
    post_norms=True,
    embed_scale=True,
    qk_norm=True,
    v_norm=True,
    layer_scalar=True,
    query_pre_attn_scalar=1.0,
    final_logit_softcap=30.0,
    rope_theta=1_000_000.0,
    rope_local_theta=10_000.0,
    rope_proportional=True,
    rotary_fraction=0.25,
    dtype="bfloat16",
    remat="full",
)

# Shapes of published models (vocab_size is supplied by the tokenizer). max_seq_len bounds
# generation only: rotary positions have no table, so it can be raised freely.
PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: compiles in seconds.
    "tiny": dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=128),
    # Local CPU pipeline runs.
    "demo": dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=384, max_seq_len=512),
    # Qwen2.5-0.5B (vocab 151936: 4.94e8 params).
    "0.5b": dict(
        dim=896,
        n_layers=24,
        n_heads=14,
        n_kv_heads=2,
        hidden_dim=4864,
        max_seq_len=32768,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        qkv_bias=True,
        dtype="bfloat16",
        remat="full",
    ),  # fmt: skip
    # Llama-3.2-1B (vocab 128256: 1.24e9 params).
    "1b": dict(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        hidden_dim=8192,
        max_seq_len=131072,
        rope_theta=500000.0,
        rope_scaling_factor=32.0,
        dtype="bfloat16",
        remat="full",
    ),  # fmt: skip
    # Gemma-2-2B (vocab 256000: 2.61e9 params).
    "2b": dict(
        dim=2304,
        n_layers=26,
        n_heads=8,
        n_kv_heads=4,
        head_dim=256,
        hidden_dim=9216,
        max_seq_len=8192,
        norm_eps=1e-6,
        mlp_activation="gelu_tanh",
        norm_scale_offset=1.0,
        post_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=256.0,
        attn_logit_softcap=50.0,
        final_logit_softcap=30.0,
        sliding_window=4096,
        dtype="bfloat16",
        remat="full",
    ),  # fmt: skip
    # Qwen3.5-9B's language model (vocab 248320, untied head: 8.95e9 params): 24 Gated
    # DeltaNet layers (16 key and 32 value heads of 128) and 8 gated attention layers.
    "qwen3.5-9b": dict(
        dim=4096,
        n_layers=32,
        n_heads=16,
        n_kv_heads=4,
        head_dim=256,
        hidden_dim=12288,
        max_seq_len=262144,
        rope_theta=10_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        norm_scale_offset=1.0,
        attn_output_gate=True,
        rotary_fraction=0.25,
        layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 8,
        delta_key_heads=16,
        delta_value_heads=32,
        delta_key_dim=128,
        delta_value_dim=128,
        dtype="bfloat16",
        remat="full",
    ),  # fmt: skip
    # Qwen3-30B-A3B (vocab 151936, untied head: 30.53e9 params, 3.3e9 active): 48 layers,
    # each with 128 experts of width 768, 8 a token (core/model/moe.py).
    "qwen3-30b-a3b": dict(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=6144,  # its dense width, unused: every layer has experts
        max_seq_len=40960,
        rope_theta=1_000_000.0,
        norm_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        n_experts=128,
        experts_per_token=8,
        expert_dim=768,
        dtype="bfloat16",
        remat="full",
    ),  # fmt: skip
    # Gemma 4 E4B's language model (vocab 262144, tied: 7.46e9 params, 2.82e9 of them the
    # per-layer input table): 35 sliding layers (head 256) and 7 full ones (head 512),
    # five to one; the last 18 reuse the keys and values of layers 22 and 23.
    "gemma4-e4b": dict(
        **GEMMA4_LAYERS,
        dim=2560,
        n_layers=42,
        n_heads=8,
        n_kv_heads=2,
        hidden_dim=10240,
        max_seq_len=131072,
        sliding_window=512,
        layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 7,
        global_kv_heads=2,
        kv_shared_layers=18,
        per_layer_dim=256,
        per_layer_vocab=262144,
    ),  # fmt: skip
    # Gemma 4 31B's language model (vocab 262144, tied: 3.07e10 params): 50 sliding layers
    # (16 KV heads of 256) and 10 full ones (4 KV heads of 512, keys serving as values).
    "gemma4-31b": dict(
        **GEMMA4_LAYERS,
        dim=5376,
        n_layers=60,
        n_heads=32,
        n_kv_heads=16,
        hidden_dim=21504,
        max_seq_len=262144,
        sliding_window=1024,
        layer_types=(("sliding_attention",) * 5 + ("full_attention",)) * 10,
        global_kv_heads=4,
        global_k_eq_v=True,
    ),  # fmt: skip
    # Mistral Small 4 (vocab 131072, untied: 118.97e9 params): latent attention (query and
    # key-value latents of 1024 and 256, 64 of each head's 128 dims rotated), yarn 128x over
    # 8192 tokens with mscale_all_dim 1 (the softmax scale times 1.485², as the scalar 128 /
    # 1.485⁴), the query temperature past 8192; 128 experts, 4 a token, an ungated shared one.
    "mistral-small-4": dict(
        dim=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=32,
        head_dim=128,
        hidden_dim=12288,
        max_seq_len=1048576,
        norm_eps=1e-6,
        tie_embeddings=False,
        rotary_fraction=0.5,
        rope_yarn_factor=128.0,
        rope_original_max_len=8192,
        query_scale_beta=0.1,
        query_pre_attn_scalar=128 / (0.1 * math.log(128.0) + 1.0) ** 4,
        kv_lora_rank=256,
        q_lora_rank=1024,
        n_experts=128,
        experts_per_token=4,
        expert_dim=2048,
        shared_expert_dim=2048,
        shared_expert_gated=False,
        dtype="bfloat16",
        remat="full",
    ),  # fmt: skip
    # Llama-2-7B (vocab 32000, untied head: 6.74e9 params).
    "7b": dict(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        hidden_dim=11008,
        max_seq_len=4096,
        tie_embeddings=False,
        dtype="bfloat16",
        remat="full",
    ),  # fmt: skip
}


def model_config(preset: str, vocab_size: int, **overrides: Any) -> ModelConfig:
    """The named preset with ``vocab_size`` and any field overrides applied."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {sorted(PRESETS)}")
    fields = {**PRESETS[preset], "vocab_size": vocab_size, **overrides}
    return ModelConfig.from_dict(fields)
