"""The text configs' class defaults of the multimodal families, from transformers' own
configuration classes: a checkpoint's ``text_config`` leaves out the fields that equal them.
"""

# Gemma3TextConfig's defaults: a multimodal checkpoint's text_config leaves out the fields
# that equal them (Gemma 3 4B's has no vocab_size), and they are what it means.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# Qwen3_5TextConfig's defaults (Qwen3.5-9B's shape), for the fields a text_config leaves out.
QWEN3_5_TEXT_DEFAULTS = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
# Qwen3_5MoeTextConfig's (Qwen3.5-35B-A3B's shape): where they differ from the dense ones,
# and its experts; no intermediate_size (every layer has experts).
QWEN3_5_MOE_TEXT_DEFAULTS = {
    **{k: v for k, v in QWEN3_5_TEXT_DEFAULTS.items() if k != "intermediate_size"},
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
# Qwen3VLTextConfig's defaults, for the fields a Qwen3-VL text_config leaves out.
QWEN3_VL_TEXT_DEFAULTS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
}
# Qwen3NextConfig's defaults (Qwen3-Next-80B-A3B's shape), for the fields its config.json
# leaves out (head_dim is 256, not hidden_size / heads).
QWEN3_NEXT_DEFAULTS = {
    **QWEN3_5_TEXT_DEFAULTS,
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
# Qwen3VLMoeTextConfig's (its head_dim, when left out, is hidden_size / heads, as the import
# derives it: no default here).
QWEN3_VL_MOE_TEXT_DEFAULTS = {
    **{k: v for k, v in QWEN3_VL_TEXT_DEFAULTS.items() if k != "head_dim"},
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_experts": 60,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 1408,
}
