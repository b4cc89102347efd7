"""safetensors files with NumPy only: headers, streamed tensor reads, sharded writes.

``safetensors.numpy`` has no bfloat16 or FP8 (NumPy has none), so BF16 and FP8 tensors
(``fp8.py``) are read from the file's raw bytes as their ``ml_dtypes`` type and written
the same way; everything else goes through ``safe_open(framework="np")``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Iterator

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),  # MXFP8's power-of-two scales
    "U8": np.dtype(np.uint8),  # the same scales as exponent bytes (transformers saves them so)
}
# Read from the raw bytes: the types NumPy lacks, by the unsigned integer of their width.
RAW = {name: np.dtype(f"u{DTYPES[name].itemsize}") for name in DTYPES if name[:2] in ("BF", "F8")}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class CheckpointFileError(ValueError):
    """A checkpoint folder whose weight files cannot be read."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where a tensor lives and what it is, from the file header alone."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    stored_as: str = ""  # its name in the file when it is known by another ('' = the same)
    part: tuple[int, ...] = ()  # (expert, first row, end row) of a fused tensor (hf/moe.py)
    rows: tuple[int, ...] = ()  # the rows of a fused projection it is (hf/qwen3_next.py)
    transposed: bool = False  # a fused expert stored [in, out] (Qwen3-VL MoE's; hf/moe.py)
    scale: Scale | None = None  # an FP8 weight's scales (hf/fp8.py)


@dataclasses.dataclass(frozen=True, slots=True)
class Scale:
    """Where an FP8 weight's ``weight_scale_inv`` is, and the config's block size (None:
    one scale, or a grid that divides the weight)."""

    file: str
    name: str
    shape: tuple[int, ...]
    block: tuple[int, int] | None


def checkpoint_files(hf_dir: str) -> list[str]:
    """The safetensors files of a checkpoint folder (from its index when sharded)."""
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as handle:
                weight_map = json.load(handle).get("weight_map", {})
        except (ValueError, AttributeError) as error:  # not JSON, or not an object
            raise CheckpointFileError(
                f"{index} is not a safetensors index ({error}); download it again"
            ) from None
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.exists(os.path.join(hf_dir, name))]
        if missing:
            raise CheckpointFileError(
                f"{index} names shard files that are not in {hf_dir}: {missing}; "
                "download every shard of the checkpoint"
            )
        return [os.path.join(hf_dir, name) for name in files]
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.exists(single):
        return [single]
    has_bin = any(name.endswith(".bin") for name in os.listdir(hf_dir))
    hint = (
        "it has PyTorch .bin weights: re-save them as safetensors with transformers "
        "(model.save_pretrained(dir, safe_serialization=True))"
        if has_bin
        else "download the model's *.safetensors files (and their index) into it"
    )
    raise CheckpointFileError(f"{hf_dir} has no {SINGLE_FILE} or {INDEX_FILE}; {hint}")


def tensor_infos(files: list[str]) -> dict[str, TensorInfo]:
    """Name -> (file, dtype, shape) for every tensor of ``files``, reading headers only."""
    infos: dict[str, TensorInfo] = {}
    for path in files:
        try:
            with safe_open(path, framework="np") as handle:
                for name in handle.keys():
                    view = handle.get_slice(name)
                    infos[name] = TensorInfo(path, view.get_dtype(), tuple(view.get_shape()))
        except SafetensorError as error:
            raise CheckpointFileError(
                f"{path} is not a readable safetensors file ({error}); download it again"
            ) from None
    return infos


def _header(path: str) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset where its data starts."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length)), 8 + length


def read_file_tensors(path: str, names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``names`` from one file, one tensor in memory at a time."""
    header, data_start = _header(path)
    with safe_open(path, framework="np") as handle:
        for name in names:
            entry = header[name]
            if entry["dtype"] not in DTYPES:
                raise CheckpointFileError(
                    f"{path}: tensor {name} has dtype {entry['dtype']}; alignpipe reads "
                    f"{sorted(DTYPES)} (of quantized checkpoints, FP8 only)"
                )
            raw_dtype = RAW.get(entry["dtype"])
            if raw_dtype is None:
                yield name, handle.get_tensor(name)
                continue
            begin, end = entry["data_offsets"]
            raw = np.fromfile(
                path,
                dtype=raw_dtype,
                count=(end - begin) // raw_dtype.itemsize,
                offset=data_start + begin,
            )
            yield name, raw.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def write_file(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Write one safetensors file (``format: pt`` metadata, which transformers requires)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, array in tensors.items():
        if array.dtype not in DTYPE_NAMES:
            raise ValueError(f"cannot write tensor {name} of dtype {array.dtype}")
        header[name] = {
            "dtype": DTYPE_NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for array in tensors.values():
            handle.write(np.ascontiguousarray(array).tobytes())


def write_checkpoint(
    out_dir: str, tensors: dict[str, np.ndarray], max_shard_bytes: int
) -> list[str]:
    """Write ``tensors`` as one file or as shards plus an index, as transformers does."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        write_file(os.path.join(out_dir, SINGLE_FILE), shards[0])
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file_name, shard in zip(names, shards, strict=True):
        write_file(os.path.join(out_dir, file_name), shard)
        weight_map.update({name: file_name for name in shard})
    index = {
        "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(os.path.join(out_dir, INDEX_FILE), "w") as handle:
        json.dump(index, handle, indent=2)
    return names
