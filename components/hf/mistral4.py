"""Mistral 4 (``mistral4``: Mistral Small 4, 119B with 6.5B active), read as the ``mistral``
family with latent attention and experts.

Its release is a ``Mistral3ForConditionalGeneration`` whose ``text_config`` is a
``mistral4`` (mistral3.py reads the wrapper); ``Mistral4ForCausalLM`` is the language model
alone, which an export writes. transformers' ``Mistral4Model`` is DeepSeek-V3's: multi-head
latent attention (core/model/latent_attention.py) with the rotary part of each head in
interleaved pairs (``rope_interleave``), yarn whose ``mscale_all_dim`` also scales the
softmax (``yarn_apply_mscale``: the scale is head_dim^-1/2 · mscale², imported as
``query_pre_attn_scalar``), Ministral 3's query temperature past the original context, and
on every layer 128 experts (4 a token, a softmax router whose top k is renormalised and
times ``routed_scaling_factor``) beside an ungated shared expert.

The interleaved rows (``q_b_proj``'s rotary rows of each head, ``kv_a_proj_with_mqa``'s
rotary rows) are read in the rotate-half order (even rows, then odd: transformers'
``apply_rotary_pos_emb_interleave`` pairs them so) and written back interleaved; the
products of queries and keys are unchanged. Not modelled, refused by name: dense layers
before the experts' (``first_k_dense_replace``), group-limited routing (``topk_group`` <
``n_group``), values of another width than the queries' (``v_head_dim``), biases.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from components.core.model.config import ModelConfig
from components.hf.refusals import refuse
from components.hf.rotary import yarn_mscale
from components.hf.safetensors_io import TensorInfo

ARCHITECTURE = "Mistral4ForCausalLM"
# Mistral4Config's class defaults (transformers 5.25: Mistral Small 4's), for the fields a
# text_config leaves out.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "n_shared_experts": 1,
    "n_routed_experts": 128,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 256,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 64,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 0,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_interleave": True,
    "attention_bias": False,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 128.0,
        "original_max_position_embeddings": 8192,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": 1.0,
        "mscale": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
}
# A layer's latent norms (under model.layers.N.self_attn.) and their place in LatentAttention;
# its projections' places are lora.TARGET_PATHS'.
LATENT_NORMS = {"q_a_layernorm": "q_a_norm", "kv_a_layernorm": "kv_a_norm"}


def is_mistral4(hf: dict[str, Any]) -> bool:
    """Whether ``hf`` (a language model's config, as families.py fills it) is Mistral 4's."""
    return hf.get("model_type") == "mistral4" or ARCHITECTURE in (hf.get("architectures") or [])


def filled(hf: dict[str, Any]) -> dict[str, Any]:
    """A ``mistral4`` config with Mistral4Config's defaults for what it leaves out: its
    rotary table is the older ``rope_scaling`` where given (it wins, as transformers 5
    converts it), else ``rope_parameters``, else the class's yarn table."""
    out = {**TEXT_DEFAULTS, **hf, "model_type": "mistral4"}
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or TEXT_DEFAULTS["rope_parameters"]
    out["rope_parameters"] = rope
    out.pop("rope_scaling", None)
    return out


def interleaved(hf: dict[str, Any]) -> bool:
    """Whether the checkpoint of ``hf`` (its outer config, a wrapper's included) stores its
    rotary rows in interleaved pairs (``rope_interleave``, true by default)."""
    text = hf.get("text_config") if "text_config" in hf else hf
    return bool(filled(text or {}).get("rope_interleave", True))


def softmax_mscale(rope: dict[str, Any]) -> float:
    """transformers' ``yarn_apply_mscale``: the softmax scale's factor, mscale(factor,
    mscale_all_dim)² for a scaled table with ``mscale_all_dim`` set, else 1."""
    all_dim = rope.get("mscale_all_dim") or 0
    if rope.get("rope_type", rope.get("type", "default")) == "default" or not all_dim:
        return 1.0
    return yarn_mscale(float(rope["factor"]), all_dim) ** 2


def fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Mistral 4's ModelConfig fields beyond the common ones (rotary: rotary.py), refusing
    what is not modelled. A KeyError names a field the config lacks."""
    rope, nope = int(hf["qk_rope_head_dim"]), int(hf["qk_nope_head_dim"])
    head_dim, values = rope + nope, int(hf["v_head_dim"])
    refuse(
        int(hf.get("first_k_dense_replace") or 0) > 0,
        f"first_k_dense_replace={hf.get('first_k_dense_replace')}: dense MLP layers before the "
        "experts' layers (Mistral Small 4 has none)",
    )
    groups, chosen = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    refuse(
        chosen < groups,
        f"n_group={groups}, topk_group={chosen}: group-limited routing (Mistral Small 4 routes "
        "over one group)",
    )
    refuse(
        values != head_dim,
        f"v_head_dim={values} against qk_nope_head_dim + qk_rope_head_dim = {head_dim}: values "
        "of another width than queries and keys (Mistral Small 4's are equal)",
    )
    refuse(bool(hf.get("attention_bias")), "attention_bias: biases on the latent projections")
    table = hf.get("rope_parameters") or {}
    rope_type = table.get("rope_type", table.get("type", "default"))
    refuse(
        rope_type != "yarn",
        f"rope_type {rope_type!r} for Mistral 4: transformers' Mistral4 rotates its "
        f"{rope}-dim part only with yarn's table (its {rope_type!r} table spans the whole head)",
    )
    width, shared = int(hf["moe_intermediate_size"]), int(hf.get("n_shared_experts") or 0)
    scale = softmax_mscale(dict(hf.get("rope_parameters") or {}))
    return dict(
        head_dim=head_dim,
        n_kv_heads=int(hf["num_attention_heads"]),  # each head its own key and value
        rotary_fraction=rope / head_dim,
        kv_lora_rank=int(hf["kv_lora_rank"]),
        q_lora_rank=int(hf.get("q_lora_rank") or 0),
        query_pre_attn_scalar=None if scale == 1.0 else head_dim / scale**2,
        n_experts=int(hf["n_routed_experts"]),
        experts_per_token=int(hf["num_experts_per_tok"]),
        expert_dim=width,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        shared_expert_dim=width * shared,
        shared_expert_gated=False,
        routed_scaling=float(hf.get("routed_scaling_factor") or 1.0),
    )


def _pairs_first(width: int) -> np.ndarray:
    """Interleaved pairs (x0, x1), (x2, x3) … to rotate-half order: even rows, then odd."""
    return np.concatenate([np.arange(0, width, 2), np.arange(1, width, 2)])


def rotary_rows(config: ModelConfig) -> dict[str, np.ndarray]:
    """Per interleaved projection (its name's ending): the stored row each of our rows is."""
    head, rope = config.resolved_head_dim, config.rotary_dim
    within = np.concatenate([np.arange(head - rope), head - rope + _pairs_first(rope)])
    queries = np.concatenate([h * head + within for h in range(config.n_heads)])
    latent = config.kv_lora_rank
    keys = np.concatenate([np.arange(latent), latent + _pairs_first(rope)])
    name = "q_b_proj" if config.q_lora_rank else "q_proj"
    return {f"self_attn.{name}.weight": queries, "self_attn.kv_a_proj_with_mqa.weight": keys}


def deinterleave(infos: dict[str, TensorInfo], config: ModelConfig) -> dict[str, TensorInfo]:
    """``infos`` with each interleaved projection read in rotate-half order (``rows``)."""
    rows = rotary_rows(config)
    out = {}
    for name, info in infos.items():
        order = next((r for end, r in rows.items() if name.endswith(end)), None)
        if order is None or len(info.shape) != 2 or info.shape[0] != len(order):
            out[name] = info  # a shape the config does not describe: refused by the checks
            continue
        out[name] = dataclasses.replace(info, rows=tuple(int(i) for i in order))
    return out


def interleave(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """An export's projections back in the checkpoint's interleaved order (the inverse)."""
    out = dict(tensors)
    for end, order in rotary_rows(config).items():
        for name in [n for n in tensors if n.endswith(end)]:
            stored = np.empty_like(tensors[name])
            stored[order] = tensors[name]
            out[name] = stored
    return out


def hf_fields(config: ModelConfig) -> dict[str, Any]:
    """Mistral4Config's fields for an export of ``config`` (its common ones: hf_config.py)."""
    rope = config.rotary_dim
    shared = config.shared_expert_dim // config.expert_dim
    return dict(
        hidden_act="silu",
        attention_bias=False,
        q_lora_rank=config.q_lora_rank or None,
        kv_lora_rank=config.kv_lora_rank,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=config.resolved_head_dim - rope,
        v_head_dim=config.resolved_head_dim,
        n_routed_experts=config.n_experts,
        num_experts_per_tok=config.experts_per_token,
        moe_intermediate_size=config.expert_dim,
        n_shared_experts=shared,
        routed_scaling_factor=config.routed_scaling,
        norm_topk_prob=config.norm_topk_prob,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        rope_interleave=True,
    )


def rope_parameters(config: ModelConfig, rope: dict[str, Any]) -> dict[str, Any]:
    """The export's yarn table with ``mscale_all_dim`` giving back the softmax scale
    (:func:`softmax_mscale`) and the rotated share of each head."""
    out = {**rope, "partial_rotary_factor": config.rotary_fraction}
    # Mistral4Attention reads the temperature's beta whatever it is: 0 where there is none.
    out.setdefault("llama_4_scaling_beta", 0.0)
    out.setdefault("original_max_position_embeddings", config.rope_original_max_len)
    if config.query_pre_attn_scalar is not None:
        refuse(
            config.rope_yarn_factor is None or config.rope_yarn_factor <= 1,
            "a Mistral 4 export with a softmax scale but no yarn factor > 1 to carry it",
        )
        mscale = (config.resolved_head_dim / config.query_pre_attn_scalar) ** 0.25
        out["mscale_all_dim"] = (mscale - 1.0) / (0.1 * math.log(config.rope_yarn_factor))
    return out


def exportable(config: ModelConfig) -> bool:
    """Whether ``Mistral4ForCausalLM`` computes ``config`` (a latent-attention model)."""
    shared = config.shared_expert_dim
    return (
        config.n_experts > 0
        and not config.experts_beside_mlp
        and (not shared or (shared % config.expert_dim == 0 and not config.shared_expert_gated))
        and config.norm_scale_offset == 0.0
        and not (config.post_norms or config.embed_scale or config.per_layer_dim)
        and config.mlp_activation == "silu"
        and config.attn_logit_softcap is None
        and config.final_logit_softcap is None
        and config.sliding_window is None
        and config.rope_scaling_factor is None
        and config.rope_linear_factor == 1.0
        and config.rope_local_theta is None
        and config.rope_yarn_factor is not None  # the only table its 64-dim part takes
        and (config.query_pre_attn_scalar is None or config.rope_yarn_factor > 1)
    )
