"""Export a policy artifact as a Hugging Face folder that ``transformers`` loads unchanged.

The HF family follows from the model's config (and, where two compute alike, the imported
one), so a policy trained by sft or ppo exports as well as a freshly imported one. The
folder gets ``config.json``, ``generation_config.json``, a model card (``README.md``:
``model_card.py``; a promoted version's with its evaluation), safetensors weights
(sharded with an index above ``max_shard_bytes``) and the tokenizer files the
model was trained with, checked against the fingerprint in its ``config.json``.
A model trained with LoRA adapters exports merged; ``peft.py`` writes the adapters
themselves in PEFT's format, next to the base they load onto.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx

from components.core import fileio
from components.core.data.tokenizers import (
    MODEL_TOKENIZER_DIR,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
)
from components.core.model import lora
from components.core.model.transformer import ModelConfig, Transformer
from components.core.training.checkpoint import load_model_params, read_model_config
from components.hf import mistral4, moe, qwen3_next, safetensors_io
from components.hf.families import family_of_config
from components.hf.hf_config import hf_config_from_model
from components.hf.model_card import model_card
from components.hf.tensor_map import tensor_specs

EXPORT_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # transformers 5 keeps the template here
)
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' customary shard size


class ExportError(ValueError):
    """A model artifact that cannot be exported as asked."""


def _tokenizer_dir(model_dir: str, info: dict[str, Any], tokenizer_dir: str) -> str:
    """The tokenizer folder to ship, checked against the model's recorded fingerprint."""
    folder = tokenizer_dir or fileio.join(model_dir, MODEL_TOKENIZER_DIR)
    if not fileio.exists(fileio.join(folder, "tokenizer.json")):
        raise ExportError(
            f"no tokenizer.json in {folder}; pass --tokenizer with the tokenizer folder the "
            "model was trained with (the shards' tokenizer/ or the imported model's tokenizer/)"
        )
    tokenizer = load_tokenizer(folder)
    recorded = info.get("tokenizer", {}).get("fingerprint")
    if recorded and tokenizer.fingerprint != recorded:
        raise ExportError(
            f"tokenizer {folder} has fingerprint {tokenizer.fingerprint}, but {model_dir} was "
            f"trained with {recorded}; pass the tokenizer folder the model was trained with"
        )
    return folder


def _token_ids(tokenizer_dir: str, tokenizer: Tokenizer) -> dict[str, int | None]:
    """bos/eos/pad ids for config.json; a pad past the tokenizer's own ids is left out."""
    from tokenizers import Tokenizer as RustTokenizer

    text = fileio.read_text(fileio.join(tokenizer_dir, "tokenizer.json"))
    count = RustTokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
    pad = tokenizer.pad_id if tokenizer.pad_id < count else None
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": pad}


def _generation_config(tokenizer: Tokenizer, token_ids: dict[str, int | None]) -> dict[str, Any]:
    """generation_config.json: the special ids, eos as the model's whole stop set (the
    template's end-of-turn token and eos), so ``generate`` stops where alignpipe stopped."""
    generation: dict[str, Any] = {k: v for k, v in token_ids.items() if v is not None}
    stops = list(tokenizer.stop_ids)
    if len(stops) > 1:
        generation["eos_token_id"] = stops
    return generation


def _hf_tensors(config: ModelConfig, family: str, params: dict, dtype: np.dtype) -> dict:
    """HF name -> array in ``dtype``, transposed back to ``nn.Linear`` layout."""
    tensors = {}
    for spec in tensor_specs(config, family):
        value = params
        for key in spec.path:
            value = value[key]
        value = np.asarray(value)
        value = value[spec.layer] if spec.layer is not None else value
        value = value[spec.expert] if spec.expert is not None else value
        value = value.T if spec.transpose else value
        tensors[spec.hf_name] = np.ascontiguousarray(value).astype(dtype)
    if config.kv_lora_rank:  # Mistral 4: rotary rows interleaved, experts fused (mistral4.py)
        return moe.fuse(mistral4.interleave(tensors, config))
    return moe.fuse(tensors) if family == "gemma4" and config.n_experts else tensors


@dataclasses.dataclass(frozen=True, slots=True)
class Policy:
    """A policy artifact checked for export: its config, HF family, dtype and tokenizer."""

    model_dir: str
    config: ModelConfig
    family: str
    dtype: str
    tokenizer_dir: str
    info: dict[str, Any]  # the artifact's config.json


def read_policy(model_dir: str, *, tokenizer_dir: str = "", dtype: str = "") -> Policy:
    """``model_dir`` checked for export (causal LM, HF family, dtype, tokenizer fingerprint).

    ``dtype`` of the weights: '' = the imported checkpoint's, else bfloat16.
    """
    info = read_model_config(model_dir)
    if info.get("scalar_head"):
        raise ExportError(
            f"{model_dir} has a scalar (reward/value) head; export writes causal LM policies"
        )
    config = ModelConfig.from_dict(info["model"])
    try:
        family = family_of_config(config, info.get("hf", {}).get("family", ""))
    except ValueError as error:
        raise ExportError(f"{model_dir}: {error}") from error
    dtype = dtype or info.get("hf", {}).get("dtype", "bfloat16")
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"export dtype must be one of {sorted(EXPORT_DTYPES)}, got {dtype!r}")
    try:
        folder = _tokenizer_dir(model_dir, info, tokenizer_dir)
    except TokenizerError as error:
        raise ExportError(str(error)) from error
    return Policy(model_dir, config, family, dtype, folder, info)


def load_policy(policy: Policy) -> Transformer:
    """The artifact's model, adapters included, built abstractly (nothing initialised)."""
    abstract = nnx.eval_shape(lambda: Transformer(policy.config, rngs=nnx.Rngs(0)))
    graphdef, template = nnx.split(abstract, nnx.Param)
    return nnx.merge(graphdef, load_model_params(policy.model_dir, template))


def write_hf(
    out: str, policy: Policy, model: Transformer, max_shard_bytes: int, as_imported: bool = True
) -> list[str]:
    """``out`` as an HF folder of ``model``'s base weights (adapters, if any, are left out);
    ``as_imported``: a Qwen3-Next import as Qwen3-Next (else as the Qwen3.5 MoE it computes
    as, the base PEFT adapters name: qwen3_next.py)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors = _hf_tensors(policy.config, policy.family, params, EXPORT_DTYPES[policy.dtype])
    del params
    tokenizer = load_tokenizer(policy.tokenizer_dir)
    token_ids = _token_ids(policy.tokenizer_dir, tokenizer)
    hf_config = hf_config_from_model(policy.config, policy.family, token_ids, policy.dtype)
    if as_imported and qwen3_next.exports_as_qwen3_next(policy.info):
        tensors, hf_config = qwen3_next.as_qwen3_next(tensors, hf_config, policy.config)
    os.makedirs(out, exist_ok=True)
    files = safetensors_io.write_checkpoint(out, tensors, max_shard_bytes)
    write_json(os.path.join(out, "config.json"), hf_config)
    generation = _generation_config(tokenizer, token_ids)
    write_json(os.path.join(out, "generation_config.json"), generation)
    for name in TOKENIZER_FILES:
        source = fileio.join(policy.tokenizer_dir, name)
        if fileio.exists(source):
            fileio.write_bytes(os.path.join(out, name), fileio.read_bytes(source))
    _write_template(out, tokenizer)
    card = model_card(policy.info, policy.family, _promotion_record(policy.model_dir), _title(out))
    with open(os.path.join(out, "README.md"), "w") as handle:
        handle.write(card)
    return files


def _write_template(out: str, tokenizer: Tokenizer) -> None:
    """chat_template.jinja for a template the copied files do not hold (a processor's
    chat_template.json, read by the tokenizer), where transformers' tokenizer reads it."""
    config_path = os.path.join(out, "tokenizer_config.json")
    config = json.loads(fileio.read_text(config_path)) if os.path.exists(config_path) else {}
    stated = config.get("chat_template") if isinstance(config, dict) else None
    jinja = os.path.join(out, "chat_template.jinja")
    if tokenizer.chat_template and not stated and not os.path.exists(jinja):
        with open(jinja, "w", encoding="utf-8") as handle:
            handle.write(tokenizer.chat_template)


def _promotion_record(model_dir: str) -> dict[str, Any] | None:
    """A promoted version's record (its PROMOTED.json), or None for any other folder."""
    path = fileio.join(model_dir, "PROMOTED.json")
    if not fileio.exists(path):
        return None
    try:
        record = json.loads(fileio.read_text(path))
    except ValueError:
        return None  # a damaged record: the card says what the config says
    return record if isinstance(record, dict) else None


def _title(out: str) -> str:
    return os.path.basename(os.path.normpath(out)) or "policy"


def export_hf(
    model_dir: str,
    out: str,
    *,
    tokenizer_dir: str = "",
    dtype: str = "",
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict[str, Any]:
    """Write ``out`` as an HF model folder from the policy artifact ``model_dir``.

    ``dtype`` of the weights: '' = the imported checkpoint's, else bfloat16. A model
    trained with adapters exports merged (W + A·B·alpha/rank): the function it computes.
    """
    policy = read_policy(model_dir, tokenizer_dir=tokenizer_dir, dtype=dtype)
    files = write_hf(out, policy, lora.merge(load_policy(policy)), max_shard_bytes)
    return {"family": policy.family, "dtype": policy.dtype, "files": files, "out": out}


def write_json(path: str, data: dict) -> None:
    """``data`` as indented JSON with sorted keys, as transformers writes its configs."""
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")
