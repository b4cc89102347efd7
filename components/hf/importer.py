"""Import a local Hugging Face model folder as an alignpipe model artifact.

Every check runs before a weight is read: the architecture and its options, the
tokenizer against the embedding, and each tensor's name and shape against the
config (all mismatches listed at once). Weights are then read shard by shard,
one tensor at a time, into float32 arrays of the stacked-layer layout, so memory
stays near one fp32 copy of the model. The artifact holds ``config.json``,
``params/`` and the tokenizer in ``tokenizer/`` (pass that folder to
``alignpipe data shard --tokenizer``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

import numpy as np
from flax import nnx

from components.core import fileio
from components.core.data.tokenizers import (
    MODEL_TOKENIZER_DIR,
    HFTokenizer,
    TokenizerError,
    fit_to_embedding,
    has_hf_tokenizer,
    hf_tokenizer_files,
    side_files,
)
from components.core.model.hf_folder import is_hf_dir
from components.core.model.transformer import ModelConfig, Transformer
from components.core.training.checkpoint import export_model, read_model_config
from components.hf import fp8, mistral3, mistral4, moe, qwen3_next, safetensors_io
from components.hf.families import (
    LANGUAGE_MODEL_PREFIXES,
    HFImportError,
    export_architecture,
    family_of_hf,
    is_multimodal,
    model_config_from_hf,
)
from components.hf.tensor_map import TensorSpec, tensor_specs

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that are not parameters.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Qwen3.5's multi-token-prediction head: transformers does not load it either.
IGNORED_PREFIXES = ("mtp.",)
SOURCE_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
MAX_LISTED = 20


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    """The folder's ``config.json``, or an error saying what the folder must hold."""
    path = os.path.join(hf_dir, "config.json")
    if "://" in hf_dir:
        raise HFImportError(
            f"{hf_dir}: import reads local folders; copy it first (gcloud storage cp -r)"
        )
    if not os.path.exists(path):
        native = os.path.exists(os.path.join(hf_dir, "params.json"))  # mistral-inference's
        raise HFImportError(
            f"{hf_dir} has no config.json; pass a Hugging Face model folder "
            "(config.json, *.safetensors, tokenizer.json, tokenizer_config.json)"
            + (
                "; this one is in Mistral's own format (params.json, consolidated.safetensors): "
                "download the repository's Hugging Face files beside them"
                if native
                else ""
            )
        )
    try:
        with open(path) as handle:
            hf = json.load(handle)
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
        raise HFImportError(f"{path} is not valid JSON ({error}); download it again") from None
    if isinstance(hf, dict) and "schema_version" in hf and "architectures" not in hf:
        raise HFImportError(
            f"{hf_dir} is an alignpipe model already (its config.json has a schema_version); "
            "pass it to the stages as it is, or `alignpipe model export` it to Hugging Face"
        )
    return hf


def import_tokenizer(hf_dir: str, embedding_rows: int) -> HFTokenizer:
    """The folder's tokenizer, with a pad that fits the embedding, or a clear error."""
    if not has_hf_tokenizer(hf_dir):
        raise HFImportError(
            f"{hf_dir} has no tokenizer.json (nor Mistral's tekken.json); alignpipe reads fast "
            "tokenizers: save one with transformers "
            "(AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
        )
    try:
        tokenizer_json, config_bytes = hf_tokenizer_files(hf_dir)
        tokenizer = fit_to_embedding(
            tokenizer_json, config_bytes, embedding_rows, hf_dir, side_files(hf_dir)
        )
    except TokenizerError as error:
        raise HFImportError(str(error)) from None
    if not tokenizer.chat_template:
        log.warning(
            "%s has no chat template (no chat_template.jinja, tokenizer_config.json "
            "chat_template or processor chat_template.json): conversational data will be "
            "rendered with alignpipe's default template, which this model was not trained on; "
            "copy the template the model was released with into the folder",
            hf_dir,
        )
    return tokenizer


def _expected_shapes(config: ModelConfig, specs: list[TensorSpec]) -> dict[str, tuple]:
    """HF name -> the shape the checkpoint must hold, from the abstract model."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    pure = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    covered = {spec.path for spec in specs}
    leaves = {path for path, _ in _walk(pure)}
    assert covered == leaves, f"tensor map and model disagree: {covered ^ leaves}"
    shapes = {}
    for spec in specs:
        shape = _get(pure, spec.path).shape
        shape = shape[1:] if spec.layer is not None else shape
        shape = shape[1:] if spec.expert is not None else shape
        shapes[spec.hf_name] = tuple(reversed(shape)) if spec.transpose else tuple(shape)
    return shapes


def _walk(tree: dict, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, leaf) of a nested dict."""
    items = []
    for key, value in tree.items():
        if isinstance(value, dict):
            items.extend(_walk(value, (*prefix, key)))
        else:
            items.append(((*prefix, key), value))
    return items


def _get(tree: dict, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _listed(lines: list[str]) -> str:
    shown = lines[:MAX_LISTED]
    more = f"\n  … and {len(lines) - MAX_LISTED} more" if len(lines) > MAX_LISTED else ""
    return "\n  " + "\n  ".join(shown) + more


def check_tensors(
    infos: dict[str, safetensors_io.TensorInfo], expected: dict[str, tuple], tied: bool
) -> None:
    """Refuse missing, mis-shaped or unexpected tensors, listing each by name and shape."""
    missing = [f"{n} {list(s)}" for n, s in expected.items() if n not in infos]
    wrong = [
        f"{n}: checkpoint {list(infos[n].shape)}, config expects {list(s)}"
        for n, s in expected.items()
        if n in infos and infos[n].shape != s
    ]
    ignorable = {"lm_head.weight"} if tied else set()
    extra = [
        f"{n} {list(info.shape)}"
        for n, info in infos.items()
        if n not in expected
        and n not in ignorable
        and not n.endswith(IGNORED_SUFFIXES)
        and not n.startswith(IGNORED_PREFIXES)
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors (name, expected shape):{_listed(missing)}")
    if wrong:
        problems.append(f"tensors whose shape does not match config.json:{_listed(wrong)}")
    if extra:
        problems.append(f"tensors the config does not account for:{_listed(extra)}")
    if problems:
        raise HFImportError(
            "the checkpoint does not match its config.json; re-download it or fix the "
            "config:\n" + "\n".join(problems)
        )


def read_params(
    infos: dict[str, safetensors_io.TensorInfo],
    specs: list[TensorSpec],
    expected: dict[str, tuple],
) -> dict:
    """Our params as a nested dict of float32 arrays, read file by file, tensor by tensor."""
    flat: dict[tuple, np.ndarray] = {}
    layers: dict[tuple, tuple[int, ...]] = {}  # a stacked path -> its layers (and experts)
    for spec in specs:
        if spec.layer is not None:
            seen = layers.get(spec.path, (0,) if spec.expert is None else (0, 0))
            index = (spec.layer,) if spec.expert is None else (spec.layer, spec.expert)
            layers[spec.path] = tuple(max(n, i + 1) for n, i in zip(seen, index, strict=True))
    for spec in specs:
        if spec.layer is not None and spec.path not in flat:
            shape = expected[spec.hf_name]
            shape = tuple(reversed(shape)) if spec.transpose else shape
            flat[spec.path] = np.empty((*layers[spec.path], *shape), np.float32)
    by_name = {spec.hf_name: spec for spec in specs}
    by_file: dict[str, list[str]] = {}
    # The name in the file -> ours (they differ in a multimodal checkpoint; a fused experts
    # tensor holds several of ours).
    ours: dict[str, list[str]] = {}
    for name in by_name:
        stored = infos[name].stored_as or name
        if stored not in ours:
            by_file.setdefault(infos[name].file, []).append(stored)
        ours.setdefault(stored, []).append(name)
    scales = fp8.read_scales(infos)
    for path, names in sorted(by_file.items()):
        for stored, array in safetensors_io.read_file_tensors(path, names):
            if stored in scales:  # an FP8 weight: dequantized whole, before any view of it
                scale = infos[ours[stored][0]].scale
                array = fp8.dequantize(array, scales.pop(stored), scale.block)
            for name in ours[stored]:
                spec = by_name[name]
                value = np.asarray(moe.view(array, infos[name]), dtype=np.float32)
                value = value.T if spec.transpose else value
                if spec.layer is None:
                    flat[spec.path] = np.ascontiguousarray(value)
                elif spec.expert is None:
                    flat[spec.path][spec.layer] = value
                else:
                    flat[spec.path][spec.layer, spec.expert] = value
    nested: dict = {}
    for path, value in flat.items():
        node = nested
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return nested


def language_model_tensors(
    infos: dict[str, safetensors_io.TensorInfo],
) -> tuple[dict[str, safetensors_io.TensorInfo], int]:
    """A multimodal checkpoint's language-model tensors under a causal LM's names, and how
    many tensors (the vision tower, the projector) are left out."""
    for prefix in LANGUAGE_MODEL_PREFIXES:
        if f"{prefix}embed_tokens.weight" in infos:
            break
    else:
        raise HFImportError(
            "a multimodal checkpoint without its language model's embed_tokens under "
            f"{' or '.join(LANGUAGE_MODEL_PREFIXES)}; re-download it"
        )
    text = {
        "model." + name[len(prefix) :]: dataclasses.replace(info, stored_as=name)
        for name, info in infos.items()
        if name.startswith(prefix)
    }
    for head in ("lm_head.weight", "language_model.lm_head.weight"):
        if head in infos:
            text["lm_head.weight"] = dataclasses.replace(infos[head], stored_as=head)
    return text, len(infos) - len(text)


@dataclasses.dataclass(frozen=True, slots=True)
class Checked:
    """A Hugging Face folder that passed every check of an import; no weight read yet."""

    hf: dict[str, Any]
    family: str
    source_dtype: str
    config: ModelConfig
    tokenizer: HFTokenizer
    infos: dict[str, safetensors_io.TensorInfo]
    specs: list[TensorSpec]
    expected: dict[str, tuple]
    left_out: int  # tensors of a multimodal checkpoint's other towers, not imported


def check_hf(hf_dir: str, *, dtype: str = "", remat: str = "full") -> Checked:
    """Every check of an import, reading config.json, the tokenizer and the safetensors
    headers only: the architecture and its options, the tokenizer against the embedding,
    each tensor's name and shape (preflight runs it before any task)."""
    hf = read_hf_config(hf_dir)
    family = family_of_hf(hf)
    infos = safetensors_io.tensor_infos(safetensors_io.checkpoint_files(hf_dir))
    left_out = 0
    if is_multimodal(hf):
        infos, left_out = language_model_tensors(infos)
    embed = infos.get("model.embed_tokens.weight")
    source_dtype = SOURCE_DTYPES.get(embed.dtype, "float32") if embed else "float32"
    if not dtype:
        dtype = "float32" if source_dtype in ("float32", "float64") else "bfloat16"
    try:
        config = model_config_from_hf(hf, dtype=dtype, remat=remat)
    except ValueError as error:
        raise HFImportError(f"{hf_dir}/config.json: {error}") from error
    # FP8 weights told where their scales are; any other quantization (a multimodal
    # checkpoint's outer config too) refused by name, before a tensor is read.
    infos = fp8.attach_scales(infos, hf)
    infos = moe.per_expert(infos, config.dim, config.expert_dim)
    if qwen3_next.is_qwen3_next(hf):  # its config read: the fields the split needs are there
        infos = qwen3_next.split_projections(infos, hf)
    if family == "mistral" and config.kv_lora_rank:  # Mistral 4: Qwen's expert names
        if mistral4.interleaved(hf):  # its rotary rows in interleaved pairs
            infos = mistral4.deinterleave(infos, config)
    elif family == "mistral" and config.n_experts:  # a Mixtral saved in transformers 5's layout
        infos = moe.mixtral_names(infos)
    if mistral3.tie_by_checkpoint(hf):  # as transformers 5 decides it: by the checkpoint
        config = dataclasses.replace(config, tie_embeddings="lm_head.weight" not in infos)
    tokenizer = import_tokenizer(hf_dir, config.vocab_size)
    specs = tensor_specs(config, family)
    expected = _expected_shapes(config, specs)
    check_tensors(infos, expected, config.tie_embeddings)
    return Checked(hf, family, source_dtype, config, tokenizer, infos, specs, expected, left_out)


def import_hf(hf_dir: str, out: str, *, dtype: str = "", remat: str = "full") -> dict[str, Any]:
    """Write ``out`` (a model artifact) from the HF folder ``hf_dir``; returns a summary.

    ``dtype`` is the compute dtype ('' = bfloat16 for 16-bit checkpoints, else float32);
    parameters are float32 either way.
    """
    checked = check_hf(hf_dir, dtype=dtype, remat=remat)
    hf, family, source_dtype = checked.hf, checked.family, checked.source_dtype
    config, tokenizer, infos = checked.config, checked.tokenizer, checked.infos
    specs, expected = checked.specs, checked.expected
    params = read_params(infos, specs, expected)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    source = {"family": family, "architecture": hf["architectures"][0], "dtype": source_dtype}
    if hub := hub_id(hf_dir):
        source["hub_id"] = hub
    if quantized := sum(infos[spec.hf_name].scale is not None for spec in specs):
        source["fp8_weights"] = quantized  # read dequantized (fp8.py); exported unquantized
        log.info("%s: %d FP8 weights dequantized with their scales", hf_dir, quantized)
    if config.kv_lora_rank and not mistral4.interleaved(hf):  # PEFT's base must say so too
        source["rope_interleave"] = False
    if checked.left_out:  # a multimodal checkpoint: the run is text-only
        exports_as = export_architecture(config, family)[0]
        source["text_only"] = {"tensors_left_out": checked.left_out, "exports_as": exports_as}
        log.warning(
            "%s is a multimodal %s: its language model is imported and the run is text-only "
            "(%d tensors of its other towers left out); export writes %s",
            hf_dir, source["architecture"], checked.left_out, exports_as,
        )  # fmt: skip
    export_model(
        out,
        model_config=config.to_dict(),
        params=state,
        extra_config={
            "tokenizer": tokenizer.info(),
            "stage": "import",
            "scalar_head": False,
            "training": {"source": os.path.abspath(hf_dir)},
            "step": 0,
            "hf": source,
        },
    )
    tokenizer.save(fileio.join(out, MODEL_TOKENIZER_DIR))
    count = sum(int(np.prod(expected[spec.hf_name])) for spec in specs)
    return {**source, "params": count, "vocab_size": config.vocab_size, "out": out}


def hub_id(hf_dir: str) -> str | None:
    """The Hub id of a folder in the Hugging Face cache (``…/models--ORG--NAME/snapshots/…``,
    where ``huggingface_hub`` downloads), or None: an export's model card names its base."""
    match = re.search(r"models--([^/]+?)--([^/]+)/snapshots/", os.path.abspath(hf_dir) + "/")
    return f"{match.group(1)}/{match.group(2)}" if match else None


def resolve_base(path: str, workdir: str) -> str:
    """A model artifact for ``path``: itself, or its import into ``workdir`` if an HF folder.

    A remote (gs://) Hugging Face folder is copied into ``workdir`` first: the import reads
    each safetensors file by memory map, which needs a local file.
    """
    if not path or not is_hf_dir(path):
        return path
    out = fileio.join(workdir, "imported_base")
    source = path
    if "://" in path:
        source = os.path.join(workdir, "hf_source")
        fileio.copy_tree(path, source)
    elif _imported_from(out) == os.path.abspath(path):
        return out  # imported by an earlier attempt of this stage
    import_hf(source, out)
    return out


def _imported_from(out: str) -> str | None:
    """The source folder an import at ``out`` was made from, or None when there is none."""
    if not fileio.exists(fileio.join(out, "config.json")):
        return None
    return read_model_config(out).get("training", {}).get("source")


def remove_import(workdir: str) -> None:
    """Delete what :func:`resolve_base` wrote into ``workdir``, once the stage is done with
    it: the stage's output artifact would otherwise carry a second copy of the base model
    (and a promotion would copy it again)."""
    for name in ("imported_base", "hf_source"):
        fileio.remove_tree(fileio.join(workdir, name))
