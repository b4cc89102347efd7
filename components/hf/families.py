"""The supported Hugging Face families: config mapping both ways and tensor name maps.

Llama (3.x, incl. Llama 3.1 rotary scaling), Qwen2/2.5 (q/k/v biases) and Gemma 2
((1 + w) norms, post-norms, soft-capping, scaled embeddings, GeGLU, query scalar,
sliding window on alternate layers) map onto ``ModelConfig`` fields; anything
else in a checkpoint's ``config.json`` that would change the computation is
refused here, by name, rather than silently ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from components.core.model.config import ModelConfig

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma2ForCausalLM": "gemma2",
}
FAMILY_ARCHITECTURE = {family: arch for arch, family in ARCHITECTURES.items()}
# Per family: tied embeddings when config.json does not say, and the rotary base default.
TIE_DEFAULT = {"llama": False, "qwen2": False, "gemma2": True}
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


class HFImportError(ValueError):
    """A Hugging Face checkpoint alignpipe cannot import, with the reason and the fix."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """One HF tensor and its place in our params: ``path`` in the pure dict, ``layer`` index."""

    hf_name: str
    path: tuple[str, ...]
    transpose: bool
    layer: int | None = None


def family_of_hf(hf: dict[str, Any]) -> str:
    """The family of an HF ``config.json``, or HFImportError naming what is supported."""
    architectures = hf.get("architectures") or []
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise HFImportError(
        f"unsupported architecture {architectures or hf.get('model_type')!r}; alignpipe imports "
        f"{sorted(ARCHITECTURES)} (Llama 3.x, Qwen2/2.5, Gemma 2)"
    )


def _refuse(condition: bool, what: str) -> None:
    if condition:
        raise HFImportError(f"unsupported checkpoint: {what}")


def _rope_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """Rotary base and Llama 3.1 scaling from ``rope_parameters`` (v5) or the legacy keys."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    _refuse(
        any(isinstance(v, dict) for v in rope.values()),
        "rotary parameters per layer type (as in Gemma 3) are not modelled",
    )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    _refuse(
        rope_type not in ("default", "llama3") or (rope_type == "llama3" and family != "llama"),
        f"rope_type {rope_type!r}; alignpipe models plain rotary and Llama 3.1's 'llama3' scaling",
    )
    _refuse(float(rope.get("partial_rotary_factor", 1.0)) != 1.0, "partial rotary embeddings")
    fields: dict[str, Any] = {"rope_theta": theta}
    if rope_type == "llama3":
        fields.update(
            rope_scaling_factor=float(rope["factor"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
        )
    return fields


def _family_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelConfig fields that differ by family, refusing unmodelled options."""
    _refuse("quantization_config" in hf, "quantized weights (quantization_config)")
    if family in ("llama", "qwen2"):
        _refuse(hf.get("hidden_act", "silu") != "silu", f"hidden_act {hf.get('hidden_act')!r}")
        _refuse(bool(hf.get("mlp_bias")), "mlp_bias=true")
    if family == "llama":
        _refuse(bool(hf.get("attention_bias")), "Llama with attention_bias=true")
        return {}
    if family == "qwen2":
        _refuse(
            bool(hf.get("use_sliding_window")),
            "Qwen2 with use_sliding_window=true (released Qwen2/2.5 checkpoints set it false)",
        )
        return {"qkv_bias": True}
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    _refuse(activation not in GEMMA_ACTIVATIONS, f"Gemma 2 activation {activation!r}")
    _refuse(bool(hf.get("attention_bias")), "Gemma 2 with attention_bias=true")
    _refuse(bool(hf.get("use_bidirectional_attention")), "bidirectional attention")
    n_layers = int(hf["num_hidden_layers"])
    expected = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    layer_types = hf.get("layer_types") or expected
    window = hf.get("sliding_window")
    _refuse(
        layer_types != expected and window is not None,
        f"layer_types {layer_types}; alignpipe models Gemma 2's alternation (even layers slide)",
    )
    return dict(
        mlp_activation="gelu_tanh",
        norm_scale_offset=1.0,
        post_norms=True,
        embed_scale=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        sliding_window=None if window is None else int(window),
        sliding_window_pattern=2,
    )


def model_config_from_hf(hf: dict[str, Any], *, dtype: str, remat: str = "full") -> ModelConfig:
    """Our ModelConfig for an HF ``config.json`` of a supported family."""
    family = family_of_hf(hf)
    try:
        dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        fields = dict(
            vocab_size=int(hf["vocab_size"]),
            dim=dim,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            hidden_dim=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 8192)),
            head_dim=int(hf.get("head_dim") or dim // n_heads),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", TIE_DEFAULT[family])),
            dtype=dtype,
            remat=remat,
        )
    except KeyError as missing:
        raise HFImportError(f"config.json lacks {missing}, which a {family} config has") from None
    fields.update(_rope_fields(hf, family))
    fields.update(_family_fields(hf, family))
    return ModelConfig(**fields)


def family_of_config(config: ModelConfig) -> str:
    """Which HF family a ModelConfig exports as (its variation fields decide)."""
    if config.norm_scale_offset == 1.0 and config.post_norms and config.embed_scale:
        if not config.qkv_bias and config.mlp_activation == "gelu_tanh":
            if config.rope_scaling_factor is None and config.sliding_window_pattern == 2:
                return "gemma2"
    plain = (
        config.norm_scale_offset == 0.0
        and not config.post_norms
        and not config.embed_scale
        and config.mlp_activation == "silu"
        and config.query_pre_attn_scalar is None
        and config.attn_logit_softcap is None
        and config.final_logit_softcap is None
        and config.sliding_window is None
    )
    if plain and config.qkv_bias and config.rope_scaling_factor is None:
        return "qwen2"
    if plain and not config.qkv_bias:
        return "llama"
    raise ValueError(
        "this model's configuration mixes family features no Hugging Face architecture has "
        f"({config}); export supports Llama, Qwen2 and Gemma 2 layouts"
    )


def tensor_specs(config: ModelConfig, family: str) -> list[TensorSpec]:
    """Every HF tensor of ``family`` for ``config`` and where it goes in our params."""
    specs = [
        TensorSpec("model.embed_tokens.weight", ("embed", "embedding"), False),
        TensorSpec("model.norm.weight", ("final_norm", "scale"), False),
    ]
    if not config.tie_embeddings:
        specs.append(TensorSpec("lm_head.weight", ("lm_head",), True))
    # Gemma 2 names its pre-MLP norm pre_feedforward_layernorm and uses
    # post_attention_layernorm for the attention output; Llama/Qwen2 use it pre-MLP.
    norms = {"input_layernorm": "attn_norm"}
    if family == "gemma2":
        norms.update(
            post_attention_layernorm="post_attn_norm",
            pre_feedforward_layernorm="mlp_norm",
            post_feedforward_layernorm="post_mlp_norm",
        )
    else:
        norms["post_attention_layernorm"] = "mlp_norm"
    linears = {
        "self_attn.q_proj": ("attn", "wq"),
        "self_attn.k_proj": ("attn", "wk"),
        "self_attn.v_proj": ("attn", "wv"),
        "self_attn.o_proj": ("attn", "wo"),
        "mlp.gate_proj": ("mlp", "w_gate"),
        "mlp.up_proj": ("mlp", "w_up"),
        "mlp.down_proj": ("mlp", "w_down"),
    }
    for i in range(config.n_layers):
        prefix = f"model.layers.{i}."
        for hf_norm, ours in norms.items():
            specs.append(
                TensorSpec(f"{prefix}{hf_norm}.weight", ("blocks", ours, "scale"), False, i)
            )
        for hf_linear, ours in linears.items():
            path = ("blocks", *ours)
            specs.append(TensorSpec(f"{prefix}{hf_linear}.weight", (*path, "kernel"), True, i))
            if config.qkv_bias and hf_linear[-6:] in ("q_proj", "k_proj", "v_proj"):
                specs.append(TensorSpec(f"{prefix}{hf_linear}.bias", (*path, "bias"), False, i))
    return specs


def _int_if_whole(value: float | None) -> int | float | None:
    # transformers' strict Gemma2Config types query_pre_attn_scalar as int.
    return int(value) if value is not None and float(value).is_integer() else value


def hf_config_from_model(config: ModelConfig, family: str, token_ids: dict, dtype: str) -> dict:
    """An HF ``config.json`` for ``config`` that transformers 4.4x and 5.x both read."""
    hf: dict[str, Any] = {
        "architectures": [FAMILY_ARCHITECTURE[family]],
        "model_type": family,
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
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling_factor is not None:
        rope.update(
            rope_type="llama3",
            factor=config.rope_scaling_factor,
            low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
            original_max_position_embeddings=config.rope_original_max_len,
        )
        hf["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    hf["rope_parameters"] = rope
    if family == "gemma2":
        hf.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar),
            attn_logit_softcapping=config.attn_logit_softcap,
            final_logit_softcapping=config.final_logit_softcap,
            sliding_window=config.sliding_window,
            layer_types=[
                "sliding_attention" if sliding else "full_attention"
                for sliding in config.sliding_layers()
            ]
            if config.sliding_window is not None
            else None,
        )
    elif family == "qwen2":
        hf.update(hidden_act="silu", use_sliding_window=False, sliding_window=None)
        hf["layer_types"] = ["full_attention"] * config.n_layers
        if config.resolved_head_dim == config.dim // config.n_heads:
            del hf["head_dim"]  # transformers 4.x Qwen2 derives it and has no such field
    else:
        hf.update(hidden_act="silu", attention_bias=False, mlp_bias=False)
    return {k: v for k, v in hf.items() if v is not None or k == "sliding_window"}
