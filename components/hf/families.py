"""The supported Hugging Face families: config mapping both ways and tensor name maps.

Llama (3.x, incl. Llama 3.1 rotary scaling), Mistral (Llama's blocks, a sliding window on
every layer when set; Mistral 3's and Ministral 3's checkpoints in mistral3.py), Qwen2/2.5
(q/k/v biases), Qwen3 (per-head q/k norms), Gemma 2 ((1 + w) norms, post-norms,
soft-capping, scaled embeddings, GeGLU, query scalar, sliding window on alternate layers)
and Gemma 3 (Gemma 2's blocks with q/k norms, local and global layers in the config's
pattern, a rotary table per layer type) map onto ``ModelConfig`` fields; so do Qwen3.5's
hybrid stack and Gemma 4 (gemma4.py), Mixtral, Qwen2 MoE, Qwen3 MoE and Qwen3.5 MoE as those
families with experts (hf/moe.py), Qwen3-Next as a Qwen3.5 MoE (qwen3_next.py); rotary tables
in rotary.py. Gemma 3's, Mistral 3's, Qwen3-VL's, Qwen3.5's and Gemma 4's multimodal
checkpoints import their language model, text only. Anything else in a ``config.json``
that would change the computation is refused here, by name, with the reason: each family's
list is in ``REFUSALS`` (Gemma 4's in gemma4.py).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from components.core.model import layer_kinds
from components.core.model.config import ModelConfig
from components.hf import fp8, gemma4, mistral3, mistral4, moe, qwen3_5
from components.hf.refusals import HFImportError, Refusal, refuse
from components.hf.rotary import rope_fields
from components.hf.text_defaults import (
    GEMMA3_TEXT_DEFAULTS,
    QWEN3_5_MOE_TEXT_DEFAULTS,
    QWEN3_5_TEXT_DEFAULTS,
    QWEN3_NEXT_DEFAULTS,
    QWEN3_VL_MOE_TEXT_DEFAULTS,
    QWEN3_VL_TEXT_DEFAULTS,
)

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Ministral3ForCausalLM": "mistral",
    "Mistral3ForConditionalGeneration": "mistral",
    "Mistral4ForCausalLM": "mistral",  # latent attention and experts: mistral4.py
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3",  # its experts: moe.py
    "Qwen3VLForConditionalGeneration": "qwen3",  # Qwen3-VL's language model is a Qwen3
    "Qwen3VLMoeForConditionalGeneration": "qwen3",  # … a Qwen3 MoE
    "MixtralForCausalLM": "mistral",
    "Qwen2MoeForCausalLM": "qwen2",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "Qwen3NextForCausalLM": "qwen3_5",  # its fused DeltaNet projections: qwen3_next.py
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Gemma4UnifiedForCausalLM": "gemma4",  # Gemma 4 12B (gemma4.py)
    "Gemma4UnifiedForConditionalGeneration": "gemma4",
}
# What an export writes: Gemma 3's multimodal checkpoints come back as the text model.
FAMILY_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
}
MODEL_TYPES = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "gemma4": "gemma4_text"}
# Architectures met in the field that alignpipe does not model, and why.
REFUSED_ARCHITECTURES = {
    "Gemma3nForCausalLM": "Gemma 3n: per-layer embeddings and AltUp are not modelled",
    "Gemma3nForConditionalGeneration": "Gemma 3n: per-layer embeddings and AltUp are not modelled",
}
# The multimodal wrappers whose language model alignpipe reads (text only), per family.
MULTIMODAL = {
    "Mistral3ForConditionalGeneration": "mistral",
    "Qwen3VLForConditionalGeneration": "qwen3",
    "Qwen3VLMoeForConditionalGeneration": "qwen3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "Gemma4ForConditionalGeneration": "gemma4",
    "Gemma4UnifiedForConditionalGeneration": "gemma4",
}
# Multimodal checkpoints whose language model alignpipe reads: the name prefixes their
# language model's tensors carry (transformers 5, then 4.x), and the towers left out.
LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")
# Per family: tied embeddings when config.json does not say.
TIE_DEFAULT = {
    "llama": False,
    "mistral": False,
    "qwen2": False,
    "qwen3": True,
    "gemma2": True,
    "gemma3": True,
    "qwen3_5": False,
    "gemma4": True,
}
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
GEMMAS = ("gemma2", "gemma3")


def _truthy(value: Any) -> bool:
    return bool(value)


def _not_silu(value: Any) -> bool:
    return value not in (None, "silu")


_COMMON = [
    Refusal("quantization_config", fp8.refused, fp8.REFUSED),
    Refusal("mlp_bias", _truthy, "biases on the MLP projections"),
    Refusal("partial_rotary_factor", lambda v: v not in (None, 1, 1.0), "partial rotary"),
]
_SILU = [Refusal("hidden_act", _not_silu, "activations other than silu")]
_GEMMA = [
    Refusal("attention_bias", _truthy, "biases on the attention projections"),
    Refusal(
        "hidden_activation",
        lambda v: v is not None and v not in GEMMA_ACTIVATIONS,
        f"activations other than {GEMMA_ACTIVATIONS}",
    ),
    Refusal("use_bidirectional_attention", _truthy, "bidirectional attention (an encoder)"),
]
# Qwen MoE's options for layers without experts (their releases have none).
_EVERY_LAYER_SPARSE = [
    Refusal("mlp_only_layers", _truthy, "dense MLP layers among the experts' layers"),
    Refusal(
        "decoder_sparse_step",
        lambda v: v not in (None, 1),
        "experts on every n-th layer only (released Qwen MoE checkpoints: 1)",
    ),
]
# Every config field that changes the computation and is not read, per family, in one place.
REFUSALS: dict[str, list[Refusal]] = {
    "llama": [
        *_COMMON,
        *_SILU,
        Refusal("attention_bias", _truthy, "Llama with biases on the attention projections"),
    ],
    "mistral": [
        *_COMMON,
        *_SILU,
        Refusal("attention_bias", _truthy, "biases on the attention projections"),
    ],
    "qwen2": [
        *_COMMON,
        *_SILU,
        Refusal(
            "use_sliding_window",
            _truthy,
            "Qwen2's sliding window (released Qwen2/2.5 checkpoints set it false)",
        ),
        Refusal("qkv_bias", lambda v: v is not None and not v, "Qwen2 MoE without q/k/v biases"),
        *_EVERY_LAYER_SPARSE,
    ],
    "qwen3": [
        *_COMMON,
        *_SILU,
        Refusal("attention_bias", _truthy, "biases on the attention projections"),
        Refusal(
            "use_sliding_window",
            _truthy,
            "Qwen3's sliding window (released Qwen3 checkpoints set it false)",
        ),
        *_EVERY_LAYER_SPARSE,
    ],
    "gemma2": [*_COMMON, *_GEMMA],
    "gemma3": [*_COMMON, *_GEMMA],
    # Qwen3.5's partial rotary is modelled (rope_parameters.partial_rotary_factor), and its
    # multi-token-prediction head (mtp_*) is left out, as transformers leaves it out.
    "qwen3_5": [
        *_COMMON[:2],
        *_SILU,
        Refusal("attention_bias", _truthy, "biases on the attention projections"),
        Refusal(
            "attn_output_gate",
            lambda v: v is not None and not v,
            "full-attention layers without Qwen3.5's output gate",
        ),
        *_EVERY_LAYER_SPARSE,
        Refusal("use_sliding_window", _truthy, "a sliding window on the attention layers"),
    ],
}


def family_of_hf(hf: dict[str, Any]) -> str:
    """The family of an HF ``config.json``, or HFImportError naming what is supported."""
    architectures = hf.get("architectures") or []
    for arch in architectures:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    for arch in architectures:
        if arch in REFUSED_ARCHITECTURES:
            raise HFImportError(f"unsupported architecture {arch}: {REFUSED_ARCHITECTURES[arch]}")
    raise HFImportError(
        f"unsupported architecture {architectures or hf.get('model_type')!r}; alignpipe imports "
        f"{sorted(ARCHITECTURES)} (Llama 3.x, Mistral, Qwen2/2.5, Qwen3, Qwen3.5, Gemma 2, "
        "Gemma 3, Gemma 4)"
    )


def multimodal_family(hf: dict[str, Any]) -> str | None:
    """The family of the language model a multimodal checkpoint wraps (Gemma 3 4B+,
    Qwen3.5), or None for a causal LM's config."""
    if "text_config" not in hf:
        return None
    for arch in hf.get("architectures") or []:
        if arch in MULTIMODAL:
            return MULTIMODAL[arch]
    return None


def is_multimodal(hf: dict[str, Any]) -> bool:
    """Whether ``hf`` wraps a language model in a multimodal checkpoint."""
    return multimodal_family(hf) is not None


def language_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``hf`` itself, or a multimodal checkpoint's
    ``text_config`` with its text config class's defaults for the fields it leaves out."""
    family = multimodal_family(hf)
    if family is None:
        if "Gemma4UnifiedForCausalLM" in (hf.get("architectures") or []):
            return {**gemma4.unified_text(hf), "architectures": ["Gemma4ForCausalLM"]}
        if "Qwen3NextForCausalLM" in (hf.get("architectures") or []):
            return {**QWEN3_NEXT_DEFAULTS, **hf}
        if mistral4.is_mistral4(hf):
            return mistral4.filled(hf)
        return mistral3.ministral3_config(hf) if hf.get("model_type") == "ministral3" else hf
    if family == "mistral":
        return mistral3.text_config(hf)
    text = hf.get("text_config") or {}
    if family == "qwen3":  # Qwen3-VL: ties its head by the outer config's flag (default false)
        experts = moe.QWEN3_VL_MOE in hf.get("architectures", [])
        defaults = QWEN3_VL_MOE_TEXT_DEFAULTS if experts else QWEN3_VL_TEXT_DEFAULTS
        # Qwen3VLMoeTextConfig saves num_experts as num_local_experts (its attribute_map).
        text = {("num_experts" if k == "num_local_experts" else k): v for k, v in text.items()}
        text = {**defaults, **text, "tie_word_embeddings": hf.get("tie_word_embeddings", False)}
        if experts:  # its router always renormalises
            return {**text, "architectures": ["Qwen3MoeForCausalLM"], "norm_topk_prob": True}
        return {**text, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    if family == "qwen3_5":
        # Qwen3_5ForConditionalGeneration ties its head by the outer config's flag.
        tied = bool(hf.get("tie_word_embeddings", False))
        if "Qwen3_5MoeForConditionalGeneration" in hf.get("architectures", []):
            text = {**QWEN3_5_MOE_TEXT_DEFAULTS, **text, "tie_word_embeddings": tied}
            return {**text, "architectures": ["Qwen3_5MoeForCausalLM"]}
        text = {**QWEN3_5_TEXT_DEFAULTS, **text, "tie_word_embeddings": tied}
        return {**text, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
    if family == "gemma4":
        tied = bool(hf.get("tie_word_embeddings", True))  # Gemma4Config's own flag
        unified = "Gemma4UnifiedForConditionalGeneration" in hf.get("architectures", [])
        text = gemma4.unified_text(text) if unified else {**gemma4.TEXT_DEFAULTS, **text}
        text = {**text, "tie_word_embeddings": tied}
        return {**text, "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text"}
    text = {**GEMMA3_TEXT_DEFAULTS, **text}
    return {**text, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}


def _check_refusals(hf: dict[str, Any], family: str) -> None:
    for refusal in REFUSALS[family]:
        value = hf.get(refusal.field)
        refuse(
            refusal.refused(value),
            f"{refusal.field}={json.dumps(value)}: {refusal.reason} (not modelled for {family})",
        )


def _layer_types(hf: dict[str, Any], family: str) -> tuple[str, ...]:
    """Per layer sliding or full attention, from ``layer_types`` or the older fields."""
    n_layers = int(hf["num_hidden_layers"])
    if hf.get("layer_types") and family != "mistral":  # Mistral's window is every layer's
        types = tuple(hf["layer_types"])
        refuse(len(types) != n_layers, f"{len(types)} layer_types for {n_layers} layers")
        return types
    if family in GEMMAS:  # Gemma 2's alternation; Gemma 3's sliding_window_pattern (6)
        pattern = int(hf.get("sliding_window_pattern") or (2 if family == "gemma2" else 6))
        return tuple(
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
        )
    kind = "sliding_attention" if hf.get("sliding_window") else "full_attention"
    return (kind,) * n_layers  # Mistral: the window, when set, is every layer's


def _family_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The ModelConfig fields that differ by family, refusing unmodelled options."""
    if family == "gemma4":
        return gemma4.text_fields(hf)
    _check_refusals(hf, family)
    try:
        if mistral4.is_mistral4(hf):
            return mistral4.fields(hf)
        experts = moe.expert_fields(hf, family)
    except KeyError as missing:
        kind = "Mistral 4" if mistral4.is_mistral4(hf) else "MoE"
        raise HFImportError(f"config.json lacks {missing}, which a {kind} config has") from None
    if family == "qwen3_5":
        try:
            return {**qwen3_5.config_fields(hf), **experts}
        except KeyError as missing:
            raise HFImportError(
                f"config.json lacks {missing}, which a Qwen3.5 config has"
            ) from None
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3", "llama"):
        window = None  # Qwen: only with use_sliding_window (refused); Llama has none
    refuse(
        family == "gemma3" and window is None,
        "Gemma 3 with sliding_window=null (its local layers would attend globally)",
    )
    types = _layer_types(hf, family) if window is not None else ()
    refuse(
        family == "llama" and bool(hf.get("sliding_window")),
        "Llama with a sliding_window (a Mistral checkpoint saved as Llama?)",
    )
    fields: dict[str, Any] = {
        "sliding_window": None if window is None else int(window),
        "layer_types": types,
    }
    fields.update(experts)  # Mixtral's, Qwen2 MoE's, Qwen3 MoE's
    if family == "qwen2":
        fields["qkv_bias"] = True
    if family == "qwen3":
        fields["qk_norm"] = True
    if family not in GEMMAS:
        return fields
    if family == "gemma2" and types == _layer_types({"num_hidden_layers": len(types)}, family):
        fields["layer_types"] = ()  # the default alternation: sliding_window_pattern 2
    return dict(
        fields,
        mlp_activation="gelu_tanh",
        norm_scale_offset=1.0,
        post_norms=True,
        embed_scale=True,
        qk_norm=family == "gemma3",
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=hf.get("attn_logit_softcapping"),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        sliding_window_pattern=2,
    )


def model_config_from_hf(hf: dict[str, Any], *, dtype: str, remat: str = "full") -> ModelConfig:
    """Our ModelConfig for an HF ``config.json`` of a supported family (a multimodal
    checkpoint's: its language model's)."""
    family = family_of_hf(hf)
    hf = language_model_config(hf)
    try:
        dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        fields = dict(
            vocab_size=int(hf["vocab_size"]),
            dim=dim,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            # A MoE's dense width (Qwen3.5 MoE states none) is unused: its experts' is read.
            hidden_dim=int(hf.get("intermediate_size") or hf["moe_intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 8192)),
            head_dim=int(hf.get("head_dim") or dim // n_heads),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", moe.tied(hf, TIE_DEFAULT[family]))),
            dtype=dtype,
            remat=remat,
        )
    except KeyError as missing:
        raise HFImportError(f"config.json lacks {missing}, which a {family} config has") from None
    if family != "gemma4":  # its rotary tables are read per layer type with its fields
        fields.update(rope_fields(hf, family))
    fields.update(_family_fields(hf, family))
    try:
        return ModelConfig(**fields)
    except ValueError as bad:  # shapes that do not fit together (heads, KV heads, widths)
        raise HFImportError(f"config.json describes no model alignpipe can build: {bad}") from None


def _exportable_as(config: ModelConfig) -> list[str]:
    """The HF families whose architecture computes what ``config`` computes."""
    if config.experts_beside_mlp:  # Gemma 4 26B-A4B
        return ["gemma4"] if gemma4.is_gemma4(config) else []
    if config.kv_lora_rank:  # Mistral 4
        return ["mistral"] if mistral4.exportable(config) else []
    if config.n_experts:  # Mixtral, Qwen2 MoE, Qwen3 MoE or Qwen3.5 MoE
        return moe.exportable(config, _exportable_as(dataclasses.replace(config, **moe.NO_EXPERTS)))
    if gemma4.is_gemma4(config):
        return ["gemma4"]
    gemma4_only = (
        config.layer_scalar, config.per_layer_dim, config.kv_shared_layers, config.v_norm,
        config.rope_proportional, layer_kinds.split_global(config),
    )  # fmt: skip
    if any(gemma4_only):
        return []
    # Yarn is read by every plain-table family; the query temperature by Ministral 3 only.
    yarn = config.rope_yarn_factor is not None or config.query_scale_beta > 0
    if config.is_hybrid or config.attn_output_gate or config.rotary_fraction != 1.0:
        qwen3_5 = (
            config.is_hybrid
            and config.attn_output_gate
            and config.qk_norm
            and config.norm_scale_offset == 1.0
            and not (config.post_norms or config.embed_scale or config.qkv_bias)
            and config.mlp_activation == "silu"
            and config.query_pre_attn_scalar is None
            and config.attn_logit_softcap is None
            and config.final_logit_softcap is None
            and config.rope_scaling_factor is None
            and config.rope_linear_factor == 1.0
            and config.rope_local_theta is None
            and not yarn
        )
        return ["qwen3_5"] if qwen3_5 else []
    gemma = (
        config.norm_scale_offset == 1.0
        and config.post_norms
        and config.embed_scale
        and not config.qkv_bias
        and config.mlp_activation == "gelu_tanh"
        and config.rope_scaling_factor is None
        and not yarn
    )
    if gemma and config.qk_norm:
        return ["gemma3"] if config.sliding_window is not None else []
    if gemma:
        plain_rope = config.rope_local_theta is None and config.rope_linear_factor == 1.0
        return ["gemma2"] if plain_rope else []
    plain = (
        config.norm_scale_offset == 0.0
        and not config.post_norms
        and not config.embed_scale
        and config.mlp_activation == "silu"
        and config.query_pre_attn_scalar is None
        and config.attn_logit_softcap is None
        and config.final_logit_softcap is None
        and config.rope_local_theta is None
    )
    if not plain or (config.qkv_bias and config.qk_norm):
        return []
    scaled = config.rope_scaling_factor is not None
    every_layer_slides = config.sliding_window is not None and all(config.sliding_layers())
    if config.query_scale_beta:  # Ministral3ForCausalLM: its window, if any, on every layer
        windowed = config.sliding_window is not None and not every_layer_slides
        return [] if scaled or config.qkv_bias or config.qk_norm or windowed else ["mistral"]
    if config.sliding_window is not None:
        return ["mistral"] if every_layer_slides and not config.qkv_bias else []
    if config.qkv_bias:
        return [] if scaled else ["qwen2"]
    if config.qk_norm:
        return [] if scaled else ["qwen3"]
    return ["llama"] if scaled else ["llama", "mistral"]


def export_architecture(config: ModelConfig, family: str) -> tuple[str, str]:
    """The architecture and model_type an export of ``config`` as ``family`` writes: the
    family's, or Ministral 3's for a Mistral with a query temperature."""
    if family == "mistral" and config.kv_lora_rank:
        return mistral4.ARCHITECTURE, "mistral4"
    if family == "mistral" and config.query_scale_beta:
        return "Ministral3ForCausalLM", "ministral3"
    if config.n_experts and family in moe.MOE_EXPORT:  # Gemma 4's experts stay Gemma 4's
        return moe.MOE_EXPORT[family]
    return FAMILY_ARCHITECTURE[family], MODEL_TYPES.get(family, family)


def family_of_config(config: ModelConfig, prefer: str = "") -> str:
    """Which HF family a ModelConfig exports as: its variation fields decide; where two
    families compute the same (Llama and Mistral), ``prefer`` (the imported family) does."""
    families = _exportable_as(config)
    if not families:
        raise ValueError(
            "this model's configuration mixes family features no Hugging Face architecture "
            f"has ({config}); export supports the {sorted(FAMILY_ARCHITECTURE)} layouts"
        )
    return prefer if prefer in families else families[0]
