"""FP8 checkpoints, read dequantized: transformers' ``fp8`` method and compressed-tensors'.

Qwen3's and Qwen3.5's ``-FP8`` releases and Ministral 3 Instruct (whose main release is FP8)
store each linear layer's weight as ``float8_e4m3fn`` with a float32 ``weight_scale_inv``
beside it: one scale a block of ``weight_block_size`` (128 x 128) or, with no block size
(Ministral 3), one for the whole tensor; an ``activation_scale`` for static activation
quantization may sit beside them too. Embeddings, norms, routers and the head stay 16-bit.

The import multiplies each FP8 weight by its scale, repeated over its block (the last block
of a dimension cut to the tensor, as DeepSeek's and llama.cpp's dequantization cut it), as
transformers does when it loads such a checkpoint on a machine without FP8 matmuls; the
weights are float32 from there on, as every import's. Activation scales are inference-time
and dropped. A TPU v5e has no FP8 arithmetic and RL updates every weight, so nothing is
kept quantized; the export writes the trained model unquantized, without the config's
``quantization_config``. MXFP8 scales (powers of two: ``float8_e8m0fnu``, or its exponent
bytes as transformers saves them, ``U8``) read alike.

The community's FP8 copies made with llm-compressor (``FP8_DYNAMIC``, "-FP8-Dynamic") are
compressed-tensors' ``float-quantized`` format: the same FP8 weights with a ``weight_scale``
one a tensor, a row ([rows, 1]) or a block (``block_structure``), read alike.

Other quantization methods (GPTQ, AWQ, bitsandbytes, compressed-tensors' integer formats,
MXFP4/NVFP4) are refused by name at the config: their weights are packed integers a
dequantizer per method would read.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from components.hf import safetensors_io
from components.hf.refusals import HFImportError

SCALE_SUFFIXES = {"fp8": "_scale_inv", "compressed-tensors": "_scale"}  # beside weight
# Activation and KV-cache scales: inference-time quantization, not weights.
DROPPED_SUFFIXES = (".activation_scale", ".input_scale", ".k_scale", ".v_scale")
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
FORMATS = (None, "e4m3", "float8_e4m3fn", "e5m2", "float8_e5m2")
STRATEGIES = ("tensor", "channel", "block")  # compressed-tensors' FP8 weight scales


def _fp8_groups(quantization: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The weight schemes of a compressed-tensors config when every one is FP8 (8-bit float,
    one scale a tensor, a row or a block), else None."""
    if quantization.get("format") != "float-quantized":
        return None
    groups = quantization.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return None
    weights = [group.get("weights") or {} for group in groups.values()]
    fp8 = all(
        w.get("num_bits") == 8
        and w.get("type") == "float"
        and w.get("strategy") in STRATEGIES
        and w.get("group_size") is None
        for w in weights
    )
    return weights if fp8 else None


def refused(quantization: Any) -> bool:
    """Whether a config's ``quantization_config`` names weights the import cannot read:
    anything but FP8 weights, by transformers' ``fp8`` method or compressed-tensors'
    ``float-quantized`` format (no config: nothing quantized)."""
    if quantization is None:
        return False
    if not isinstance(quantization, dict):
        return True
    method = quantization.get("quant_method")
    if method == "fp8":
        return quantization.get("fmt") not in FORMATS
    return method != "compressed-tensors" or _fp8_groups(quantization) is None


REFUSED = (
    "quantized weights other than FP8 (transformers' fp8 method or compressed-tensors' "
    "float-quantized FP8, which import dequantized); import the checkpoint's unquantized "
    "(BF16) release"
)


def check(hf: dict[str, Any]) -> None:
    """Refuse, by name, a ``quantization_config`` (a multimodal checkpoint's outer one too)
    that is not FP8, before any tensor of it is read."""
    quantization = hf.get("quantization_config")
    if refused(quantization):
        raise HFImportError(f"quantization_config={json.dumps(quantization)}: {REFUSED}")


def scheme(hf: dict[str, Any]) -> tuple[str, tuple[int, int] | None]:
    """(the suffix of a weight's scale, the block size) of the config's (or, multimodal,
    the outer config's) FP8 ``quantization_config``; block None: one scale a tensor or a
    row, or a grid that divides the weight."""
    check(hf)
    quantization = hf.get("quantization_config")
    if not quantization:
        return SCALE_SUFFIXES["fp8"], None  # no config: an FP8 tensor's own scale decides
    if quantization["quant_method"] == "fp8":  # FineGrainedFP8Config's default: 128 x 128
        block = quantization.get("weight_block_size", [128, 128])
    else:
        blocks = {json.dumps(w.get("block_structure")) for w in _fp8_groups(quantization)}
        block = json.loads(blocks.pop()) if len(blocks) == 1 else "several"
    suffix = SCALE_SUFFIXES[quantization["quant_method"]]
    if block is None:
        return suffix, None
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise HFImportError(
            f"quantization_config's block size {json.dumps(block)}: expected one pair of "
            "positive block sizes [rows, columns], e.g. [128, 128]; fix the config"
        )
    return suffix, (int(block[0]), int(block[1]))


def attach_scales(
    infos: dict[str, safetensors_io.TensorInfo], hf: dict[str, Any]
) -> dict[str, safetensors_io.TensorInfo]:
    """``infos`` with each FP8 weight told where its scale is, and the scales and activation
    scales taken out (they are no tensors of the model). An FP8 weight without a scale, a
    scale without its weight, or scales that do not tile their weight are refused by name,
    from the headers alone (the preflight runs this)."""
    suffix, block = scheme(hf)
    scales = {n for n in infos if n.endswith(suffix) and n[: -len(suffix)].endswith(".weight")}
    out: dict[str, safetensors_io.TensorInfo] = {}
    for name, info in infos.items():
        if name in scales or name.endswith(DROPPED_SUFFIXES):
            continue
        scale = name + suffix
        if scale in infos:
            if info.dtype not in FP8_DTYPES:
                raise HFImportError(
                    f"{name} has a {scale} but is stored as {info.dtype}, not FP8; the "
                    "checkpoint's tensors are damaged: download it again"
                )
            stored = infos[scale]
            try:
                _block_of(info.shape, stored.shape, block)
            except HFImportError as error:
                raise HFImportError(f"{name} ({stored.file}): {error}") from None
            found = safetensors_io.Scale(
                stored.file, stored.stored_as or scale, stored.shape, block
            )
            info = dataclasses.replace(info, scale=found)
        elif info.dtype == "U8":  # readable only as an MXFP8 scale's exponent bytes
            raise HFImportError(
                f"{name} is stored as U8 (packed integers: quantized weights other than "
                "FP8); import the checkpoint's unquantized (BF16) release"
            )
        elif info.dtype in FP8_DTYPES:
            raise HFImportError(
                f"{name} is stored as {info.dtype} without its {scale}: an FP8 weight cannot "
                "be read without its scales; download every shard of the checkpoint again"
            )
        out[name] = info
    orphans = sorted(s for s in scales if s[: -len(suffix)] not in infos)
    if orphans:
        raise HFImportError(
            f"scales without their weights: {orphans[:5]}; download every shard of the "
            "checkpoint again"
        )
    return out


def _block_of(
    shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int] | None
) -> tuple[int, int] | None:
    """The block each scale of a weight covers (None: one scale for all of it), or why the
    scales do not tile it. ``block`` None: one scale, one a row, or a grid that divides."""
    rows, cols = shape[-2:]
    size = int(np.prod(scale_shape))
    if size == 1:
        return None
    if len(scale_shape) == 1 and size == rows:  # one a row, stored flat
        return 1, cols
    if len(scale_shape) < 2:
        raise HFImportError(
            f"scales {list(scale_shape)} for an FP8 weight [{rows}, {cols}] are neither one, "
            "one a row, nor a grid of blocks; download the checkpoint again"
        )
    if block is None:
        grid_rows, grid_cols = scale_shape[-2:]
        if rows % grid_rows or cols % grid_cols:
            raise HFImportError(
                f"an FP8 weight [{rows}, {cols}] with a [{grid_rows}, {grid_cols}] scale grid "
                "that does not divide it and no block size in quantization_config "
                "(weight_block_size, or compressed-tensors' block_structure); add the block "
                "size the checkpoint was quantized with"
            )
        block = (rows // grid_rows, cols // grid_cols)
    need = (*shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_shape) != need:
        raise HFImportError(
            f"an FP8 weight {list(shape)} in blocks of {list(block)} needs scales "
            f"{list(need)}, the checkpoint has {list(scale_shape)}; the config's block size "
            "(weight_block_size or block_structure) does not match its scales: fix the config"
        )
    return block


def dequantize(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int] | None) -> np.ndarray:
    """``weight`` (FP8, [..., rows, columns]) times its scale repeated over each block,
    float32. ``block`` None: one scale, or a scale grid whose blocks divide the tensor (one
    a row: compressed-tensors' channel scales, [rows, 1])."""
    value = np.asarray(weight, np.float32)
    scale = np.asarray(scale, np.float32)
    covered = _block_of(value.shape, scale.shape, block)
    if covered is None:
        return value * scale.reshape(())
    rows, cols = value.shape[-2:]
    grid = scale.reshape(*value.shape[:-2], -(-rows // covered[0]), -(-cols // covered[1]))
    full = np.repeat(np.repeat(grid, covered[0], axis=-2), covered[1], axis=-1)
    return value * full[..., :rows, :cols]


def read_scales(infos: dict[str, safetensors_io.TensorInfo]) -> dict[str, np.ndarray]:
    """Every FP8 weight's scale (small: one number a block), by the weight's stored name,
    read from whichever file holds it; an MXFP8 power-of-two scale as its float32 value."""
    wanted: dict[str, list[str]] = {}
    weight_of: dict[str, str] = {}  # a scale's stored name -> its weight's
    for name, info in infos.items():
        if info.scale is not None and info.scale.name not in weight_of:
            wanted.setdefault(info.scale.file, []).append(info.scale.name)
            weight_of[info.scale.name] = info.stored_as or name
    scales: dict[str, np.ndarray] = {}
    for path, names in wanted.items():
        for name, array in safetensors_io.read_file_tensors(path, names):
            if array.dtype == np.uint8:  # UE8M0 exponents saved as bytes (transformers')
                array = np.exp2(array.astype(np.float32) - 127)
            scales[weight_of[name]] = np.asarray(array, np.float32)
    return scales
