"""Qwen3's and Qwen3.5's mixture-of-experts checkpoints (core/model/moe.py computes them):
their config's experts, and their tensors.

Qwen3 MoE's releases, and every checkpoint transformers 5 saves, hold each expert's
projections apart (``mlp.experts.N.gate_proj.weight`` …). Qwen3.5 MoE's releases store a
layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2F, D], gate rows then up rows,
and ``mlp.experts.down_proj`` [E, D, F], no ``.weight``); transformers' qwen2_moe
conversion joins the apart ones on load the same way. The importer checks and reads one
name per expert whichever way the file stores them: a fused tensor's entry per expert is a
view of it (``part``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from components.hf.refusals import refuse
from components.hf.safetensors_io import TensorInfo

MOE_ARCHITECTURES = (
    "Qwen3MoeForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
)  # fmt: skip
# The architecture and model_type each family's experts export as.
MOE_EXPORT = {
    "qwen3": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen3_5": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
NO_EXPERTS = dict(n_experts=0, experts_per_token=0, expert_dim=0, shared_expert_dim=0)


def expert_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """A mixture-of-experts architecture's ModelConfig fields; none for a dense one.
    A KeyError names a field the config lacks."""
    if not set(hf.get("architectures") or []) & set(MOE_ARCHITECTURES):
        return {}
    if "num_experts" not in hf and "num_local_experts" not in hf:
        raise KeyError("num_experts")
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    refuse(family == "qwen3_5" and not shared, "Qwen3.5 MoE without its shared expert")
    refuse(family == "qwen3" and bool(shared), "a shared expert in a Qwen3 MoE")
    return dict(
        # Qwen3MoeConfig saves its count as num_local_experts (its attribute_map's name).
        n_experts=int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]),
        experts_per_token=int(hf["num_experts_per_tok"]),
        expert_dim=int(hf["moe_intermediate_size"]),
        # Qwen3MoeConfig's default is false (released checkpoints state true); Qwen3.5's
        # router always renormalises.
        norm_topk_prob=family == "qwen3_5" or bool(hf.get("norm_topk_prob", False)),
        shared_expert_dim=shared,
    )


GATE_UP, DOWN = ".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"


def per_expert(infos: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """``infos`` with each fused experts tensor replaced by one entry per expert and
    projection, ``part`` naming its rows of the stored tensor (the per-expert names)."""
    out = {}
    for name, info in infos.items():
        if not name.endswith((GATE_UP, DOWN)) or len(info.shape) != 3:
            out[name] = info
            continue
        stored = info.stored_as or name
        experts, rows, cols = info.shape
        if name.endswith(DOWN):
            prefix = name[: -len(DOWN)]
            for e in range(experts):
                part = (e, 0, rows)
                out[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = dataclasses.replace(
                    info, shape=(rows, cols), stored_as=stored, part=part
                )
            continue
        prefix, half = name[: -len(GATE_UP)], rows // 2
        for e in range(experts):
            for projection, start in (("gate_proj", 0), ("up_proj", half)):
                out[f"{prefix}.mlp.experts.{e}.{projection}.weight"] = dataclasses.replace(
                    info, shape=(half, cols), stored_as=stored, part=(e, start, start + half)
                )
    return out


def view(array: np.ndarray, info: TensorInfo) -> np.ndarray:
    """The tensor ``info`` names out of the stored ``array``: all of it, or an expert's rows."""
    if not info.part:
        return array
    expert, start, stop = info.part
    return array[expert, start:stop]
