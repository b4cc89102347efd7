"""Where each Hugging Face tensor of a family goes in alignpipe's params: the tensor map the
importer reads checkpoints with and the exporter writes them with."""

from __future__ import annotations

import dataclasses

from components.core.model import lora
from components.core.model.config import ModelConfig
from components.hf import gemma4, mistral4, moe
from components.hf.families import GEMMAS


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """One HF tensor and its place in our params: ``path`` in the pure dict, ``layer`` index
    (and ``expert`` index: transformers saves each expert's projections apart)."""

    hf_name: str
    path: tuple[str, ...]
    transpose: bool
    layer: int | None = None
    expert: int | None = None  # a mixture's expert: its index after the layer's


# Qwen3.5's DeltaNet tensors (under model.layers.N.) and their place in a DeltaBlock.
DELTA_TENSORS = {
    "linear_attn.in_proj_qkv.weight": (("delta", "w_qkv", "kernel"), True),
    "linear_attn.in_proj_z.weight": (("delta", "w_z", "kernel"), True),
    "linear_attn.in_proj_b.weight": (("delta", "w_b", "kernel"), True),
    "linear_attn.in_proj_a.weight": (("delta", "w_a", "kernel"), True),
    "linear_attn.out_proj.weight": (("delta", "w_out", "kernel"), True),
    "linear_attn.conv1d.weight": (("delta", "conv"), False),
    "linear_attn.dt_bias": (("delta", "dt_bias"), False),
    "linear_attn.A_log": (("delta", "a_log"), False),
    "linear_attn.norm.weight": (("delta", "norm"), False),
    "input_layernorm.weight": (("attn_norm", "scale"), False),
    "post_attention_layernorm.weight": (("mlp_norm", "scale"), False),
}
PROJECTIONS = ("gate", "up", "down")


def mlp_tensors(config: ModelConfig, family: str) -> list[tuple[str, tuple[str, ...], int | None]]:
    """A layer's MLP tensors (under model.layers.N.), their place in the layer and expert
    index: the gated MLP's, or a mixture's router, experts and shared expert under the
    family's names (hf/moe.py). Each is a Linear weight, stored transposed."""
    if not config.n_experts:
        return [(f"mlp.{p}_proj.weight", ("mlp", f"w_{p}", "kernel"), None) for p in PROJECTIONS]
    mixtral = family == "mistral" and not config.kv_lora_rank  # Mistral 4's are Qwen's names
    block, router, names = moe.MIXTRAL_NAMES if mixtral else moe.QWEN_NAMES
    tensors = [(f"{block}.{router}.weight", ("mlp", "router", "kernel"), None)]
    for e in range(config.n_experts):
        for p in PROJECTIONS:
            tensors.append((f"{block}.experts.{e}.{names[p]}.weight", ("mlp", f"w_{p}"), e))
    if config.shared_expert_dim:
        shared = "shared_expert" if config.shared_expert_gated else "shared_experts"  # Mistral 4
        for p in PROJECTIONS:
            ours = ("mlp", "shared", f"w_{p}", "kernel")
            tensors.append((f"mlp.{shared}.{p}_proj.weight", ours, None))
        if config.shared_expert_gated:
            gate = ("mlp", "shared_gate", "kernel")
            tensors.append(("mlp.shared_expert_gate.weight", gate, None))
    return tensors


def latent_linears(config: ModelConfig) -> list[tuple[str, tuple[str, str]]]:
    """Latent attention's projections (HF name, their path in a layer, as adapters find them)."""
    return [(name, lora.TARGET_PATHS[name]) for name in config.latent_projections()]


def latent_norms(config: ModelConfig) -> list[tuple[str, str]]:
    """Latent attention's norms (HF name, ours): the key-value latent's, the query's."""
    norms = mistral4.LATENT_NORMS.items()
    return [(hf, ours) for hf, ours in norms if config.q_lora_rank or hf.startswith("kv")]


def stack_index(config: ModelConfig) -> list[tuple[str, int]]:
    """Per checkpoint layer: its stack (``blocks`` or ``linear_blocks``) and index there."""
    return config.stack_places()


def tensor_specs(config: ModelConfig, family: str) -> list[TensorSpec]:
    """Every HF tensor of ``family`` for ``config`` and where it goes in our params."""
    specs = [
        TensorSpec("model.embed_tokens.weight", ("embed", "embedding"), False),
        TensorSpec("model.norm.weight", ("final_norm", "scale"), False),
    ]
    if not config.tie_embeddings:
        specs.append(TensorSpec("lm_head.weight", ("lm_head",), True))
    if family == "gemma4":
        for hf_name, (ours, transpose) in gemma4.outer_tensors(config).items():
            specs.append(TensorSpec(hf_name, ours, transpose))
        for i, (stack, j) in enumerate(stack_index(config)):
            for hf_name, (ours, transpose) in gemma4.layer_tensors(config, stack).items():
                name = f"model.layers.{i}.{hf_name}"
                specs.append(TensorSpec(name, (stack, *ours), transpose, j))
            for hf_name, ours, expert in gemma4.expert_tensors(config):
                name = f"model.layers.{i}.{hf_name}"
                specs.append(TensorSpec(name, (stack, *ours), True, j, expert))
        return specs
    # Gemma 2 and 3 name their pre-MLP norm pre_feedforward_layernorm and uses
    # post_attention_layernorm for the attention output; Llama/Qwen2 use it pre-MLP.
    norms = {"input_layernorm": "attn_norm"}
    if family in GEMMAS:
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
    }
    if config.qk_norm:
        norms.update({"self_attn.q_norm": "attn/q_norm", "self_attn.k_norm": "attn/k_norm"})
    if config.kv_lora_rank:  # Mistral 4's latent attention
        linears = {f"self_attn.{hf}": ours for hf, ours in latent_linears(config)}
        norms.update({f"self_attn.{hf}": f"attn/{ours}" for hf, ours in latent_norms(config)})
    for i, (stack, j) in enumerate(stack_index(config)):
        prefix = f"model.layers.{i}."
        for hf_name, ours, expert in mlp_tensors(config, family):
            specs.append(TensorSpec(f"{prefix}{hf_name}", (stack, *ours), True, j, expert))
        if stack == "linear_blocks":
            for hf_name, (ours, transpose) in DELTA_TENSORS.items():
                specs.append(TensorSpec(f"{prefix}{hf_name}", (stack, *ours), transpose, j))
            continue
        for hf_norm, ours in norms.items():
            path = (stack, *ours.split("/"), "scale")
            specs.append(TensorSpec(f"{prefix}{hf_norm}.weight", path, False, j))
        for hf_linear, ours in linears.items():
            path = (stack, *ours)
            specs.append(TensorSpec(f"{prefix}{hf_linear}.weight", (*path, "kernel"), True, j))
            if config.qkv_bias and hf_linear[-6:] in ("q_proj", "k_proj", "v_proj"):
                specs.append(TensorSpec(f"{prefix}{hf_linear}.bias", (*path, "bias"), False, j))
    return specs
