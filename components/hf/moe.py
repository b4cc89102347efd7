"""Mixture-of-experts checkpoints (core/model/moe.py computes them): the config experts of
Mixtral, Qwen2 MoE, Qwen3 MoE and Qwen3.5 MoE, and the tensors of those and Gemma 4 26B-A4B's.

Qwen2 and Qwen3 MoE's releases, and every checkpoint transformers 5 saves, hold each expert's
projections apart (``mlp.experts.N.gate_proj.weight`` …); Mixtral's under its own names
(``block_sparse_moe.experts.N.w1.weight``: w1 the gate, w3 the up, w2 the down projection,
``block_sparse_moe.gate.weight`` the router), which transformers 5 renames on load and back
on save (its ``mixtral`` conversion), so a Mixtral export writes them so too. Qwen3.5 MoE's
releases store a layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2F, D], gate rows
then up rows, and ``mlp.experts.down_proj`` [E, D, F], no ``.weight``); transformers'
qwen2_moe conversion joins the apart ones on load the same way. The importer checks and reads one
name per expert whichever way the file stores them: a fused tensor's entry per expert is a
view of it (``part``); a Mixtral saved in transformers 5's own layout (``mlp.gate``, fused
experts) is read under Mixtral's names (:func:`mixtral_names`). Gemma 4's are fused too
(``experts.gate_up_proj`` under the layer), and transformers has no conversion for them: an
export fuses them back (:func:`fuse`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from components.core.model.config import ModelConfig
from components.hf.refusals import refuse
from components.hf.safetensors_io import TensorInfo

MOE_ARCHITECTURES = (
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
    "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM",
)  # fmt: skip
# The architecture and model_type each family's experts export as.
MOE_EXPORT = {
    "mistral": ("MixtralForCausalLM", "mixtral"),
    "qwen2": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen3_5": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
}
MOE_NAMES = {"mistral": "Mixtral", "qwen2": "Qwen2 MoE", "qwen3": "Qwen3 MoE",
             "qwen3_5": "Qwen3.5 MoE or Qwen3-Next"}  # fmt: skip
# A layer's mixture (under model.layers.N.): its module, router and each projection's name.
QWEN_NAMES = ("mlp", "gate", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"})
MIXTRAL_NAMES = ("block_sparse_moe", "gate", {"gate": "w1", "up": "w3", "down": "w2"})
# Qwen3-VL MoE: a Qwen3 MoE whose releases store the fused experts transposed (per_expert).
QWEN3_VL_MOE = "Qwen3VLMoeForConditionalGeneration"
# Qwen3MoeConfig's tie_word_embeddings default (false), unlike Qwen3Config's (true).
UNTIED_BY_DEFAULT = ("Qwen3MoeForCausalLM",)
NO_EXPERTS = dict(n_experts=0, experts_per_token=0, expert_dim=0, shared_expert_dim=0)


def tied(hf: dict[str, Any], family_default: bool) -> bool:
    """Whether a config that does not say ties its embeddings: its family's default, or its
    MoE architecture's where that differs (Qwen3MoeConfig: false)."""
    untied = set(hf.get("architectures") or []) & set(UNTIED_BY_DEFAULT)
    return False if untied else family_default


def expert_fields(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """A mixture-of-experts architecture's ModelConfig fields; none for a dense one.
    A KeyError names a field the config lacks."""
    if not set(hf.get("architectures") or []) & set(MOE_ARCHITECTURES):
        return {}
    if hf.get("num_experts") is None and hf.get("num_local_experts") is None:
        raise KeyError("num_local_experts" if family == "mistral" else "num_experts")
    # Qwen3MoeConfig saves its count as num_local_experts (its attribute_map's name),
    # Mixtral's config names it so.
    count = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    name = MOE_NAMES[family]
    refuse(not count, f"{name} with no experts (num_experts 0)")
    # Mixtral's experts are intermediate_size wide; it has no other MLP.
    width = "intermediate_size" if family == "mistral" else "moe_intermediate_size"
    for field in ("num_experts_per_tok", width):
        if hf.get(field) is None:
            raise KeyError(field)
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    needs_shared = family in ("qwen2", "qwen3_5")
    refuse(needs_shared and not shared, f"{name} without its shared expert")
    refuse(not needs_shared and bool(shared), f"a shared expert in a {name}")
    return dict(
        n_experts=count,
        experts_per_token=int(hf["num_experts_per_tok"]),
        expert_dim=int(hf[width]),
        norm_topk_prob=_renormalised(hf, family),
        shared_expert_dim=shared,
    )


def _renormalised(hf: dict[str, Any], family: str) -> bool:
    """Whether the router renormalises its top k: Mixtral's and Qwen3.5's always do; the
    others as ``norm_topk_prob`` says, by default false (Qwen2 and Qwen3 MoE; Qwen3's
    releases state true, Qwen2's false) or true (Qwen3-Next)."""
    next_ = "Qwen3NextForCausalLM" in (hf.get("architectures") or [])
    if family == "mistral" or (family == "qwen3_5" and not next_):
        return True
    return bool(hf.get("norm_topk_prob", next_))


def exportable(config: ModelConfig, dense: list[str]) -> list[str]:
    """The families whose MoE architecture computes ``config``'s experts, of those whose
    dense architecture computes the rest of it (``dense``)."""
    shared, renormalised = bool(config.shared_expert_dim), config.norm_topk_prob
    if "qwen3_5" in dense:
        return ["qwen3_5"] if shared and renormalised else []
    if "qwen2" in dense:
        return ["qwen2"] if shared else []
    if "qwen3" in dense:
        return [] if shared else ["qwen3"]
    mixtral = renormalised and not shared and not config.query_scale_beta  # no Ministral 3's
    return ["mistral"] if "mistral" in dense and mixtral else []


# A layer's fused experts: Qwen3.5 MoE's under mlp.experts., Gemma 4 26B-A4B's under experts.
GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"
APART = re.compile(r"(.*experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def per_expert(infos: dict[str, TensorInfo], dim: int, width: int) -> dict[str, TensorInfo]:
    """``infos`` with each fused experts tensor replaced by one entry per expert and
    projection, ``part`` naming its rows of the stored tensor (the per-expert names). ``dim``
    and ``width`` (the experts'): a tensor stored transposed ([E, D, 2F], [E, F, D]: Qwen3-VL
    MoE's releases) is read so, as transformers' conversion reads it (only where its shape
    is not the untransposed one)."""
    out = {}
    for name, info in infos.items():
        if not name.endswith((f".{GATE_UP}", f".{DOWN}")) or len(info.shape) != 3:
            out[name] = info
            continue
        experts, rows, cols = info.shape
        down = name.endswith(DOWN)
        normal = (dim, width) if down else (2 * width, dim)
        transposed = (rows, cols) != normal and (cols, rows) == normal
        if transposed:
            rows, cols = cols, rows
        prefix = name.rsplit(".", 1)[0]  # ….experts
        if down:
            parts = [("down_proj", 0, rows)]
        else:
            parts = [("gate_proj", 0, rows // 2), ("up_proj", rows // 2, rows)]
        for e in range(experts):
            for projection, start, stop in parts:
                out[f"{prefix}.{e}.{projection}.weight"] = dataclasses.replace(
                    info, shape=(stop - start, cols), stored_as=info.stored_as or name,
                    part=(e, start, stop), transposed=transposed,
                )  # fmt: skip
    return out


def fuse(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert tensors joined as a fused checkpoint stores them (the reverse of
    :func:`per_expert`): Gemma 4's, which transformers loads only fused."""
    out, apart = {}, {}
    for name, value in tensors.items():
        match = APART.match(name)
        if match is None:
            out[name] = value
        else:
            apart.setdefault(match[1], {})[(int(match[2]), match[3])] = value
    for prefix, parts in apart.items():
        count = 1 + max(e for e, _ in parts)
        out[f"{prefix}.gate_up_proj"] = np.stack(
            [np.concatenate([parts[(e, "gate")], parts[(e, "up")]]) for e in range(count)]
        )
        out[f"{prefix}.down_proj"] = np.stack([parts[(e, "down")] for e in range(count)])
    return out


def mixtral_names(infos: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """A Mixtral's tensors under Mixtral's names where the file uses transformers 5's
    (``mlp.gate``, ``mlp.experts.gate_up_proj``: saved with ``save_original_format=False``),
    read through :func:`per_expert` first; a file with Mixtral's own names is unchanged."""
    block, router, names = MIXTRAL_NAMES
    out = {}
    for name, info in infos.items():
        new, match = name, APART.match(name)
        if name.endswith(f".mlp.{router}.weight"):
            new = name.replace(".mlp.", f".{block}.")
        elif match and match[1].endswith(".mlp.experts"):
            head = match[1].removesuffix(".mlp.experts")
            new = f"{head}.{block}.experts.{match[2]}.{names[match[3]]}.weight"
        renamed = new != name and not info.stored_as
        out[new] = dataclasses.replace(info, stored_as=name) if renamed else info
    return out


def view(array: np.ndarray, info: TensorInfo) -> np.ndarray:
    """The tensor ``info`` names out of the stored ``array``: all of it, an expert's rows,
    or a fused projection's rows."""
    if info.rows:
        return array[list(info.rows)]
    if not info.part:
        return array
    expert, start, stop = info.part
    return array[expert, :, start:stop].T if info.transposed else array[expert, start:stop]
