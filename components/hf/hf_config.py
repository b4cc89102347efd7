"""The ``config.json`` an export writes for each family: what transformers 5.x reads back as
the architecture alignpipe computed (the reverse of ``families.py``'s reading), and 4.4x too
for the architectures it has. Yarn tables are read as written from transformers 4.56 (earlier
versions put max_position_embeddings / original_max_position_embeddings in place of the
stated factor); ``Ministral3ForCausalLM``, Qwen3.5 (dense and MoE) and Gemma 4 exist in 5.x
only. A Qwen3-Next import is written as Qwen3.5 MoE here and made Qwen3-Next's again by
hf/qwen3_next.py.
"""

from __future__ import annotations

from typing import Any

from components.core.model.config import ModelConfig
from components.hf import gemma4, mistral4
from components.hf.families import GEMMAS, export_architecture


def _int_if_whole(value: float | None) -> int | float | None:
    # transformers' strict Gemma2Config types query_pre_attn_scalar as int.
    return int(value) if value is not None and float(value).is_integer() else value


def _layer_type_names(config: ModelConfig) -> list[str]:
    return [
        "sliding_attention" if sliding else "full_attention" for sliding in config.sliding_layers()
    ]


def _rope_parameters(config: ModelConfig) -> dict[str, Any]:
    """The global rotary table as ``rope_parameters`` describes it (transformers 5)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_linear_factor != 1.0:
        rope.update(rope_type="linear", factor=config.rope_linear_factor)
    if config.rope_scaling_factor is not None:
        rope.update(
            rope_type="llama3",
            factor=config.rope_scaling_factor,
            low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
            original_max_position_embeddings=config.rope_original_max_len,
        )
    if config.rope_yarn_factor is not None:  # attention_factor stated: read, not derived
        rope.update(
            rope_type="yarn",
            factor=config.rope_yarn_factor,
            original_max_position_embeddings=config.rope_original_max_len,
            beta_fast=config.rope_yarn_beta_fast,
            beta_slow=config.rope_yarn_beta_slow,
            attention_factor=config.rope_attention_factor,
        )
        if not config.rope_yarn_truncate:
            rope["truncate"] = False
    if config.query_scale_beta:
        rope.update(
            llama_4_scaling_beta=config.query_scale_beta,
            original_max_position_embeddings=config.rope_original_max_len,
        )
    return rope


def _gemma_fields(config: ModelConfig, family: str, rope: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar),
        attn_logit_softcapping=config.attn_logit_softcap,
        final_logit_softcapping=config.final_logit_softcap,
        sliding_window=config.sliding_window,
        layer_types=_layer_type_names(config) if config.sliding_window is not None else None,
        attention_bias=False,
    )
    if family == "gemma3":  # a table per layer type; 4.x reads the top-level fields
        local = config.rope_local_theta or config.rope_theta
        fields.update(
            rope_parameters={
                "full_attention": rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": local},
            },
            rope_local_base_freq=local,
            use_bidirectional_attention=False,
        )
        if rope["rope_type"] == "linear":
            fields["rope_scaling"] = {"rope_type": "linear", "factor": rope["factor"]}
    return fields


def _qwen3_5_fields(config: ModelConfig, rope: dict[str, Any]) -> dict[str, Any]:
    """Qwen3_5TextConfig's fields for a hybrid stack (Qwen3_5ForCausalLM reads them)."""
    return dict(
        hidden_act="silu",
        attention_bias=False,
        attn_output_gate=True,
        layer_types=list(config.layer_types),
        linear_conv_kernel_dim=config.delta_conv_kernel,
        linear_key_head_dim=config.delta_key_dim,
        linear_value_head_dim=config.delta_value_dim,
        linear_num_key_heads=config.delta_key_heads,
        linear_num_value_heads=config.delta_value_heads,
        rope_parameters={**rope, "partial_rotary_factor": config.rotary_fraction},
    )


def _expert_fields(config: ModelConfig, family: str) -> dict[str, Any]:
    """MixtralConfig's, Qwen2MoeConfig's, Qwen3MoeConfig's or Qwen3_5MoeTextConfig's experts
    (moe.py): every layer's."""
    common = dict(num_experts_per_tok=config.experts_per_token, output_router_logits=False)
    if family == "mistral":  # Mixtral: its experts are its MLPs, always renormalised
        return dict(
            common,
            num_local_experts=config.n_experts,
            intermediate_size=config.expert_dim,
            router_jitter_noise=0.0,
        )
    fields = dict(common, num_experts=config.n_experts, moe_intermediate_size=config.expert_dim)
    if family in ("qwen2", "qwen3"):
        fields.update(decoder_sparse_step=1, mlp_only_layers=[])
        fields["norm_topk_prob"] = config.norm_topk_prob
    if family != "qwen3":
        fields["shared_expert_intermediate_size"] = config.shared_expert_dim
    return fields


def hf_config_from_model(config: ModelConfig, family: str, token_ids: dict, dtype: str) -> dict:
    """An HF ``config.json`` for ``config`` that transformers 4.4x and 5.x both read."""
    architecture, model_type = export_architecture(config, family)
    hf: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.resolved_head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": dtype,
        "dtype": dtype,
        "rope_theta": config.rope_theta,
        **token_ids,
    }
    rope = _rope_parameters(config)
    if rope["rope_type"] != "default":
        hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    hf["rope_parameters"] = rope
    if family in GEMMAS:
        hf.update(_gemma_fields(config, family, rope))
    elif family in ("qwen2", "qwen3"):
        hf.update(hidden_act="silu", use_sliding_window=False, sliding_window=None)
        hf["layer_types"] = ["full_attention"] * config.n_layers
        if family == "qwen3":
            hf.update(attention_bias=False, max_window_layers=config.n_layers)
        elif config.resolved_head_dim == config.dim // config.n_heads:
            del hf["head_dim"]  # transformers 4.x Qwen2 derives it and has no such field
    elif family == "qwen3_5":
        hf.update(_qwen3_5_fields(config, rope))
    elif family == "gemma4":
        hf.update(gemma4.hf_text_fields(config))
        del hf["rope_theta"]
    elif family == "mistral" and config.kv_lora_rank:  # Mistral 4: its experts' fields too
        hf.update(mistral4.hf_fields(config))
        hf["rope_parameters"] = mistral4.rope_parameters(config, rope)
        hf.pop("rope_scaling", None)  # transformers 5 only: the older key would win over it
        return {k: v for k, v in hf.items() if v is not None or k == "q_lora_rank"}
    elif family == "mistral":
        hf.update(hidden_act="silu", sliding_window=config.sliding_window)
    else:
        hf.update(hidden_act="silu", attention_bias=False, mlp_bias=False)
    if config.n_experts and family != "gemma4":  # Gemma 4's are in its text fields
        hf.update(_expert_fields(config, family))
    return {k: v for k, v in hf.items() if v is not None or k == "sliding_window"}
