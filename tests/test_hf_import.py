"""Hugging Face import: parity with transformers, tokenizers, pipeline use, bad inputs, CLI.

The fixtures under tests/fixtures/hf come from tests/make_hf_fixtures.py (run by
hand with torch and transformers); these tests read them and need neither.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from components.core.data.tokenizers import load_tokenizer
from components.core.model.artifact import load_model, stage_model
from components.core.model.transformer import Transformer, model_config
from components.core.training.checkpoint import read_model_config
from components.hf import safetensors_io
from components.hf.families import HFImportError, model_config_from_hf
from components.hf.importer import import_hf, resolve_base
from pipelines.cli.main import main

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
FAMILIES = (
    "llama", "qwen2", "gemma2", "qwen3", "qwen3_untied", "mistral", "gemma3", "gemma3_mm",
    "qwen3_5", "qwen3_5_mm", "gemma4", "gemma4_mm", "ministral3", "ministral3_mm", "qwen3_moe",
    "qwen3_5_moe_mm", "gemma4_moe", "mixtral", "qwen2_moe", "qwen3_next", "qwen3_vl",
    "qwen3_vl_moe",
)  # fmt: skip
# Ministral 3 is read as a Mistral (components/hf/mistral3.py); a MoE as its dense family
# with experts (components/core/model/moe.py); Qwen3-Next as a Qwen3.5 MoE (hf/qwen3_next.py).
FAMILY_OF = {
    "ministral3": "mistral", "qwen3_moe": "qwen3", "qwen3_5_moe": "qwen3_5", "gemma4_moe": "gemma4",
    "mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_next": "qwen3_5", "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3",
}  # fmt: skip


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, str]:
    """Each family's fixture imported once as a model artifact."""
    root = tmp_path_factory.mktemp("imported")
    return {f: import_hf(str(FIXTURES / f), str(root / f))["out"] for f in FAMILIES}


def reference(family: str) -> tuple[jax.Array, np.ndarray]:
    """The fixture's tokens and transformers' fp32 logits for them."""
    data = np.load(FIXTURES / family / "reference.npz")
    return jnp.asarray(data["tokens"], jnp.int32), data["logits"]


def fp32_logits(model: Transformer, tokens: jax.Array) -> np.ndarray:
    return np.asarray(model.lm_logits(model(tokens, jnp.ones_like(tokens))))


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(artifacts, family):
    model, info = load_model(artifacts[family], dtype="float32")
    tokens, expected = reference(family)
    np.testing.assert_allclose(fp32_logits(model, tokens), expected, atol=1e-4, rtol=0)
    expected_family = family.removesuffix("_mm").removesuffix("_untied")
    expected_family = FAMILY_OF.get(expected_family, expected_family)
    assert info["hf"]["family"] == expected_family and info["stage"] == "import"


def test_imported_config_carries_the_family_features(artifacts):
    llama = read_model_config(artifacts["llama"])["model"]
    assert llama["rope_scaling_factor"] == 8.0 and not llama["tie_embeddings"]
    assert llama["dtype"] == "bfloat16"  # a bf16 checkpoint computes in bf16 by default
    assert read_model_config(artifacts["qwen2"])["model"]["qkv_bias"]
    gemma = read_model_config(artifacts["gemma2"])["model"]
    assert gemma["sliding_window"] == 4 and gemma["query_pre_attn_scalar"] == 24
    assert gemma["norm_scale_offset"] == 1.0 and gemma["embed_scale"] and gemma["post_norms"]


def test_gemma_sliding_window_is_exercised(artifacts):
    model, _ = load_model(artifacts["gemma2"], dtype="float32")
    tokens, expected = reference("gemma2")
    unwindowed = Transformer(
        dataclasses.replace(model.config, sliding_window=None), rngs=nnx.Rngs(0)
    )
    nnx.update(unwindowed, nnx.state(model, nnx.Param))
    assert np.abs(fp32_logits(unwindowed, tokens) - expected).max() > 1e-2


@pytest.mark.parametrize("family", ["gemma2", "llama"])
def test_kv_cache_decode_matches_full_forward(artifacts, family):
    model, _ = load_model(artifacts[family], dtype="float32")
    tokens, expected = reference(family)
    prompt = 3
    hidden, cache = model.prefill(tokens[:, :prompt], jnp.ones_like(tokens[:, :prompt]), 8)
    steps = [model.lm_logits(hidden[:, -1])]
    for t in range(prompt, tokens.shape[1] - 1):
        last, cache = model.decode(tokens[:, t], cache)
        steps.append(model.lm_logits(last))
    got = np.stack([np.asarray(s) for s in steps], axis=1)
    np.testing.assert_allclose(got, expected[:, prompt - 1 : -1], atol=1e-4, rtol=0)


def test_bf16_shards_are_read_exactly():
    files = safetensors_io.checkpoint_files(str(FIXTURES / "llama"))
    assert len(files) == 2  # sharded, through model.safetensors.index.json
    infos = safetensors_io.tensor_infos(files)
    name = "model.layers.1.mlp.down_proj.weight"
    assert infos[name].dtype == "BF16" and infos[name].shape == (32, 64)
    ((_, array),) = safetensors_io.read_file_tensors(infos[name].file, [name])
    assert str(array.dtype) == "bfloat16" and np.isfinite(array.astype(np.float32)).all()
    assert len(np.unique(array.astype(np.float32))) > 100


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenization_equals_the_tokenizers_library(artifacts, family):
    tokenizer = load_tokenizer(f"{artifacts[family]}/tokenizer")
    cases = json.loads((FIXTURES / family / "tokenizer_cases.json").read_text())
    for case in cases["texts"]:
        assert tokenizer.encode(case["text"]) == case["ids"], case["text"]


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_renders_as_transformers_does(artifacts, family):
    tokenizer = load_tokenizer(f"{artifacts[family]}/tokenizer")
    cases = json.loads((FIXTURES / family / "tokenizer_cases.json").read_text())
    for case in cases["chats"]:
        rendered = tokenizer.render_chat(case["messages"], case["add_generation_prompt"])
        assert rendered == case["text"]


def test_llama_pad_is_the_reserved_token_not_a_new_row(artifacts):
    tokenizer = load_tokenizer(f"{artifacts['llama']}/tokenizer")
    assert (
        tokenizer.vocab_size == 300 == read_model_config(artifacts["llama"])["model"]["vocab_size"]
    )
    assert tokenizer.decode([tokenizer.pad_id]) == ""  # a special token
    assert tokenizer.pad_id == 5 and tokenizer.pad_id != tokenizer.eos_id


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2", "qwen3", "gemma3"])
def test_a_stage_starts_from_the_imported_model(artifacts, family):
    tokenizer = load_tokenizer(f"{artifacts[family]}/tokenizer")
    manifest = {"tokenizer": tokenizer.info()}  # what shard --tokenizer ARTIFACT/tokenizer records
    reward = stage_model(manifest, base=artifacts[family], preset="tiny", scalar_head=True, seed=0)
    assert reward.scalar_head is not None and reward.config.vocab_size >= tokenizer.vocab_size


def test_resolve_base_imports_an_hf_folder_once(tmp_path, artifacts):
    assert resolve_base(artifacts["gemma2"], str(tmp_path)) == artifacts["gemma2"]
    out = resolve_base(str(FIXTURES / "gemma2"), str(tmp_path))
    assert read_model_config(out)["hf"]["family"] == "gemma2"
    assert resolve_base(str(FIXTURES / "gemma2"), str(tmp_path)) == out


def test_transformers_4_config_keys_read_the_same():
    for family in ("llama", "qwen2", "gemma2", "qwen3", "mistral"):
        current = json.loads((FIXTURES / family / "config.json").read_text())
        legacy = {k: v for k, v in current.items() if k not in ("rope_parameters", "dtype")}
        rope = dict(current["rope_parameters"])
        legacy["rope_theta"] = rope.pop("rope_theta")
        legacy["rope_scaling"] = rope if rope.pop("rope_type") == "llama3" else None
        if legacy["rope_scaling"]:
            legacy["rope_scaling"]["rope_type"] = "llama3"
        legacy["torch_dtype"] = current["dtype"]
        assert model_config_from_hf(legacy, dtype="float32") == model_config_from_hf(
            current, dtype="float32"
        )


def copy_fixture(family: str, tmp_path: pathlib.Path) -> pathlib.Path:
    """A writable copy of a fixture folder (without the reference files)."""
    folder = tmp_path / family
    shutil.copytree(FIXTURES / family, folder, ignore=shutil.ignore_patterns("reference.npz"))
    return folder


def edit_json(path: pathlib.Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def rewrite_weights(folder: pathlib.Path, drop: str = "", reshape: str = "") -> None:
    """Rewrite model.safetensors without ``drop`` / with ``reshape`` cut in half."""
    path = folder / "model.safetensors"
    infos = safetensors_io.tensor_infos([str(path)])
    tensors = dict(safetensors_io.read_file_tensors(str(path), list(infos)))
    tensors.pop(drop, None)
    if reshape:
        tensors[reshape] = tensors[reshape][: tensors[reshape].shape[0] // 2]
    safetensors_io.write_file(str(path), tensors)


BAD_INPUTS = {
    "unknown_architecture": (
        lambda d: edit_json(d / "config.json", architectures=["FalconForCausalLM"]),
        ["FalconForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM"],
    ),
    "gemma3n_by_name": (
        lambda d: edit_json(d / "config.json", architectures=["Gemma3nForCausalLM"]),
        ["Gemma3nForCausalLM", "AltUp"],
    ),
    "moe_without_experts": (
        lambda d: edit_json(d / "config.json", architectures=["Qwen3MoeForCausalLM"]),
        ["lacks 'num_experts'", "MoE config"],
    ),
    "unmodelled_rope": (
        lambda d: edit_json(
            d / "config.json", rope_parameters={"rope_type": "longrope", "factor": 4.0}
        ),
        ["rope_type 'longrope'"],
    ),
    "qwen_sliding_window": (
        lambda d: edit_json(d / "config.json", use_sliding_window=True),
        ["use_sliding_window=true"],
    ),
    "missing_tensor": (
        lambda d: rewrite_weights(d, drop="model.layers.1.mlp.up_proj.weight"),
        ["missing tensors", "model.layers.1.mlp.up_proj.weight [64, 32]"],
    ),
    "mismatched_tensor": (
        lambda d: rewrite_weights(d, reshape="model.layers.0.self_attn.k_proj.weight"),
        ["model.layers.0.self_attn.k_proj.weight: checkpoint [8, 32], config expects [16, 32]"],
    ),
    "config_disagrees_with_weights": (
        lambda d: edit_json(d / "config.json", intermediate_size=48),
        ["model.layers.0.mlp.gate_proj.weight: checkpoint [64, 32], config expects [48, 32]"],
    ),
    "tokenizer_larger_than_embedding": (
        lambda d: edit_json(d / "config.json", vocab_size=290),
        ["ids up to 299", "290 rows"],
    ),
    "no_tokenizer": (
        lambda d: (d / "tokenizer.json").unlink(),
        ["no tokenizer.json"],
    ),
    "pytorch_bin_only": (
        lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"),
        ["PyTorch .bin", "safetensors"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_before_anything_is_written(tmp_path, case):
    edit, fragments = BAD_INPUTS[case]
    folder = copy_fixture("qwen2", tmp_path)
    edit(folder)
    with pytest.raises((HFImportError, safetensors_io.CheckpointFileError)) as raised:
        import_hf(str(folder), str(tmp_path / "out"))
    for fragment in fragments:
        assert fragment in str(raised.value), str(raised.value)
    assert not (tmp_path / "out").exists()


# One refusal per family: a config field that changes the computation, named with its reason.
REFUSED = {
    "llama": ({"attention_bias": True}, "attention_bias=true"),
    "mistral": ({"hidden_act": "gelu"}, 'hidden_act="gelu"'),
    "qwen2": ({"use_sliding_window": True}, "use_sliding_window=true"),
    "qwen3": ({"use_sliding_window": True}, "use_sliding_window=true"),
    "gemma2": ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    "gemma3": (
        {
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4},
            }
        },
        "scaled rotary on Gemma 3's sliding layers",
    ),
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_each_family_refuses_an_unmodelled_field_by_name(family):
    changes, fragment = REFUSED[family]
    hf = {**json.loads((FIXTURES / family / "config.json").read_text()), **changes}
    with pytest.raises(HFImportError, match=re.escape(fragment)):
        model_config_from_hf(hf, dtype="float32")


def test_gemma3_older_layout_reads_its_pattern_and_local_base():
    """Gemma 3 configs written by transformers 4.x: sliding_window_pattern (not hard-coded
    2), rope_local_base_freq and the global rope_scaling read as the per-type layout is."""
    current = json.loads((FIXTURES / "gemma3" / "config.json").read_text())
    legacy = {k: v for k, v in current.items() if k not in ("rope_parameters", "layer_types")}
    legacy.update(
        sliding_window_pattern=3,  # the fixture's layer_types: [s, s, full, s]
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    ours = model_config_from_hf(legacy, dtype="float32")
    assert ours == model_config_from_hf(current, dtype="float32")
    assert ours.sliding_layers() == [True, True, False, True]
    assert (ours.rope_local_theta, ours.rope_linear_factor, ours.qk_norm) == (1e4, 8.0, True)
    multimodal = json.loads((FIXTURES / "gemma3_mm" / "config.json").read_text())
    assert model_config_from_hf(multimodal, dtype="float32") == ours


def test_gemma3_without_a_stated_base_takes_transformers_default():
    """A Gemma 3 config that states no global base (either layout) takes Gemma3TextConfig's
    1,000,000, as transformers does, not the 10,000 other families default to."""
    current = json.loads((FIXTURES / "gemma3" / "config.json").read_text())
    unstated = {k: v for k, v in current.items() if k not in ("rope_parameters", "layer_types")}
    unstated["sliding_window_pattern"] = 3
    # transformers 5.25: Gemma3TextConfig(**unstated).rope_parameters["full_attention"]
    # ["rope_theta"] is 1e6 (its default_theta["global"]); this module runs without it.
    assert model_config_from_hf(unstated, dtype="float32").rope_theta == 1e6
    per_type = copy.deepcopy(current)
    del per_type["rope_parameters"]["full_attention"]["rope_theta"]
    assert model_config_from_hf(per_type, dtype="float32").rope_theta == 1e6


def test_shapes_that_do_not_fit_are_an_import_error_naming_the_config():
    hf = {**json.loads((FIXTURES / "qwen3" / "config.json").read_text()), "num_key_value_heads": 3}
    with pytest.raises(HFImportError, match="config.json describes no model"):
        model_config_from_hf(hf, dtype="float32")


def test_cli_import_prints_a_summary_and_reports_errors(tmp_path, capsys):
    assert main(["model", "import", str(FIXTURES / "gemma2"), str(tmp_path / "m")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["family"] == "gemma2" and summary["params"] == 34464
    assert main(["model", "import", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    # Over an existing artifact, or into the HF folder itself: refused, nothing replaced.
    assert main(["model", "import", str(FIXTURES / "llama"), str(tmp_path / "m")]) == 2
    assert "already holds files" in capsys.readouterr().err
    assert json.loads((tmp_path / "m" / "config.json").read_text())["hf"]["family"] == "gemma2"
    assert main(["model", "import", str(FIXTURES / "llama"), str(FIXTURES / "llama")]) == 2
    assert "or inside it" in capsys.readouterr().err
    # An alignpipe artifact is no Hugging Face folder: said so, not "unsupported None".
    assert main(["model", "import", str(tmp_path / "m"), str(tmp_path / "again")]) == 2
    assert "is an alignpipe model already" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, damage, message",
    [
        ("config.json", b"{bad", "config.json is not valid JSON"),
        ("model.safetensors.index.json", b"{bad", "is not a safetensors index"),
        ("model-00001-of-00002.safetensors", b"junk", "is not a readable safetensors file"),
        ("tokenizer.json", b"{bad", "tokenizer.json or tokenizer_config.json cannot be read"),
        ("tokenizer_config.json", b"{bad", "tokenizer.json or tokenizer_config.json cannot"),
    ],
)
def test_damaged_checkpoint_files_are_named(tmp_path, capsys, name, damage, message):
    folder = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", folder)
    (folder / name).write_bytes(damage)
    assert main(["model", "import", str(folder), str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error and "Traceback" not in error


# config.json of released checkpoints (transcribed; keys that do not affect the model dropped).
PUBLISHED = {
    "1b": {  # meta-llama/Llama-3.2-1B-Instruct
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "vocab_size": 128256,
    },
    "0.5b": {  # Qwen/Qwen2.5-0.5B-Instruct
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "2b": {  # google/gemma-2-2b-it
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attn_logit_softcapping": 50.0,
        "cache_implementation": "hybrid",
        "final_logit_softcapping": 30.0,
        "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "max_position_embeddings": 8192,
        "num_attention_heads": 8,
        "num_hidden_layers": 26,
        "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "vocab_size": 256000,
    },
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_configs_map_to_the_presets(preset):
    hf = PUBLISHED[preset]
    imported = model_config_from_hf(hf, dtype="bfloat16")
    expected = model_config(preset, hf["vocab_size"])
    assert imported == dataclasses.replace(expected, head_dim=expected.resolved_head_dim)


def test_qwen3_vl_exports_its_language_model_as_qwen3(artifacts, tmp_path):
    """Qwen3-VL's language model is a Qwen3 (text only, M-RoPE's three position streams are
    one): its vision tower is left out, the head tied as the outer config says, and the
    export loads in transformers as Qwen3ForCausalLM with the multimodal model's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = read_model_config(artifacts["qwen3_vl"])
    assert config["model"]["tie_embeddings"] and config["model"]["rope_theta"] == 5e6
    assert config["hf"]["text_only"]["tensors_left_out"] > 0
    out = tmp_path / "export"
    assert main(["model", "export", artifacts["qwen3_vl"], str(out), "--dtype", "float32"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens, expected = reference("qwen3_vl")
    with torch.no_grad():
        logits = model(torch.tensor(np.asarray(tokens))).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4)
