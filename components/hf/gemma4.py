"""Gemma 4 (text): its ``config.json`` read into ModelConfig fields, the fields refused, the
config an export writes back, and its per-layer tensor names.

Every field of ``Gemma4TextConfig`` that changes the computation is read or refused here:

- read: ``layer_types`` (the last layer forced to full attention, as transformers does),
  ``sliding_window``, ``head_dim`` and ``num_key_value_heads`` (sliding layers), the full
  layers' shapes from ``per_layer_config`` (transformers 5.2x) or ``global_head_dim`` and
  ``num_global_key_value_heads`` (the released configs; the latter only with
  ``attention_k_eq_v``, as transformers reads it), ``attention_k_eq_v``,
  ``num_kv_shared_layers``, ``use_double_wide_mlp``, ``hidden_size_per_layer_input``,
  ``vocab_size_per_layer_input``, ``rope_parameters`` per layer type (sliding: default;
  full: proportional or default), ``final_logit_softcapping``; and what every Gemma 4 layer
  does: q/k norms, an unscaled value norm, attention scale 1, post-norms, scaled
  embeddings, GeGLU, w (not 1 + w) norms, the per-layer output scalar;
- accepted: ``use_bidirectional_attention: "vision"`` (only image tokens attend both ways;
  a text-only run has none, so it is causal);
- read with ``enable_moe_block`` (26B-A4B): ``num_experts``, ``top_k_experts``,
  ``moe_intermediate_size``, experts beside each layer's MLP (core/model/moe.py);
- refused: ``use_bidirectional_attention: "all"``, ``attention_bias``,
  ``attention_dropout`` > 0, activations other than GELU-tanh, quantized weights but FP8, other
  rotary types, ``per_layer_config`` keys other than the two shapes, and full layers of
  different shapes;
- without effect on the computation: ``initializer_range``, ``use_cache``, the token ids
  (the tokenizer's and generation_config.json's are read), the expert fields without
  ``enable_moe_block`` (its layers build no experts then).
"""

from __future__ import annotations

import json
from typing import Any

from components.core.model import layer_kinds
from components.core.model.config import ModelConfig
from components.hf import fp8
from components.hf.refusals import HFImportError, Refusal, refuse

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# Gemma4TextConfig's class defaults (transformers 5.25), for the fields a multimodal
# checkpoint's text_config leaves out; global_head_dim is the default of its kwarg.
TEXT_DEFAULTS = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "global_head_dim": 512,
}
# Gemma 4 12B (``Gemma4UnifiedForConditionalGeneration``, ``Gemma4UnifiedForCausalLM``;
# transformers 5.25's gemma4_unified): Gemma 4's text layers without the per-layer inputs
# or the MoE block (its layer never builds them, whatever its config says), an encoder-free
# image and audio embedder beside them. Its text class's defaults differ in the window and
# the positions.
UNIFIED_IGNORED = ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block",
                   "num_experts", "top_k_experts", "moe_intermediate_size")  # fmt: skip
UNIFIED_TEXT_DEFAULTS = {
    **{k: v for k, v in TEXT_DEFAULTS.items() if k not in UNIFIED_IGNORED},
    "sliding_window": 1024,
    "max_position_embeddings": 262_144,
}
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}  # fmt: skip
REFUSALS = [
    Refusal("quantization_config", fp8.refused, fp8.REFUSED),
    Refusal("attention_bias", bool, "biases on the attention projections"),
    Refusal(
        "hidden_activation",
        lambda v: v is not None and v not in GELU_TANH,
        f"activations other than {GELU_TANH}",
    ),
    Refusal(
        "attention_dropout",
        lambda v: bool(v and float(v) > 0),
        "dropout on the attention weights (alignpipe trains without dropout)",
    ),
    Refusal(
        "use_bidirectional_attention",
        lambda v: v not in (None, "vision"),
        "bidirectional attention over every token (an encoder); 'vision' (image tokens "
        "only) is read, and a text-only run is causal",
    ),
]
SHAPE_KEYS = {"head_dim", "num_key_value_heads"}


def unified_text(text: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 4 12B text config as the Gemma 4 text config it computes as: its class's
    defaults filled in, the fields its layers never read dropped."""
    filled = {**UNIFIED_TEXT_DEFAULTS, **text}
    return {k: v for k, v in filled.items() if k not in UNIFIED_IGNORED}


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """Per layer sliding or full; the default 5:1 pattern, the last layer always full."""
    n_layers = int(hf["num_hidden_layers"])
    types = list(hf.get("layer_types") or [])
    if not types:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    refuse(len(types) != n_layers, f"{len(types)} layer_types for {n_layers} layers")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    refuse(bool(unknown), f"Gemma 4 layer types {unknown}")
    types[-1] = "full_attention"  # transformers forces it (with a warning)
    return types


def _full_shapes(hf: dict[str, Any], types: list[str], head: int, kv: int) -> tuple[int, int]:
    """The full-attention layers' head width and KV heads."""
    per_layer = hf.get("per_layer_config")
    if per_layer is None:  # the released configs: transformers' defaults for the kwargs
        kv_global = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
        return int(hf.get("global_head_dim", 512)), int(kv_global or kv)
    shapes = set()
    for i, kind in enumerate(types):
        override = per_layer.get(str(i), per_layer.get(i)) or {}
        unknown = sorted(set(override) - SHAPE_KEYS)
        refuse(bool(unknown), f"per_layer_config[{i}] fields {unknown}: only the head shape")
        shape = (int(override.get("head_dim", head)), int(override.get("num_key_value_heads", kv)))
        if kind == "sliding_attention":
            refuse(shape != (head, kv), f"per_layer_config[{i}] reshapes a sliding layer")
        else:
            shapes.add(shape)
    refuse(len(shapes) > 1, f"full-attention layers of different shapes {sorted(shapes)}")
    return shapes.pop() if shapes else (head, kv)


def _rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The sliding layers' plain table and the full layers' proportional one."""
    rope = hf.get("rope_parameters") or DEFAULT_ROPE
    unknown = sorted(set(rope) - set(DEFAULT_ROPE))
    refuse(bool(unknown), f"rotary parameters for layer types {unknown}")
    sliding = rope.get("sliding_attention") or DEFAULT_ROPE["sliding_attention"]
    full = rope.get("full_attention") or DEFAULT_ROPE["full_attention"]
    plain = sliding.get("rope_type", "default") == "default"
    refuse(
        not plain or "factor" in sliding or sliding.get("partial_rotary_factor", 1.0) != 1.0,
        f"scaled or partial rotary on Gemma 4's sliding layers ({json.dumps(sliding)})",
    )
    full_type = full.get("rope_type", "default")
    refuse(
        full_type not in ("default", "proportional"),
        f"rope_type {full_type!r} on Gemma 4's full layers; alignpipe models 'proportional' "
        "and 'default'",
    )
    fraction = float(full.get("partial_rotary_factor", 1.0)) if full_type != "default" else 1.0
    return dict(
        rope_theta=float(full.get("rope_theta", 1_000_000.0)),
        rope_local_theta=float(sliding.get("rope_theta", 10_000.0)),
        rope_proportional=True,
        rotary_fraction=fraction,
        rope_linear_factor=float(full.get("factor", 1.0)) if full_type != "default" else 1.0,
    )


def text_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 4 text config (module docstring)."""
    for refusal in REFUSALS:
        value = hf.get(refusal.field)
        refuse(
            refusal.refused(value),
            f"{refusal.field}={json.dumps(value)}: {refusal.reason} (not modelled for gemma4)",
        )
    try:
        types = _layer_types(hf)
        head, kv = int(hf.get("head_dim", 256)), int(hf.get("num_key_value_heads", 4))
        full_head, full_kv = _full_shapes(hf, types, head, kv)
        per_layer_dim = int(hf.get("hidden_size_per_layer_input") or 0)
        shared = int(hf.get("num_kv_shared_layers") or 0)
        fields = dict(
            layer_types=tuple(types),
            sliding_window=int(hf.get("sliding_window", 512)),
            global_head_dim=full_head,
            global_kv_heads=full_kv,
            global_k_eq_v=bool(hf.get("attention_k_eq_v", False)),
            v_norm=True,
            kv_shared_layers=shared,
            shared_mlp_factor=2 if hf.get("use_double_wide_mlp") and shared else 1,
            per_layer_dim=per_layer_dim,
            per_layer_vocab=int(hf.get("vocab_size_per_layer_input", 262_144))
            if per_layer_dim
            else 0,
            layer_scalar=True,
            mlp_activation="gelu_tanh",
            norm_scale_offset=0.0,
            post_norms=True,
            embed_scale=True,
            qk_norm=True,
            query_pre_attn_scalar=1.0,  # transformers' scaling = 1.0: q and k are normed
            final_logit_softcap=hf.get("final_logit_softcapping"),
            **_rope_fields(hf),
            **_expert_fields(hf),
        )
    except KeyError as missing:
        raise HFImportError(f"config.json lacks {missing}, which a Gemma 4 config has") from None
    refuse(
        shared >= int(hf["num_hidden_layers"]),
        f"num_kv_shared_layers={shared}: every layer reusing keys no layer computes",
    )
    return fields


def _expert_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """26B-A4B's experts beside each layer's MLP (moe.BesideExperts), with
    ``enable_moe_block``; its top k always renormalised."""
    if not hf.get("enable_moe_block"):
        return {}
    counts = {}
    for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if hf.get(name) is None:  # transformers saves the dense models' as null
            raise KeyError(name)
        counts[name] = int(hf[name])
    return dict(
        n_experts=counts["num_experts"],
        experts_per_token=counts["top_k_experts"],
        expert_dim=counts["moe_intermediate_size"],
        experts_beside_mlp=True,
    )


def is_gemma4(config: ModelConfig) -> bool:
    """Whether ``config`` computes what Gemma4ForCausalLM does."""
    return (
        config.layer_scalar
        and config.v_norm
        and config.rope_proportional
        and config.qk_norm
        and config.post_norms
        and config.embed_scale
        and config.norm_scale_offset == 0.0
        and config.mlp_activation == "gelu_tanh"
        and config.query_pre_attn_scalar == 1.0
        and config.attn_logit_softcap is None
        and config.rope_scaling_factor is None
        and config.sliding_window is not None
        and not (config.is_hybrid or config.qkv_bias or config.attn_output_gate)
        and config.shared_mlp_factor in (1, 2)
    )


def hf_text_fields(config: ModelConfig) -> dict[str, Any]:
    """Gemma4TextConfig's fields for ``config`` (the reverse of :func:`text_fields`)."""
    full = {"rope_type": "proportional", "partial_rotary_factor": config.rotary_fraction,
            "rope_theta": config.rope_theta}  # fmt: skip
    if config.rope_linear_factor != 1.0:
        full["factor"] = config.rope_linear_factor
    full_head = config.global_head_dim or config.resolved_head_dim
    full_kv = config.global_kv_heads or config.n_kv_heads
    types = ["sliding_attention" if s else "full_attention" for s in config.sliding_layers()]
    return dict(
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=False,
        sliding_window=config.sliding_window,
        layer_types=types,
        final_logit_softcapping=config.final_logit_softcap,
        attention_k_eq_v=config.global_k_eq_v,
        num_kv_shared_layers=config.kv_shared_layers,
        use_double_wide_mlp=config.shared_mlp_factor == 2,
        hidden_size_per_layer_input=config.per_layer_dim,
        vocab_size_per_layer_input=config.per_layer_vocab or config.vocab_size,
        enable_moe_block=config.experts_beside_mlp,
        num_experts=config.n_experts or None,
        top_k_experts=config.experts_per_token or None,
        moe_intermediate_size=config.expert_dim or None,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_theta},
            "full_attention": full,
        },
        # Both spellings: per_layer_config (transformers 5.2x) and the kwargs before it.
        global_head_dim=full_head,
        num_global_key_value_heads=full_kv,
        per_layer_config={
            str(i): {"head_dim": full_head, "num_key_value_heads": full_kv}
            for i, kind in enumerate(types)
            if kind == "full_attention"
        },
    )


def layer_tensors(config: ModelConfig, stack: str) -> dict[str, tuple[tuple[str, ...], bool]]:
    """A Gemma 4 layer's tensors (under model.layers.N.) in ``stack``: our path, transposed."""
    kind = layer_kinds.stack_kind(config, stack)
    linears = {"q_proj": "wq", "o_proj": "wo"}
    if kind.owns_kv:
        linears["k_proj"] = "wk"
        if not kind.k_eq_v:
            linears["v_proj"] = "wv"
    tensors = {
        f"self_attn.{hf}.weight": (("attn", ours, "kernel"), True) for hf, ours in linears.items()
    }
    norms = {
        "input_layernorm": ("attn_norm",),
        "post_attention_layernorm": ("post_attn_norm",),
        "pre_feedforward_layernorm": ("mlp_norm",),
        "post_feedforward_layernorm": ("post_mlp_norm",),
        "self_attn.q_norm": ("attn", "q_norm"),
    }
    if kind.owns_kv:
        norms["self_attn.k_norm"] = ("attn", "k_norm")
    tensors.update({f"{hf}.weight": ((*ours, "scale"), False) for hf, ours in norms.items()})
    for hf, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
        tensors[f"mlp.{hf}.weight"] = (("mlp", ours, "kernel"), True)
    if config.per_layer_dim:
        tensors.update({
            "per_layer_input_gate.weight": (("per_layer", "gate", "kernel"), True),
            "per_layer_projection.weight": (("per_layer", "project", "kernel"), True),
            "post_per_layer_input_norm.weight": (("per_layer", "norm", "scale"), False),
        })  # fmt: skip
    if config.experts_beside_mlp:
        tensors.update({
            "router.proj.weight": (("experts", "moe", "router", "kernel"), True),
            "router.scale": (("experts", "router_scale"), False),
            "router.per_expert_scale": (("experts", "expert_scale"), False),
            "pre_feedforward_layernorm_2.weight": (("experts", "pre_norm", "scale"), False),
            "post_feedforward_layernorm_2.weight": (("experts", "post_norm", "scale"), False),
            "post_feedforward_layernorm_1.weight": (("experts", "post_mlp_norm", "scale"), False),
        })  # fmt: skip
    tensors["layer_scalar"] = (("scalar",), False)
    return tensors


def expert_tensors(config: ModelConfig) -> list[tuple[str, tuple[str, ...], int]]:
    """26B-A4B's experts (under model.layers.N.), one name per expert as hf/moe.py reads its
    fused ``experts.gate_up_proj`` and ``experts.down_proj``: name, our path, expert."""
    return [
        (f"experts.{e}.{p}_proj.weight", ("experts", "moe", f"w_{p}"), e)
        for e in range(config.n_experts if config.experts_beside_mlp else 0)
        for p in ("gate", "up", "down")
    ]


def outer_tensors(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], bool]]:
    """The per-layer input embeddings' tensors outside the layers."""
    if not config.per_layer_dim:
        return {}
    return {
        "model.embed_tokens_per_layer.weight": (("per_layer_inputs", "table"), False),
        "model.per_layer_model_projection.weight": (
            ("per_layer_inputs", "project", "kernel"), True,
        ),
        "model.per_layer_projection_norm.weight": (("per_layer_inputs", "norm", "scale"), False),
    }  # fmt: skip
