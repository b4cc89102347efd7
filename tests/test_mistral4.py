"""Mistral 4 (Mistral Small 4: components/hf/mistral4.py, core/model/latent_attention.py):
parity with transformers' own classes at 512 tokens and over greedy tokens through the KV
cache, what the match rests on (the interleaved rotary rows, the softmax's mscale, the query
temperature), the export loading back in transformers, the released config planned at its
published size, adapters on the latent projections, and the refusals.

The fixture (tests/fixtures/hf/mistral4_mm, from tests/make_hf_fixtures.py) is a random-weight
``Mistral3ForConditionalGeneration`` wrapping a ``mistral4`` (with a Pixtral tower), as
Mistral Small 4 is released: query and key-value latents, the rotary part interleaved, six
experts (two a token, scaled by 1.5) beside a shared one, yarn over a 256-token original
context with ``mscale_all_dim`` 1, and the query temperature past it.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from test_hf_import import copy_fixture  # tests/test_hf_import.py's writable fixture copy

from components.core.model import lora, sampler
from components.core.model.adapter_targets import ADAPTER_TARGETS
from components.core.model.artifact import load_model, save_model
from components.core.model.presets import model_config
from components.core.model.transformer import Transformer
from components.hf import mistral4
from components.hf.export import export_hf
from components.hf.families import HFImportError, model_config_from_hf
from components.hf.importer import import_hf
from components.hf.peft import export_peft, load_adapter
from pipelines.dag import memory

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "hf" / "mistral4_mm"
LENGTH = 512  # past the fixture's original context of 256: the query temperature applies


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> str:
    return import_hf(str(FIXTURE), str(tmp_path_factory.mktemp("mistral4") / "a"))["out"]


@pytest.fixture(scope="module")
def theirs() -> torch.nn.Module:
    kind = transformers.AutoModelForImageTextToText
    return kind.from_pretrained(FIXTURE, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(theirs) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [2, 512] and transformers' float32 logits for them."""
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, LENGTH))
    with torch.no_grad():
        return tokens, theirs(torch.tensor(tokens)).logits.numpy()


def _logits(model: Transformer, tokens: np.ndarray) -> np.ndarray:
    ids = jnp.asarray(tokens, jnp.int32)
    return np.asarray(model.lm_logits(model(ids, jnp.ones_like(ids))))


def test_logits_match_transformers_at_512_tokens(imported, expected):
    model, info = load_model(imported, dtype="float32")
    tokens, logits = expected
    assert np.abs(_logits(model, tokens) - logits).max() < 1e-4
    assert info["hf"]["text_only"]["exports_as"] == "Mistral4ForCausalLM"
    config = model.config
    assert (config.kv_lora_rank, config.q_lora_rank, config.rotary_dim) == (12, 16, 8)
    assert config.routed_scaling == 1.5 and not config.shared_expert_gated


@pytest.mark.slow  # the match itself: the test above
def test_the_match_rests_on_the_rows_the_scales_and_the_temperature(imported, expected):
    """Without reordering the interleaved rows, the softmax's mscale², the routed scaling or
    the query temperature the logits stray (the temperature's only past position 256)."""
    model, _ = load_model(imported, dtype="float32")
    tokens, logits = (x[:, :300] for x in expected)  # causal: the first 300 of the 512
    params = nnx.state(model, nnx.Param)

    def stray(config, params=params) -> tuple[float, float]:
        other = Transformer(config, rngs=nnx.Rngs(0))
        nnx.update(other, params)
        error = np.abs(_logits(other, tokens) - logits).max(axis=(0, 2))
        return float(error[:256].max()), float(error[256:].max())

    config = model.config
    assert stray(dataclasses.replace(config, query_pre_attn_scalar=None))[0] > 1e-2
    assert stray(dataclasses.replace(config, routed_scaling=1.0))[0] > 1e-2
    early, late = stray(dataclasses.replace(config, query_scale_beta=0.0))
    assert early < 1e-5 < 1e-3 < late
    pure = nnx.to_pure_dict(params)
    rows = mistral4.rotary_rows(config)
    for layer, name in (("wq_b", "q_b_proj"), ("wkv_a", "kv_a_proj_with_mqa")):
        kernel = np.asarray(pure["blocks"]["attn"][layer]["kernel"])  # the stored order instead
        order = rows[f"self_attn.{name}.weight"]
        restored = np.empty_like(kernel)
        restored[..., order] = kernel
        pure["blocks"]["attn"][layer]["kernel"] = restored
    interleaved = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(interleaved, pure)
    assert stray(config, interleaved)[0] > 1e-2


def test_greedy_tokens_match_transformers_generate_across_the_original_context(imported, theirs):
    """Decoding through the KV cache (every head's expanded keys and values) from position
    244 to 276: the tokens transformers' generate picks."""
    model, _ = load_model(imported, dtype="float32")
    prompt = np.random.default_rng(1).integers(0, 300, size=(1, 244))
    settings = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        generated = theirs.generate(torch.tensor(prompt), generation_config=settings)
    ids = jnp.asarray(prompt, jnp.int32)
    out = sampler.generate(
        model, ids, jnp.ones_like(ids), jax.random.key(0), max_new_tokens=32, eos_id=-1,
        pad_id=0, temperature=0.0,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), generated[0, 244:].numpy())


def test_the_export_loads_in_transformers_as_mistral4(imported, expected, tmp_path):
    exported = tmp_path / "hf"
    export_hf(imported, str(exported))
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Mistral4ForCausalLM"] and config["rope_interleave"]
    assert config["rope_parameters"]["mscale_all_dim"] == pytest.approx(1.0, abs=1e-9)
    # transformers 5.25 maps mistral4 for AutoModelForPreTraining, not AutoModelForCausalLM:
    # the class by its name, as the config's architectures give it.
    model = transformers.Mistral4ForCausalLM.from_pretrained(exported, dtype=torch.float32)
    tokens, logits = expected
    with torch.no_grad():
        got = model(torch.tensor(tokens)).logits.numpy()
    assert np.abs(got - logits).max() < 1e-5
    reloaded = tmp_path / "again"  # and the export imports as the same model
    summary = import_hf(str(exported), str(reloaded))
    again, _ = load_model(summary["out"], dtype="float32")
    assert np.abs(_logits(again, tokens) - logits).max() < 1e-4


# Mistral Small 4's release: the wrapper, its text_config Mistral4Config's defaults (which
# transformers documents as mistralai/Mistral-Small-4-119B-2603's).
MISTRAL_SMALL_4 = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "model_type": "mistral3",
    "text_config": {"model_type": "mistral4"},
    "tie_word_embeddings": False,
}


def test_the_released_config_is_planned_at_its_published_size():
    """119B parameters (the model card's), of which a token uses its 4 experts of 128; the
    planner's count equals the built model's on the fixture's shape."""
    config = model_config_from_hf(MISTRAL_SMALL_4, dtype="bfloat16")
    assert (config.n_layers, config.n_heads, config.head_dim, config.vocab_size) == (
        36, 32, 128, 131072,
    )  # fmt: skip
    assert config == model_config("mistral-small-4", 131072)  # the run preset's shape
    total = memory.param_count(config)
    unused = config.n_layers * 3 * config.dim * config.expert_dim * (128 - 4)
    assert abs(total / 119e9 - 1) < 0.005 and 6.0e9 < total - unused < 6.7e9
    hf = json.loads((FIXTURE / "config.json").read_text())
    fixture = model_config_from_hf(hf, dtype="float32")
    built = nnx.eval_shape(lambda: Transformer(fixture, rngs=nnx.Rngs(0)))
    sizes = sum(x.size for x in jax.tree.leaves(nnx.state(built, nnx.Param)))
    assert memory.param_count(fixture) == sizes


def test_adapters_wrap_the_latent_projections():
    """all-linear on latent attention: the query and key-value latents' projections and the
    output; the experts take none (moe.py); the planner counts what is built. (They train,
    export to PEFT and read back: the slow tier, below.)"""
    hf = json.loads((FIXTURE / "config.json").read_text())
    config = model_config_from_hf(hf, dtype="float32")
    targets = config.present_targets(ADAPTER_TARGETS)
    assert targets == ("o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    adapted = dataclasses.replace(config, lora_rank=4, lora_targets=targets)
    built = nnx.eval_shape(lambda: Transformer(adapted, rngs=nnx.Rngs(1)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(built, nnx.LoRAParam)))
    assert count == memory.adapter_param_count(adapted, 4, targets)


def test_a_checkpoint_with_its_rotary_rows_in_order_and_no_temperature(tmp_path):
    """``rope_interleave: false`` inside the wrapper (rows stored in rotate-half order, read
    as they are) and ``llama_4_scaling_beta`` 0: transformers' logits, and an export that
    transformers runs (it reads the beta whatever it is) to the same logits."""
    folder = copy_fixture("mistral4_mm", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    text["rope_interleave"] = False
    text["rope_parameters"]["llama_4_scaling_beta"] = 0.0
    (folder / "config.json").write_text(json.dumps(config))
    tokens = np.random.default_rng(3).integers(0, 300, size=(1, 300))
    theirs = transformers.AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = theirs.eval()(torch.tensor(tokens)).logits.numpy()
    artifact = import_hf(str(folder), str(tmp_path / "a"))["out"]
    model, info = load_model(artifact, dtype="float32")
    assert np.abs(_logits(model, tokens) - expected).max() < 1e-4
    assert info["hf"]["rope_interleave"] is False and model.config.query_scale_beta == 0.0
    export_hf(artifact, str(tmp_path / "hf"))
    exported = transformers.Mistral4ForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32
    )
    with torch.no_grad():
        assert np.abs(exported(torch.tensor(tokens)).logits.numpy() - expected).max() < 1e-5


def test_an_older_rope_scaling_wins_as_transformers_reads_it():
    text = {"model_type": "mistral4", "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
        "mscale": 1.0, "mscale_all_dim": 0.5, "rope_theta": 1e4,
    }}  # fmt: skip
    config = model_config_from_hf({**MISTRAL_SMALL_4, "text_config": text}, dtype="float32")
    assert (config.rope_yarn_factor, config.rope_original_max_len) == (4.0, 256)


def test_lora_targets_a_latent_model_lacks_are_refused_by_name(imported):
    model, _ = load_model(imported, dtype="float32")
    with pytest.raises(ValueError, match=r"has none of them; its projections are .*q_a_proj"):
        lora.with_lora(model.config, 4, 8.0, ("q_proj", "v_proj"))


def test_a_folder_in_mistrals_own_format_is_told_what_to_download(tmp_path):
    (tmp_path / "params.json").write_text("{}")
    (tmp_path / "consolidated.safetensors").write_bytes(b"")
    with pytest.raises(HFImportError, match="Mistral's own format.*Hugging Face files"):
        import_hf(str(tmp_path), str(tmp_path / "out"))


REFUSED = {
    "a plain rotary table": (
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        "rope_type 'default' for Mistral 4",
    ),
    "dense layers first": ({"first_k_dense_replace": 1}, "first_k_dense_replace=1"),
    "group-limited routing": ({"n_group": 2, "topk_group": 1}, "group-limited routing"),
    "values wider than keys": ({"v_head_dim": 24}, "v_head_dim=24"),
    "biases": ({"attention_bias": True}, "attention_bias"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unmodelled_mistral4_options_are_refused_by_name(tmp_path, case):
    changes, named = REFUSED[case]
    folder = copy_fixture("mistral4_mm", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match=named):
        import_hf(str(folder), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # PEFT's export and read-back: test_peft_export.py in make test
def test_adapters_export_to_peft_and_read_back(imported, expected, tmp_path):
    """A policy with rank-4 adapters (B nonzero) on every latent projection: PEFT loads its
    adapter onto the exported base and computes our logits (B's rotary rows written back
    interleaved), and the adapter reads back to the same model."""
    import peft

    model, info = load_model(imported, dtype="float32")
    targets = model.config.present_targets(ADAPTER_TARGETS)
    model = lora.attach(model, rank=4, alpha=8.0, targets=targets, seed=0)
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    rng = np.random.default_rng(0)
    for target in targets:
        module, name = lora.TARGET_PATHS[target]
        adapter = pure["blocks"][module][name]["lora"]
        for matrix in ("lora_a", "lora_b"):
            adapter[matrix] = (0.2 * rng.standard_normal(adapter[matrix].shape)).astype(np.float32)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    policy = str(tmp_path / "policy")
    save_model(policy, model, state, tokenizer=info["tokenizer"], stage="sft", training={},
               step=1, hf=info["hf"])  # fmt: skip
    out = tmp_path / "hf"
    tokenizer = f"{imported}/tokenizer"
    export_peft(policy, str(out), tokenizer_dir=tokenizer, dtype="float32", base_model="tiny")
    tokens = expected[0][:, :64]
    ours = _logits(model, tokens)
    base = transformers.Mistral4ForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    with torch.no_grad():
        got = theirs(torch.tensor(tokens)).logits.numpy()
    assert np.abs(got - ours).max() < 1e-4
    assert np.abs(_logits(load_model(imported, dtype="float32")[0], tokens) - ours).max() > 0.05
    plain = import_hf(str(out / "base"), str(tmp_path / "base_artifact"))["out"]
    again = load_adapter(load_model(plain, dtype="float32")[0], str(out / "adapter"))
    assert np.abs(_logits(again, tokens) - ours).max() < 1e-4
