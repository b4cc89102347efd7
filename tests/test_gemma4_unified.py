"""Gemma 4 12B: transformers 5.25's ``gemma4_unified`` (``Gemma4UnifiedForConditionalGeneration``
and ``Gemma4UnifiedForCausalLM``), read as the Gemma 4 text model it computes as.

Its text layers are Gemma 4's without per-layer inputs or the MoE block, beside an
encoder-free image and audio embedder (no vision tower). The checkpoints here are built
with transformers' own classes from the gemma4_mm fixture's text config (sliding and full
layers of two shapes, keys as values, shared KV layers, final softcap), randomised as the
fixtures are (tests/make_hf_fixtures.py), and saved in a temporary folder with the
fixture's tokenizer and template. transformers runs here live.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from make_hf_fixtures import randomise
from transformers.models.gemma4_unified import configuration_gemma4_unified as unified

from components.core.model.artifact import load_model
from components.hf.export import export_hf
from components.hf.families import model_config_from_hf
from components.hf.importer import import_hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")  # fmt: skip
# Gemma 4's per-layer inputs and MoE fields, which the unified text class does not have.
NOT_UNIFIED = ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block",
               "num_experts", "top_k_experts", "moe_intermediate_size", "model_type")  # fmt: skip
LENGTH = 512


def _text_config() -> dict:
    text = json.loads((FIXTURES / "gemma4_mm" / "config.json").read_text())["text_config"]
    return {k: v for k, v in text.items() if k not in NOT_UNIFIED}


def _save(model: torch.nn.Module, folder: pathlib.Path) -> pathlib.Path:
    randomise(model, "gemma4")
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(FIXTURES / "gemma4_mm" / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The multimodal checkpoint and the causal LM, saved by transformers."""
    root = tmp_path_factory.mktemp("gemma4_unified")
    vision = {"mm_embed_dim": 32, "output_proj_dims": 32, "mm_posemb_size": 16}
    config = unified.Gemma4UnifiedConfig(
        text_config=_text_config(), vision_config=vision, boi_token_id=304, eoi_token_id=303,
        image_token_id=305,
    )  # fmt: skip
    torch.manual_seed(0)
    multimodal = transformers.Gemma4UnifiedForConditionalGeneration(config).eval()
    causal = transformers.Gemma4UnifiedForCausalLM(
        unified.Gemma4UnifiedTextConfig(**_text_config())
    ).eval()
    return {
        "multimodal": _save(multimodal, root / "multimodal"),
        "causal": _save(causal, root / "causal"),
    }


def _theirs_logits(folder: pathlib.Path, tokens: np.ndarray) -> np.ndarray:
    auto = transformers.AutoModelForImageTextToText
    if "CausalLM" in json.loads((folder / "config.json").read_text())["architectures"][0]:
        auto = transformers.AutoModelForCausalLM
    model = auto.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _our_logits(artifact: str, tokens: np.ndarray) -> np.ndarray:
    model, _ = load_model(artifact, dtype="float32")
    ids = jnp.asarray(tokens, jnp.int32)
    return np.asarray(model.lm_logits(model(ids, jnp.ones_like(ids))))


def _tokens(length: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 300, size=(2, length))


@pytest.mark.parametrize("kind", ["multimodal", "causal"])
def test_logits_match_transformers_at_512_tokens(checkpoints, kind, tmp_path):
    folder = checkpoints[kind]
    result = import_hf(str(folder), str(tmp_path / "imported"))
    tokens = _tokens(LENGTH)
    got, expected = _our_logits(result["out"], tokens), _theirs_logits(folder, tokens)
    assert np.abs(got - expected).max() < 1e-4  # measured 3.1e-5 (multimodal)
    _, info = load_model(result["out"], dtype="float32")
    assert info["hf"]["family"] == "gemma4"
    if kind == "multimodal":  # the image and audio embedders' tensors are left out
        assert info["hf"]["text_only"]["exports_as"] == "Gemma4ForCausalLM"
        assert info["hf"]["text_only"]["tensors_left_out"] == 10


def test_export_loads_in_transformers_as_gemma4_text(checkpoints, tmp_path):
    imported = import_hf(str(checkpoints["multimodal"]), str(tmp_path / "imported"))["out"]
    out = tmp_path / "export"
    export_hf(imported, str(out), dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForCausalLM"]
    assert config["hidden_size_per_layer_input"] == 0  # no per-layer inputs
    tokens = _tokens(70)
    np.testing.assert_allclose(
        _theirs_logits(out, tokens), _theirs_logits(checkpoints["multimodal"], tokens), atol=1e-5
    )


def test_the_unified_text_class_defaults_and_ignored_fields():
    """Fields a text_config leaves out take Gemma4UnifiedTextConfig's defaults (a window of
    1,024, not Gemma 4's 512; no per-layer inputs); Gemma 4's per-layer input and MoE fields,
    which its layers never build, change nothing."""
    text = _text_config()
    del text["sliding_window"], text["max_position_embeddings"]
    hf = {"architectures": ["Gemma4UnifiedForConditionalGeneration"], "text_config": text}
    config = model_config_from_hf(hf, dtype="float32")
    theirs = unified.Gemma4UnifiedTextConfig(**text)
    assert config.sliding_window == theirs.sliding_window == 1024
    assert config.max_seq_len == theirs.max_position_embeddings == 262_144
    assert config.per_layer_dim == 0
    stray = {**text, "hidden_size_per_layer_input": 256, "enable_moe_block": True}
    assert model_config_from_hf({**hf, "text_config": stray}, dtype="float32") == config
    # A Gemma 4 (not unified) text config of the same fields has per-layer inputs by default.
    plain = {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
    assert model_config_from_hf(plain, dtype="float32").per_layer_dim == 256
