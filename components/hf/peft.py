"""LoRA adapters in PEFT's format: export next to their base model, and read back.

A policy trained with adapters (``core/model/lora.py``) exports as three Hugging Face
folders: the merged model (what ``export_hf`` writes), the base with the adapters left
out, and the adapters as PEFT saves them, which ``peft.PeftModel.from_pretrained(base,
adapter_dir)`` loads onto that base::

    out/                      merged weights, config, tokenizer (transformers loads it)
    out/base/                 the frozen base the adapters were trained on
    out/adapter/              adapter_config.json + adapter_model.safetensors

PEFT's ``nn.Linear`` weights are [out, in], ours [in, out]: its ``lora_A.weight`` [r, in]
is our A.T and its ``lora_B.weight`` [out, r] our B.T; the scale alpha/r is the same.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from flax import nnx

from components.core.model import lora
from components.core.model.transformer import ModelConfig, Transformer
from components.hf import mistral4, qwen3_next, safetensors_io
from components.hf.export import (
    DEFAULT_SHARD_BYTES,
    ExportError,
    load_policy,
    read_policy,
    write_hf,
    write_json,
)
from components.hf.tensor_map import stack_index

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
BASE_DIR, ADAPTER_DIR = "base", "adapter"
# The HF module of each target inside a decoder layer (Llama, Qwen2 and Gemma 2 alike).
HF_MODULES = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
    "in_proj_qkv": "linear_attn.in_proj_qkv",
    "in_proj_z": "linear_attn.in_proj_z",
    "in_proj_b": "linear_attn.in_proj_b",
    "in_proj_a": "linear_attn.in_proj_a",
    "out_proj": "linear_attn.out_proj",
    "q_a_proj": "self_attn.q_a_proj",  # Mistral 4's latent attention
    "q_b_proj": "self_attn.q_b_proj",
    "kv_a_proj_with_mqa": "self_attn.kv_a_proj_with_mqa",
    "kv_b_proj": "self_attn.kv_b_proj",
}
# PEFT options that change the adapter's function, which alignpipe does not model.
UNSUPPORTED = {
    "use_rslora": "rsLoRA's alpha/sqrt(r) scale",
    "use_dora": "DoRA",
    "fan_in_fan_out": "Conv1D-style [in, out] weights",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "layers_to_transform": "adapters on some layers only",
    "modules_to_save": "fully trained extra modules",
    "lora_bias": "adapter biases",
}


class AdapterError(ValueError):
    """A PEFT adapter alignpipe cannot read, with the reason and the fix."""


def adapter_config(config: ModelConfig, base_model: str) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` (a LoraConfig) for ``config``'s adapters."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "revision": None,
        "inference_mode": True,
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(config.lora_targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "modules_to_save": None,
    }


def _adapter_name(layer: int, target: str, matrix: str) -> str:
    return f"base_model.model.model.layers.{layer}.{HF_MODULES[target]}.{matrix}.weight"


def _adapter_sites(config) -> list[tuple[int, str, str, int]]:
    """(checkpoint layer, target, stack, index in the stack) of every adapter of ``config``."""
    sites = []
    for layer, (stack, index) in enumerate(stack_index(config)):
        for target in HF_MODULES:
            if target in config.lora_targets and stack in config.target_stacks(target):
                sites.append((layer, target, stack, index))
    return sites


def adapter_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """PEFT's tensor name -> float32 [out, in] array for every adapter of ``model``."""
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors = {}
    for layer, target, stack, index in _adapter_sites(model.config):
        module, name = lora.TARGET_PATHS[target]
        adapter = pure[stack][module][name]["lora"]
        for matrix, ours in (("lora_A", "lora_a"), ("lora_B", "lora_b")):
            value = np.asarray(adapter[ours][index], np.float32).T
            order = _stored_rows(model.config, target) if matrix == "lora_B" else None
            if order is not None:  # B's rows in the checkpoint's interleaved order
                value = _interleaved(value, order)
            tensors[_adapter_name(layer, target, matrix)] = np.ascontiguousarray(value)
    return tensors


def _stored_rows(config: ModelConfig, target: str) -> np.ndarray | None:
    """The stored row of each of our output rows of ``target`` where the checkpoint's order
    differs (Mistral 4's rotary rows, interleaved: mistral4.py), else None."""
    if not config.kv_lora_rank:
        return None
    return mistral4.rotary_rows(config).get(f"{HF_MODULES[target]}.weight")


def _interleaved(value: np.ndarray, order: np.ndarray) -> np.ndarray:
    stored = np.empty_like(value)
    stored[order] = value
    return stored


def write_adapter(out: str, model: Transformer, base_model: str) -> list[str]:
    """``out`` as a PEFT adapter folder of ``model``'s adapters."""
    os.makedirs(out, exist_ok=True)
    safetensors_io.write_file(os.path.join(out, ADAPTER_WEIGHTS), adapter_tensors(model))
    write_json(os.path.join(out, ADAPTER_CONFIG), adapter_config(model.config, base_model))
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def export_peft(
    model_dir: str,
    out: str,
    *,
    tokenizer_dir: str = "",
    dtype: str = "",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    base_model: str = "",
) -> dict[str, Any]:
    """Write the merged model to ``out``, its base to ``out/base``, its adapters to
    ``out/adapter`` (PEFT's format, float32).

    ``base_model``: the adapter config's ``base_model_name_or_path`` ('' = the absolute
    path of ``out/base``; a Hub id when the base is that checkpoint unchanged).
    """
    policy = read_policy(model_dir, tokenizer_dir=tokenizer_dir, dtype=dtype)
    if not policy.config.lora_rank:
        raise ExportError(
            f"{model_dir} has no LoRA adapters (its config.json 'model' has lora_rank 0), so "
            "there is no adapter to export; export it without --adapter, or train the stage "
            "with lora_rank > 0"
        )
    if base_model and qwen3_next.exports_as_qwen3_next(policy.info):
        raise ExportError(
            f"--base-model {base_model}: the adapters of a model imported from Qwen3-Next adapt "
            "Qwen3.5's DeltaNet projections, which a Qwen3-Next checkpoint does not have; leave "
            "--base-model out so that they name the base written beside them (out/base)"
        )
    if base_model and policy.info.get("hf", {}).get("rope_interleave") is False:
        raise ExportError(
            f"--base-model {base_model}: the adapters' rotary rows are written interleaved, as "
            "the base beside them stores them, and the checkpoint this model was imported from "
            "stores them in rotate-half order (rope_interleave: false); leave --base-model out"
        )
    model = load_policy(policy)
    base_dir, adapter_dir = os.path.join(out, BASE_DIR), os.path.join(out, ADAPTER_DIR)
    files = write_hf(out, policy, lora.merge(model), max_shard_bytes)
    write_hf(base_dir, policy, model, max_shard_bytes, as_imported=False)  # the adapters' base
    write_adapter(adapter_dir, model, base_model or os.path.abspath(base_dir))
    return {
        "family": policy.family,
        "dtype": policy.dtype,
        "files": files,
        "out": out,
        "base": base_dir,
        "adapter": adapter_dir,
        "lora_rank": policy.config.lora_rank,
    }


def read_adapter_config(adapter_dir: str) -> dict[str, Any]:
    """``adapter_dir``'s adapter_config.json, refused unless it is a plain LoRA we model."""
    path = os.path.join(adapter_dir, ADAPTER_CONFIG)
    if not os.path.exists(path):
        raise AdapterError(f"{adapter_dir} has no {ADAPTER_CONFIG}; pass a PEFT adapter folder")
    with open(path) as handle:
        config = json.load(handle)
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r}; alignpipe reads LORA")
    used = [f"{key} ({what})" for key, what in UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        used.append(f"bias {config['bias']!r} (trained biases)")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not set(targets) <= set(HF_MODULES):
        used.append(f"target_modules {targets!r} (alignpipe adapts {list(HF_MODULES)} by name)")
    if used:
        raise AdapterError(
            f"{path} uses {', '.join(used)}; alignpipe models plain LoRA (W + B·A·alpha/r): "
            "merge this adapter into its base with peft (merge_and_unload) and import that"
        )
    return config


def load_adapter(model: Transformer, adapter_dir: str) -> Transformer:
    """``model`` (adapters merged first) carrying the PEFT adapter in ``adapter_dir``."""
    config = read_adapter_config(adapter_dir)
    targets = tuple(t for t in HF_MODULES if t in config["target_modules"])
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    adapted = lora.attach(model, rank=rank, alpha=alpha, targets=targets, seed=0)
    path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    stored = dict(safetensors_io.read_file_tensors(path, list(safetensors_io.tensor_infos([path]))))
    expected = adapter_tensors(adapted)
    if sorted(stored) != sorted(expected):
        missing, extra = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
        experts = [name for name in extra if ".mlp.shared_expert." in name]
        if experts:  # PEFT adapts Qwen3.5 MoE's shared expert by the MLP projections' names
            raise AdapterError(
                f"{path} adapts the shared expert's MLP ({experts[0]} ...): alignpipe adapts no "
                "MLP of a mixture-of-experts model (core/model/moe.py); pass an adapter of "
                "the attention projections"
            )
        raise AdapterError(
            f"{path} does not fit this model: missing {missing[:4]}, unexpected {extra[:4]}; "
            "pass the adapter trained on this base"
        )
    state = nnx.state(adapted, nnx.Param)
    pure = nnx.to_pure_dict(state)
    sites = _adapter_sites(adapted.config)
    for target, stack in {(target, stack) for _, target, stack, _ in sites}:
        module, name = lora.TARGET_PATHS[target]
        adapter = pure[stack][module][name]["lora"]
        layers = [layer for layer, t, s, _ in sites if (t, s) == (target, stack)]
        for matrix, ours in (("lora_A", "lora_a"), ("lora_B", "lora_b")):
            names = [_adapter_name(i, target, matrix) for i in layers]
            order = _stored_rows(adapted.config, target) if matrix == "lora_B" else None
            rows = [np.asarray(stored[name], np.float32) for name in names]
            rows = rows if order is None else [value[order] for value in rows]
            stacked = np.stack([value.T for value in rows])
            if stacked.shape != adapter[ours].shape:
                raise AdapterError(
                    f"{path}: {target} {matrix} has shape {stacked.shape[1:][::-1]} per layer, "
                    f"this model's r={rank} adapter needs {adapter[ours].shape[1:][::-1]}"
                )
            adapter[ours] = stacked.astype(adapter[ours].dtype)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(adapted, state)
    return adapted
