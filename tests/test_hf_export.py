"""Hugging Face export: exact round trips, configs, tokenizer files, shards, refusals, CLI.

That ``transformers`` loads an export unchanged (same logits, same chat template)
is checked by hand with ``tests/make_hf_fixtures.py --verify-export``.
"""

from __future__ import annotations

import json
import os
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from components.core.data.tokenizers import load_tokenizer
from components.core.model.artifact import create_model, load_model, save_model
from components.core.training.checkpoint import read_model_config
from components.hf import safetensors_io
from components.hf.export import ExportError, export_hf
from components.hf.families import (
    LANGUAGE_MODEL_PREFIXES,
    family_of_config,
    model_config_from_hf,
)
from components.hf.importer import import_hf
from pipelines.cli.main import main

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
FAMILIES = (
    "llama", "qwen2", "gemma2", "qwen3", "qwen3_untied", "mistral", "gemma3", "qwen3_5", "gemma4",
    "ministral3",
)  # fmt: skip
CONFIG_KEYS = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "query_pre_attn_scalar",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "sliding_window",
    "layer_types",
)


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """Each fixture imported, then exported: family -> (artifact, export folder)."""
    root = tmp_path_factory.mktemp("round_trip")
    done = {}
    for family in (*FAMILIES, "gemma3_mm"):
        artifact, exported = str(root / family), str(root / f"{family}_hf")
        import_hf(str(FIXTURES / family), artifact)
        export_hf(artifact, exported)
        done[family] = (artifact, exported)
    return done


def all_tensors(folder: str) -> dict[str, np.ndarray]:
    infos = safetensors_io.tensor_infos(safetensors_io.checkpoint_files(folder))
    tensors = {}
    for path in sorted({info.file for info in infos.values()}):
        names = [n for n, info in infos.items() if info.file == path]
        tensors.update(safetensors_io.read_file_tensors(path, names))
    return tensors


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_gives_identical_tensors(round_trips, family):
    original, exported = all_tensors(str(FIXTURES / family)), all_tensors(round_trips[family][1])
    assert sorted(exported) == sorted(original)
    for name, array in original.items():
        assert exported[name].dtype == array.dtype, name
        np.testing.assert_array_equal(exported[name], array, err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_config_matches_the_original(round_trips, family):
    original = json.loads((FIXTURES / family / "config.json").read_text())
    exported = json.loads((pathlib.Path(round_trips[family][1]) / "config.json").read_text())
    for key in CONFIG_KEYS:
        assert exported.get(key) == original.get(key), key
    # Qwen3.5's M-RoPE sections describe image positions; text-only they rotate as 1-D rotary.
    mrope = ("mrope_section", "mrope_interleaved")
    rope = {k: v for k, v in original["rope_parameters"].items() if k not in mrope}
    if rope.get("rope_type") == "yarn":  # mscale and mscale_all_dim come back as their ratio
        rope = {k: v for k, v in rope.items() if k not in ("mscale", "mscale_all_dim")}
        rope["attention_factor"] = exported["rope_parameters"]["attention_factor"]
    assert exported["rope_parameters"] == rope
    assert model_config_from_hf(exported, dtype="float32") == model_config_from_hf(
        original, dtype="float32"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_tokenizer_is_the_original(round_trips, family):
    exported = pathlib.Path(round_trips[family][1])
    original = FIXTURES / family
    assert (exported / "tokenizer.json").read_bytes() == (original / "tokenizer.json").read_bytes()
    config = json.loads((exported / "tokenizer_config.json").read_text())
    expected = json.loads((original / "tokenizer_config.json").read_text())
    if family == "llama":  # import names the reserved pad token Llama 3 leaves unset
        expected["pad_token"] = "<|finetune_right_pad_id|>"
    if family == "mistral":  # Mistral has none either: its <unk> serves
        expected["pad_token"] = "<unk>"
    assert config == expected
    template = original / "chat_template.jinja"  # transformers 5's place for the template
    assert (exported / "chat_template.jinja").exists() == template.exists()
    if template.exists():
        assert (exported / "chat_template.jinja").read_text() == template.read_text()


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_generation_config_keeps_the_stop_set(round_trips, family):
    original = json.loads((FIXTURES / family / "generation_config.json").read_text())
    exported = json.loads(
        (pathlib.Path(round_trips[family][1]) / "generation_config.json").read_text()
    )
    listed = [exported["eos_token_id"], original["eos_token_id"]]
    listed = [ids if isinstance(ids, list) else [ids] for ids in listed]
    assert listed[0] == listed[1]
    if family in ("qwen3", "gemma3", "qwen3_5", "gemma4"):  # the end-of-turn token and eos
        assert len(listed[0]) == 2


def test_a_multimodal_gemma3_exports_its_language_model_as_gemma3_for_causal_lm(round_trips):
    artifact, exported = round_trips["gemma3_mm"]
    original = all_tensors(str(FIXTURES / "gemma3_mm"))
    # transformers 5 saves the language model under 4.x's names (language_model.model.)
    text = {
        "model." + name[len(prefix) :]: array
        for name, array in original.items()
        for prefix in LANGUAGE_MODEL_PREFIXES
        if name.startswith(prefix)
    }
    tensors = all_tensors(exported)
    assert sorted(tensors) == sorted(text) and len(original) > len(text)
    for name, array in text.items():
        np.testing.assert_array_equal(tensors[name], array, err_msg=name)
    config = json.loads((pathlib.Path(exported) / "config.json").read_text())
    text_config = json.loads((FIXTURES / "gemma3_mm" / "config.json").read_text())["text_config"]
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text"
    for key in ("layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar"):
        assert config[key] == text_config[key], key
    assert read_model_config(artifact)["hf"]["text_only"]["tensors_left_out"] == len(
        original
    ) - len(text)


def test_sharded_export_reimports_to_the_same_params(round_trips, tmp_path):
    artifact = round_trips["gemma2"][0]
    export_hf(artifact, str(tmp_path / "hf"), dtype="float32", max_shard_bytes=40_000)
    assert (tmp_path / "hf" / safetensors_io.INDEX_FILE).exists()
    assert len(safetensors_io.checkpoint_files(str(tmp_path / "hf"))) > 2
    import_hf(str(tmp_path / "hf"), str(tmp_path / "again"))
    first, _ = load_model(artifact)
    second, _ = load_model(str(tmp_path / "again"))
    same = jax.tree.map(np.array_equal, nnx.state(first, nnx.Param), nnx.state(second, nnx.Param))
    assert all(jax.tree.leaves(same))


def test_a_policy_trained_from_a_preset_exports_as_llama(round_trips, tmp_path):
    tokenizer_dir = f"{round_trips['llama'][0]}/tokenizer"
    tokenizer = load_tokenizer(tokenizer_dir)
    model = create_model("tiny", tokenizer.vocab_size, scalar_head=False, seed=3)
    policy = str(tmp_path / "policy")
    save_model(
        policy,
        model,
        nnx.state(model, nnx.Param),
        tokenizer=tokenizer.info(),
        stage="ppo",
        training={},
        step=7,
    )
    summary = export_hf(policy, str(tmp_path / "hf"), tokenizer_dir=tokenizer_dir)
    assert summary["family"] == "llama" and summary["dtype"] == "bfloat16"
    import_hf(str(tmp_path / "hf"), str(tmp_path / "again"), dtype="float32")
    again, _ = load_model(str(tmp_path / "again"))
    for ours, back in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(again, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_allclose(back, ours, rtol=1e-2, atol=1e-3)  # bf16 rounding only


def test_export_refusals(round_trips, tmp_path):
    artifact = round_trips["qwen2"][0]
    with pytest.raises(ExportError, match="fingerprint"):
        export_hf(
            artifact, str(tmp_path / "a"), tokenizer_dir=f"{round_trips['llama'][0]}/tokenizer"
        )
    with pytest.raises(ExportError, match="--tokenizer"):
        export_hf(artifact, str(tmp_path / "b"), tokenizer_dir=str(tmp_path))
    reward = create_model("tiny", 300, scalar_head=True, seed=0)
    save_model(
        str(tmp_path / "rm"),
        reward,
        nnx.state(reward, nnx.Param),
        tokenizer={},
        stage="reward",
        training={},
        step=1,
    )
    with pytest.raises(ExportError, match="scalar"):
        export_hf(str(tmp_path / "rm"), str(tmp_path / "c"))


def test_mixed_family_features_are_not_exportable():
    config = model_config_from_hf(
        json.loads((FIXTURES / "qwen2" / "config.json").read_text()), dtype="float32"
    )
    assert family_of_config(config) == "qwen2"
    mixed = config.__class__(**{**config.to_dict(), "attn_logit_softcap": 50.0})
    with pytest.raises(ValueError, match="mixes family features"):
        family_of_config(mixed)


def test_cli_export(round_trips, tmp_path, capsys):
    artifact = round_trips["llama"][0]
    assert main(["model", "export", artifact, str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["family"] == "llama" and summary["dtype"] == "float32"
    assert read_model_config(artifact)["hf"]["dtype"] == "bfloat16"
    assert main(["model", "export", str(tmp_path / "missing"), str(tmp_path / "x")]) == 2
    assert "not a complete model artifact" in capsys.readouterr().err
    # Into a folder that holds files (an earlier export: its shards would stay), a file, the
    # artifact itself, or with a shard size that is no size: refused, nothing written.
    (tmp_path / "file").write_text("x")
    hf_files = sorted(os.listdir(tmp_path / "hf"))
    refusals = {
        (str(tmp_path / "hf"),): "already holds files",
        (str(tmp_path / "file"),): "is a file",
        (artifact,): "or inside it",
        (str(tmp_path / "new"), "--max-shard-gb", "nan"): "--max-shard-gb nan: pass a size",
        (str(tmp_path / "new"), "--max-shard-gb", "0"): "--max-shard-gb 0.0: pass a size",
    }
    for args, message in refusals.items():
        assert main(["model", "export", artifact, *args]) == 2
        assert message in capsys.readouterr().err, message
    assert sorted(os.listdir(tmp_path / "hf")) == hf_files and not (tmp_path / "new").exists()
    assert read_model_config(artifact)["stage"] == "import"
    # A promotion root exports its current version.
    root = tmp_path / "promoted"
    assert main(["promote", artifact, "--to", str(root)]) == 0
    assert main(["model", "export", str(root), str(tmp_path / "hf2"), "--dtype", "float32"]) == 0
    assert "the current version of" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path / "hf2")) == hf_files
