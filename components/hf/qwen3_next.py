"""Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B), read as the Qwen3.5 MoE it
computes as.

transformers builds Qwen3.5's layers from Qwen3-Next's (its modular file): the same Gated
DeltaNet and gated attention layers in a ``layer_types`` pattern, the same (1 + w) norms,
partial rotary, and experts with a sigmoid-gated shared expert. What differs is how the
DeltaNet's input projections are stored: Qwen3-Next fuses them per key head,
``in_proj_qkvz`` [key heads x (q, k, the group's v, the group's z), D] and ``in_proj_ba``
[key heads x (the group's b, the group's a), D], which its ``fix_query_key_value_ordering``
regroups; Qwen3.5 stores ``in_proj_qkv`` (every q, every k, every v), ``in_proj_z``,
``in_proj_b`` and ``in_proj_a``. The importer reads each of Qwen3.5's as the rows of the
fused tensor it comes from (:func:`split_projections`); the convolution after them sees q,
k and v in the same order in both. A model imported from Qwen3-Next exports as one again
(:func:`as_qwen3_next`: the projections fused back, the config Qwen3NextConfig's), so it
loads where the original did (transformers 4.57+, serving stacks that know Qwen3-Next); with
``--adapter`` its base is written as the Qwen3.5 MoE it computes as, since PEFT adapts
Qwen3.5's four projections (one LoRA per fused projection would need other ranks). Qwen3-Next's
router renormalises its top k as its ``norm_topk_prob`` says (true in its releases); the
export needs it true (Qwen3.5 MoE's always renormalises). Its multi-token-prediction head
(``mtp.*``) is left out, as Qwen3.5's is, and is not written back.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from components.core.model.config import ModelConfig
from components.hf.safetensors_io import TensorInfo

ARCHITECTURE = "Qwen3NextForCausalLM"
QKVZ, BA = "linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight"


def is_qwen3_next(hf: dict[str, Any]) -> bool:
    return ARCHITECTURE in (hf.get("architectures") or [])


def _rows(hf: dict[str, Any]) -> dict[str, dict[str, list[int]]]:
    """Per fused tensor, the rows of each Qwen3.5 projection, in Qwen3.5's order."""
    groups, v_heads = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
    key_dim, value_dim = int(hf["linear_key_head_dim"]), int(hf["linear_value_head_dim"])
    per = v_heads // groups  # value heads per key head
    widths = {"q": key_dim, "k": key_dim, "v": per * value_dim, "z": per * value_dim}
    qkvz = _grouped(groups, widths)
    ba = _grouped(groups, {"b": per, "a": per})
    return {
        QKVZ: {"linear_attn.in_proj_qkv.weight": qkvz["q"] + qkvz["k"] + qkvz["v"],
               "linear_attn.in_proj_z.weight": qkvz["z"]},
        BA: {"linear_attn.in_proj_b.weight": ba["b"], "linear_attn.in_proj_a.weight": ba["a"]},
    }  # fmt: skip


def _grouped(groups: int, widths: dict[str, int]) -> dict[str, list[int]]:
    """Each part's rows when every group stores its parts one after another, in order."""
    size, rows = sum(widths.values()), {part: [] for part in widths}
    for group in range(groups):
        start = group * size
        for part, width in widths.items():
            rows[part] += range(start, start + width)
            start += width
    return rows


def split_projections(infos: dict[str, TensorInfo], hf: dict[str, Any]) -> dict[str, TensorInfo]:
    """``infos`` with each fused DeltaNet projection replaced by Qwen3.5's, each a view of
    the fused tensor's rows (``rows``); ``hf`` is a config the import has read."""
    rows = _rows(hf)
    out = {}
    for name, info in infos.items():
        fused = next((f for f in rows if name.endswith(f".{f}")), None)
        counts = sum(len(r) for r in rows[fused].values()) if fused else 0
        if fused is None or len(info.shape) != 2 or info.shape[0] != counts:
            out[name] = info  # not fused, or a shape the config does not describe (checked)
            continue
        prefix = name[: -len(fused)]
        for ours, indices in rows[fused].items():
            out[prefix + ours] = dataclasses.replace(
                info, shape=(len(indices), info.shape[1]), stored_as=info.stored_as or name,
                rows=tuple(indices),
            )  # fmt: skip
    return out


def exports_as_qwen3_next(info: dict[str, Any]) -> bool:
    """Whether an artifact's recorded import was a Qwen3-Next (its training keeps the record)."""
    return info.get("hf", {}).get("architecture") == ARCHITECTURE


def as_qwen3_next(
    tensors: dict[str, np.ndarray], hf: dict[str, Any], config: ModelConfig
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """A Qwen3.5 MoE export's tensors and config.json as Qwen3-Next's: each layer's four
    DeltaNet projections fused back into ``in_proj_qkvz`` and ``in_proj_ba`` (the inverse of
    :func:`split_projections`), the config as Qwen3NextConfig names it."""
    rows = _rows(
        {
            "linear_num_key_heads": config.delta_key_heads,
            "linear_num_value_heads": config.delta_value_heads,
            "linear_key_head_dim": config.delta_key_dim,
            "linear_value_head_dim": config.delta_value_dim,
        }
    )
    out = dict(tensors)
    for fused, parts in rows.items():
        first = next(iter(parts))
        for prefix in [n[: -len(first)] for n in tensors if n.endswith(f".{first}")]:
            pieces = {part: out.pop(prefix + part) for part in parts}
            size = sum(len(indices) for indices in parts.values())
            joined = np.empty((size, pieces[first].shape[1]), pieces[first].dtype)
            for part, indices in parts.items():
                joined[indices] = pieces[part]
            out[prefix + fused] = joined
    # Qwen3.5's gate flag has no Qwen3-Next field. rope_theta stays beside rope_parameters:
    # transformers 4.57's Qwen3NextConfig reads only rope_theta (its default is 10,000).
    next_hf = {k: v for k, v in hf.items() if k != "attn_output_gate"}
    next_hf.update(
        architectures=[ARCHITECTURE],
        model_type="qwen3_next",
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        partial_rotary_factor=hf["rope_parameters"].get("partial_rotary_factor", 0.25),
    )
    return out, next_hf
