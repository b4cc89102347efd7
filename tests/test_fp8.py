"""FP8 checkpoints (components/hf/fp8.py): imported dequantized, as transformers loads them.

The FP8 folders are made here from the 16-bit fixtures, the way the releases store them:
each linear weight of the layers as float8_e4m3fn with a float32 ``weight_scale_inv``,
one a block (Qwen3's -FP8 releases: ``weight_block_size`` [128, 128], here [16, 16] to fit
the fixtures) or one a tensor with an ``activation_scale`` beside it (Ministral 3 Instruct,
``weight_block_size`` null, under the multimodal wrapper's config); embeddings, norms,
routers and the head stay 16-bit. transformers 5 loads them on this CPU by dequantizing
(its ``Fp8Dequantize``): the reference.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from test_hf_export import all_tensors  # every tensor of a folder, by name
from test_hf_import import copy_fixture, edit_json

from components.core.model.artifact import load_model
from components.hf import fp8, safetensors_io
from components.hf.importer import HFImportError, check_hf, import_hf
from pipelines.cli.main import main

FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = float(ml_dtypes.finfo(FP8).max)
TOKENS = np.random.default_rng(0).integers(0, 300, size=(2, 24))
CLOSE = 1e-4  # float32 on both sides; measured 4-5e-6


def _quantize(weight: np.ndarray, block: tuple[int, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """(FP8 weight, its weight_scale_inv): amax / 448 a block, as the releases scale."""
    value = np.asarray(weight, np.float32)
    if block is None:
        scale = np.float32(np.abs(value).max() / FP8_MAX)
        return (value / scale).astype(FP8), np.asarray(scale, np.float32)
    rows, cols = value.shape
    grid = np.zeros((-(-rows // block[0]), -(-cols // block[1])), np.float32)
    quantized = np.zeros_like(value)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            cut = np.s_[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            grid[i, j] = np.abs(value[cut]).max() / FP8_MAX
            quantized[cut] = value[cut] / grid[i, j]
    return quantized.astype(FP8), grid


def _quantize_rows(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FP8 weight, its weight_scale [rows, 1]): compressed-tensors' channel strategy."""
    value = np.asarray(weight, np.float32)
    scale = (np.abs(value).max(axis=1, keepdims=True) / FP8_MAX).astype(np.float32)
    return (value / scale).astype(FP8), scale


COMPRESSED_TENSORS = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                        "symmetric": True, "dynamic": False, "group_size": None,
                        "block_structure": None},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
    "quantization_status": "compressed",
}  # fmt: skip


def _rewrite(folder: pathlib.Path, change) -> None:
    """Write the folder's (single) weight file again as ``change(its tensors)``."""
    path = str(folder / safetensors_io.SINGLE_FILE)
    safetensors_io.write_file(path, change(all_tensors(str(folder))))


def _quantized_copy(family, tmp_path, quantize_linear, quantization) -> pathlib.Path:
    """A copy of a fixture whose layers' linear weights are replaced by
    ``quantize_linear(name, weight)`` (the weight and what is stored beside it), with
    ``quantization`` as its config's ``quantization_config``."""
    folder = copy_fixture(family, tmp_path)

    def change(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for name, array in tensors.items():
            linear = name.endswith("_proj.weight") and array.ndim == 2
            out.update(quantize_linear(name, array) if linear else {name: array})
        return out

    _rewrite(folder, change)
    edit_json(folder / "config.json", quantization_config=quantization)
    return folder


def compressed_tensors_copy(family: str, tmp_path: pathlib.Path) -> pathlib.Path:
    """A copy of a fixture as llm-compressor's FP8_DYNAMIC saves it (one scale a row, named
    ``weight_scale``)."""

    def rows(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
        quantized, scale = _quantize_rows(weight)
        return {name: quantized, name + "_scale": scale}

    return _quantized_copy(family, tmp_path, rows, COMPRESSED_TENSORS)


def fp8_copy(
    family: str, tmp_path: pathlib.Path, block: tuple[int, int] | None, scales=np.float32
) -> pathlib.Path:
    """A copy of a fixture with its layers' linear weights stored in FP8, their scales in
    ``scales`` (Qwen3's releases float32, Qwen3.5's and 3.6's bfloat16)."""

    def blocks(name: str, weight: np.ndarray) -> dict[str, np.ndarray]:
        quantized, scale = _quantize(weight, block)
        stored = {name: quantized, name + "_scale_inv": np.asarray(scale).astype(scales)}
        if block is None:  # static activation quantization, as Ministral 3's
            stored[name.replace(".weight", ".activation_scale")] = np.float32(0.5)
        return stored

    quantization = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "static" if block is None else "dynamic",
        "weight_block_size": None if block is None else list(block),
        "modules_to_not_convert": ["lm_head"],
    }
    return _quantized_copy(family, tmp_path, blocks, quantization)


def _ours(artifact: str) -> np.ndarray:
    model, _ = load_model(artifact, dtype="float32")
    ids = jnp.asarray(TOKENS, jnp.int32)
    return np.asarray(model.lm_logits(model(ids, jnp.ones_like(ids))))


def _theirs(folder: pathlib.Path, multimodal: bool = False) -> np.ndarray:
    auto = transformers.AutoModelForImageTextToText if multimodal else None
    kind = auto or transformers.AutoModelForCausalLM
    model = kind.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


CASES = {
    "qwen3, blocks of 16 x 16": ("qwen3", (16, 16), False, np.float32),
    # Blocks that divide the experts' 24 rows: transformers' CPU dequantization derives a
    # block from the scale grid (24 rows / 2 scales = 12), not the config's, where the
    # releases' kernels and DeepSeek's reference cut the last block (the test below);
    # every released shape divides into 128 x 128.
    "qwen3_moe (each expert), blocks of 8 x 8, bfloat16 scales": (
        "qwen3_moe",
        (8, 8),
        False,
        ml_dtypes.bfloat16,
    ),  # fmt: skip
    "ministral3_mm, one scale a tensor": ("ministral3_mm", None, True, np.float32),
    # Mistral Small 4's latent projections in blocks, dequantized before the interleaved
    # rotary rows are reordered: the slow tier (the FP8 reading is the others').
    "mistral4_mm, blocks of 4 x 4": ("mistral4_mm", (4, 4), True, ml_dtypes.bfloat16),
}
SLOW = ("mistral4_mm, blocks of 4 x 4",)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in sorted(CASES)]
)
def test_fp8_imports_as_transformers_dequantizes_it(tmp_path, case):
    family, block, multimodal, scales = CASES[case]
    folder = fp8_copy(family, tmp_path / "fp8", block, scales)
    summary = import_hf(str(folder), str(tmp_path / "imported"), dtype="float32")
    assert summary["fp8_weights"] > 0
    theirs = _theirs(folder, multimodal)
    apart = np.abs(_ours(summary["out"]) - theirs).max()
    assert apart < CLOSE
    # Not a trivial case: FP8 rounds each weight by up to ~6%, and the FP8 model computes
    # other logits than its 16-bit original, close to them on the whole.
    original = _theirs(copy_fixture(family, tmp_path / "original"), multimodal)
    moved = np.abs(original - theirs)
    print(f"{case}: {apart:.1e} from transformers; FP8 moved the logits {moved.max():.3f} at most")
    assert moved.max() > 1e-2 and moved.mean() < 0.2 * np.abs(original).mean()


def test_compressed_tensors_fp8_with_a_scale_a_row_imports_dequantized(tmp_path):
    """llm-compressor's FP8_DYNAMIC copies (compressed-tensors, which transformers reads only
    with that package installed): the reference is transformers on a float32 copy holding
    the dequantized weights, each FP8 row times its scale."""
    folder = compressed_tensors_copy("qwen3", tmp_path / "ct")
    artifact = import_hf(str(folder), str(tmp_path / "imported"), dtype="float32")["out"]
    stored = all_tensors(str(folder))
    dequantized = {
        name: array.astype(np.float32) * stored[name + "_scale"]
        for name, array in stored.items()
        if name + "_scale" in stored
    }
    reference = copy_fixture("qwen3", tmp_path / "reference")
    _rewrite(reference, lambda tensors: {**tensors, **dequantized})
    assert np.abs(_ours(artifact) - _theirs(reference)).max() < CLOSE


def test_the_export_is_unquantized_and_computes_the_same(tmp_path):
    folder = fp8_copy("qwen3", tmp_path / "fp8", (16, 16))
    artifact = import_hf(str(folder), str(tmp_path / "imported"))["out"]
    out = tmp_path / "export"
    assert main(["model", "export", artifact, str(out), "--dtype", "float32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    infos = safetensors_io.tensor_infos(safetensors_io.checkpoint_files(str(out)))
    assert {info.dtype for info in infos.values()} == {"F32"}
    assert not any(name.endswith(("_scale_inv", "activation_scale")) for name in infos)
    np.testing.assert_allclose(_theirs(out), _theirs(folder), atol=1e-5, rtol=0)


def test_a_last_block_past_the_tensor_is_cut_to_it():
    """DeepSeek's and llama.cpp's dequantization: ceil(rows / block) scales, the last block
    cut; here [7, 11] in blocks of [3, 5] (scales [3, 3])."""
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(7, 11)).astype(np.float32)
    quantized, scales = _quantize(weight, (3, 5))
    assert scales.shape == (3, 3)
    expected = np.empty_like(weight)
    for i in range(7):
        for j in range(11):
            expected[i, j] = float(quantized[i, j]) * scales[i // 3, j // 5]
    np.testing.assert_array_equal(fp8.dequantize(quantized, scales, (3, 5)), expected)
    assert np.abs(expected - weight).max() < 0.07 * np.abs(weight).max()  # FP8's rounding
    with pytest.raises(HFImportError, match=r"needs scales \[3, 3\], the checkpoint has \[2, 3\]"):
        fp8.dequantize(quantized, scales[:2], (3, 5))
    with pytest.raises(HFImportError, match="does not divide it and no block size"):
        fp8.dequantize(quantized, scales, None)


def test_mxfp8_power_of_two_scales_read_as_their_values(tmp_path):
    """MXFP8's scales stored as float8_e8m0fnu, or as exponent bytes: read as 2 ** e."""
    path = str(tmp_path / "m.safetensors")
    scales = np.asarray([[0.25, 2.0], [1.0, 64.0]], np.float32)
    weight = np.asarray(np.arange(16).reshape(4, 4) / 4, np.float32).astype(FP8)
    tensors = {"w.weight": weight, "w.weight_scale_inv": scales.astype(ml_dtypes.float8_e8m0fnu)}
    safetensors_io.write_file(path, tensors)
    infos = fp8.attach_scales(safetensors_io.tensor_infos([path]), {})
    assert list(infos) == ["w.weight"] and infos["w.weight"].scale.shape == (2, 2)
    read = fp8.read_scales(infos)["w.weight"]
    np.testing.assert_array_equal(read, scales)
    # The same exponents as bytes (transformers saves UE8M0 scales so): 2 ** (byte - 127).
    tensors["w.weight_scale_inv"] = (np.log2(scales) + 127).astype(np.uint8)
    safetensors_io.write_file(path, tensors)
    infos = fp8.attach_scales(safetensors_io.tensor_infos([path]), {})
    np.testing.assert_array_equal(fp8.read_scales(infos)["w.weight"], scales)
    # Bytes anywhere else are packed integer weights, not read as numbers.
    safetensors_io.write_file(path, {**tensors, "v.weight": np.zeros((4, 2), np.uint8)})
    with pytest.raises(HFImportError, match=r"v\.weight is stored as U8 \(packed integers"):
        fp8.attach_scales(safetensors_io.tensor_infos([path]), {})
    expected = weight.astype(np.float32) * np.repeat(np.repeat(scales, 2, 0), 2, 1)
    np.testing.assert_array_equal(fp8.dequantize(weight, read, None), expected)


def test_what_the_import_cannot_read_is_refused_by_name(tmp_path):
    folder = fp8_copy("qwen3", tmp_path / "no_scale", (16, 16))
    dropped = "model.layers.1.mlp.down_proj.weight_scale_inv"
    _rewrite(folder, lambda tensors: {n: a for n, a in tensors.items() if n != dropped})
    unscaled = r"down_proj\.weight is stored as F8_E4M3 without its .*_scale_inv.*every shard"
    with pytest.raises(HFImportError, match=unscaled):
        import_hf(str(folder), str(tmp_path / "a"))
    # Scales that do not tile their weight: named, from the headers (the preflight's check).
    folder = fp8_copy("qwen3", tmp_path / "wrong_block", (16, 16))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [8, 8]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match=r"proj\.weight \(.*model\.safetensors\): .*"
                       r"block_structure. does not match its scales: fix the config"):  # fmt: skip
        check_hf(str(folder))
    # A multimodal wrapper's outer quantization_config is read, not only its text config's.
    folder = copy_fixture("qwen3_5_mm", tmp_path / "awq")
    edit_json(folder / "config.json", quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(HFImportError, match="quantization_config=.*awq.*other than FP8"):
        check_hf(str(folder))
    int4 = {**COMPRESSED_TENSORS, "format": "pack-quantized"}  # llm-compressor's W4A16
    for method, quantization in {
        "gptq": {"quant_method": "gptq", "bits": 4},
        "w4a16": int4,
    }.items():
        folder = copy_fixture("qwen3", tmp_path / method)
        edit_json(folder / "config.json", quantization_config=quantization)
        with pytest.raises(HFImportError, match="quantized weights other than FP8.*BF16"):
            import_hf(str(folder), str(tmp_path / f"{method}-out"))
