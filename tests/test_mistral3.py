"""Mistral 3 and Ministral 3 checkpoints (components/hf/mistral3.py), and yarn rotary for
every plain-table family (components/hf/rotary.py): parity with transformers' own classes
at 512 tokens and over 268 greedy tokens, yarn's frequencies against transformers' on the
released configs, the head's tie, the exports, and the refusals.

The fixtures (tests/fixtures/hf/ministral3 and ministral3_mm, from tests/make_hf_fixtures.py)
are random-weight checkpoints saved by transformers 5's ``Ministral3ForCausalLM`` and
``Mistral3ForConditionalGeneration`` (with a Pixtral tower): yarn over a 256-token original
context and the query temperature past it, so the 512-token comparisons cross it.
"""

from __future__ import annotations

import base64
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
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from components.core.data import tekken
from components.core.data.tokenizers import load_tokenizer
from components.core.model import sampler
from components.core.model.artifact import load_model
from components.core.model.rotary_tables import rope_inv_freq
from components.core.model.transformer import Transformer
from components.hf.export import export_hf
from components.hf.families import HFImportError, model_config_from_hf
from components.hf.importer import import_hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
LENGTH = 512  # past the fixtures' original context of 256: the query temperature applies
PROMPT, NEW_TOKENS = 12, 256


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, str]:
    """Both fixtures imported once."""
    root = tmp_path_factory.mktemp("mistral3")
    return {f: import_hf(str(FIXTURES / f), str(root / f))["out"] for f in FIXTURE_NAMES}


FIXTURE_NAMES = ("ministral3", "ministral3_mm")


def _theirs(folder: pathlib.Path | str, multimodal: bool = False) -> torch.nn.Module:
    kind = (
        transformers.AutoModelForImageTextToText
        if multimodal
        else transformers.AutoModelForCausalLM
    )
    return kind.from_pretrained(folder, dtype=torch.float32).eval()


def _tokens(length: int, rows: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 300, size=(rows, length))


def _logits(model, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    ids = jnp.asarray(tokens, jnp.int32)
    mask = jnp.ones_like(ids) if mask is None else jnp.asarray(mask, jnp.int32)
    return np.asarray(model.lm_logits(model(ids, mask)))


@pytest.mark.parametrize("family", FIXTURE_NAMES)
def test_logits_match_transformers_at_512_tokens(imported, family):
    model, info = load_model(imported[family], dtype="float32")
    tokens = _tokens(LENGTH)
    with torch.no_grad():
        expected = _theirs(FIXTURES / family, family.endswith("_mm"))(torch.tensor(tokens))
    error = np.abs(_logits(model, tokens) - expected.logits.numpy()).max(axis=(0, 2))
    assert error.max() < 1e-4
    config = model.config  # the fixture's yarn and temperature, read
    assert (config.rope_yarn_factor, config.query_scale_beta) == (16.0, 0.1)
    assert config.rope_original_max_len == 256 and not config.tie_embeddings
    ratio = (0.1 * np.log(16) + 1) / (0.05 * np.log(16) + 1)  # mscale 1 over mscale_all_dim 0.5
    assert config.rope_attention_factor == pytest.approx(ratio)
    assert info["hf"]["family"] == "mistral"
    if family.endswith("_mm"):
        assert info["hf"]["text_only"]["exports_as"] == "Ministral3ForCausalLM"


def test_the_match_rests_on_the_temperature_and_yarn(imported):
    """The same weights without the query temperature stray only past position 256;
    without yarn (or its attention factor), everywhere: the match above is not by chance."""
    model, _ = load_model(imported["ministral3"], dtype="float32")
    tokens = _tokens(LENGTH)
    with torch.no_grad():
        expected = _theirs(FIXTURES / "ministral3")(torch.tensor(tokens)).logits.numpy()
    params = nnx.state(model, nnx.Param)
    strays = {}
    for name, change in (
        ("temperature", {"query_scale_beta": 0.0}),
        ("attention factor", {"rope_attention_factor": 1.0}),
        ("yarn", {"rope_yarn_factor": None, "rope_attention_factor": 1.0}),
    ):
        other = Transformer(dataclasses.replace(model.config, **change), rngs=nnx.Rngs(0))
        nnx.update(other, params)
        error = np.abs(_logits(other, tokens) - expected).max(axis=(0, 2))
        strays[name] = (float(error[:256].max()), float(error[256:].max()))
    assert strays["temperature"][0] < 1e-5 < 1e-3 < strays["temperature"][1]
    assert min(strays["attention factor"]) > 1e-2 and min(strays["yarn"]) > 1e-2


def test_greedy_tokens_match_transformers_generate_across_the_original_context(imported):
    model, _ = load_model(imported["ministral3"], dtype="float32")
    prompt = _tokens(PROMPT, rows=1, seed=1)
    settings = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        theirs = _theirs(FIXTURES / "ministral3").generate(
            torch.tensor(prompt), generation_config=settings
        )
    ids = jnp.asarray(prompt, jnp.int32)
    out = sampler.generate(
        model, ids, jnp.ones_like(ids), jax.random.key(0), max_new_tokens=NEW_TOKENS,
        eos_id=-1, pad_id=0, temperature=0.0,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), theirs[0, PROMPT:].numpy())


def test_a_left_padded_row_computes_what_it_computes_alone(imported):
    """The temperature is taken at each token's position, not its index in the padded
    batch (transformers' ``cache_position``), so padding does not change a row; and
    decoding continues the prefill past position 256."""
    model, _ = load_model(imported["ministral3"], dtype="float32")
    tokens = _tokens(300)
    pads = 20
    padded = np.concatenate([np.zeros((2, pads), tokens.dtype), tokens], axis=1)
    mask = np.ones_like(padded)
    mask[0, :pads] = 0  # row 0 left-padded, row 1 shifted by 20 real tokens
    padded[1, :pads] = tokens[1, :pads]
    alone = _logits(model, tokens[:1])
    np.testing.assert_allclose(_logits(model, padded, mask)[:1, pads:], alone, atol=1e-5)
    ids, mask = jnp.asarray(padded, jnp.int32), jnp.asarray(mask, jnp.int32)
    full = np.asarray(model(ids, mask))
    prompt = 250
    hidden, cache = model.prefill(ids[:, :prompt], mask[:, :prompt], ids.shape[1])
    steps = [np.asarray(hidden[:, -1])]
    decode = nnx.jit(lambda m, t, c: m.decode(t, c))  # one program for the 69 steps
    for t in range(prompt, ids.shape[1] - 1):
        hidden, cache = decode(model, ids[:, t], cache)
        steps.append(np.asarray(hidden))
    np.testing.assert_allclose(np.stack(steps, 1), full[:, prompt - 1 : -1], atol=2e-5)


# Yarn as the released checkpoints configure it: (name, config class, rope_parameters,
# head_dim, max_position_embeddings).
RELEASED_YARN = {
    "Ministral-3-8B": (transformers.Ministral3Config, dict(
        rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=16384,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        llama_4_scaling_beta=0.1), 128, 262144),
    "Devstral-Small-2": (transformers.Ministral3Config, dict(
        rope_type="yarn", rope_theta=1e8, factor=48.0, original_max_position_embeddings=8192,
        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
        llama_4_scaling_beta=0.1), 128, 393216),
    "Qwen3-8B at 128k": (transformers.Qwen3Config, dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0,
        original_max_position_embeddings=32768), 128, 131072),
    "mscale_all_dim 0": (transformers.Ministral3Config, dict(
        rope_type="yarn", rope_theta=1e6, factor=64.0, original_max_position_embeddings=4096,
        beta_fast=4.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0,
        llama_4_scaling_beta=0.0), 64, 262144),
    "untruncated": (transformers.Qwen3Config, dict(
        rope_type="yarn", rope_theta=150000.0, factor=32.0, truncate=False,
        original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0), 64, 131072),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(RELEASED_YARN))
def test_yarn_frequencies_and_scale_are_transformers(name):
    config_class, rope, head_dim, positions = RELEASED_YARN[name]
    theirs = config_class(
        hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, intermediate_size=64, num_hidden_layers=1, vocab_size=64,
        max_position_embeddings=positions, rope_parameters=dict(rope),
    )  # fmt: skip
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    architecture = "Ministral3ForCausalLM" if config_class is transformers.Ministral3Config else (
        "Qwen3ForCausalLM")  # fmt: skip
    ours = model_config_from_hf(
        {**theirs.to_dict(), "architectures": [architecture]}, dtype="float32"
    )
    np.testing.assert_allclose(rope_inv_freq(ours), inv_freq.numpy(), rtol=2e-6)
    assert ours.rope_attention_factor == pytest.approx(attention_factor, rel=1e-9)
    assert ours.query_scale_beta == rope.get("llama_4_scaling_beta", 0.0)


def _edit_config(folder: pathlib.Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def _drop_tensor(folder: pathlib.Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})


def _unstate_tie(config: dict) -> None:
    """As Mistral Small 3.1's config.json (saved by transformers 4.50): no tie flag at all."""
    config.pop("tie_word_embeddings", None)
    config["text_config"].pop("tie_word_embeddings", None)


@pytest.mark.parametrize("head", ["kept", "dropped"])
def test_an_unstated_tie_is_decided_by_the_checkpoint_as_transformers_does(tmp_path, head):
    folder = copy_fixture("ministral3_mm", tmp_path)
    _edit_config(folder, _unstate_tie)
    if head == "dropped":  # a tied checkpoint: transformers 5 saves no lm_head
        _drop_tensor(folder, "language_model.lm_head.weight")  # as 5.25 saves the wrapper
    summary = import_hf(str(folder), str(tmp_path / "out"))
    model, _ = load_model(summary["out"], dtype="float32")
    assert model.config.tie_embeddings == (head == "dropped")
    tokens = _tokens(64)
    with torch.no_grad():
        expected = _theirs(folder, multimodal=True)(torch.tensor(tokens)).logits.numpy()
    assert np.abs(_logits(model, tokens) - expected).max() < 1e-4


def test_the_export_loads_in_transformers_as_ministral3(imported, tmp_path):
    exported = tmp_path / "hf"
    export_hf(imported["ministral3_mm"], str(exported))
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == ["Ministral3ForCausalLM"]
    rope = config["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["llama_4_scaling_beta"] == 0.1
    tokens = _tokens(LENGTH)
    with torch.no_grad():
        expected = _theirs(FIXTURES / "ministral3_mm", True)(torch.tensor(tokens)).logits
        got = _theirs(exported)(torch.tensor(tokens)).logits
    assert float((got - expected).abs().max()) < 1e-5


def _qwen3_yarn(config: dict) -> None:
    """Qwen3's long-context setting (its model card: factor 4 over 32768), scaled down."""
    config["rope_parameters"] = dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32
    )


def test_yarn_on_qwen3_imports_and_exports_as_transformers_computes(tmp_path):
    folder = copy_fixture("qwen3", tmp_path)
    _edit_config(folder, _qwen3_yarn)
    summary = import_hf(str(folder), str(tmp_path / "artifact"))
    model, _ = load_model(summary["out"], dtype="float32")
    tokens = _tokens(96)
    with torch.no_grad():
        expected = _theirs(folder)(torch.tensor(tokens)).logits.numpy()
    assert np.abs(_logits(model, tokens) - expected).max() < 1e-4
    export_hf(summary["out"], str(tmp_path / "hf"))
    with torch.no_grad():
        again = _theirs(tmp_path / "hf")(torch.tensor(tokens)).logits.numpy()
    assert np.abs(again - expected).max() < 1e-5
    unscaled = model_config_from_hf(
        json.loads((FIXTURES / "qwen3" / "config.json").read_text()), dtype="float32"
    )
    assert not np.allclose(rope_inv_freq(unscaled), rope_inv_freq(model.config))


REFUSED = {
    "GPTQ weights (FP8 imports: test_fp8.py)": (
        lambda c: c.update(quantization_config={"quant_method": "gptq", "bits": 4}),
        "quantization_config=.*other than FP8.*BF16.*Ministral-3-8B-Instruct-2512-BF16",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unmodelled_mistral3_options_are_refused_by_name(tmp_path, case):
    edit, named = REFUSED[case]
    folder = copy_fixture("ministral3_mm", tmp_path)
    _edit_config(folder, edit)
    with pytest.raises(HFImportError, match=named):
        import_hf(str(folder), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_rope_read_as_transformers_standardises_it():
    """A ministral3 config's older ``rope_scaling`` wins over the class's default table;
    a yarn table without its original context stretches max_position_embeddings; a Mistral's
    llama_4_scaling_beta is not read (its attention has none)."""
    older = {
        "architectures": ["Ministral3ForCausalLM"], "model_type": "ministral3",
        "rope_theta": 1e8, "rope_scaling": {
            "type": "yarn", "factor": 48.0, "original_max_position_embeddings": 8192,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    }  # fmt: skip
    read = model_config_from_hf(older, dtype="float32")
    assert (read.rope_theta, read.rope_yarn_factor, read.rope_original_max_len) == (
        1e8, 48.0, 8192,
    )  # fmt: skip
    hf = json.loads((FIXTURES / "ministral3" / "config.json").read_text())
    hf["rope_parameters"].pop("original_max_position_embeddings")
    assert model_config_from_hf(hf, dtype="float32").rope_original_max_len == 1024
    mistral = json.loads((FIXTURES / "mistral" / "config.json").read_text())
    mistral["rope_parameters"] = {**hf["rope_parameters"], "original_max_position_embeddings": 64}
    plain = model_config_from_hf(mistral, dtype="float32")
    assert plain.query_scale_beta == 0.0 and plain.rope_yarn_factor == 16.0


def test_the_temperature_is_refused_outside_ministral3():
    hf = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    hf["rope_parameters"] = {**hf["rope_parameters"], "llama_4_scaling_beta": 0.1}
    with pytest.raises(HFImportError, match="llama_4_scaling_beta for qwen3"):
        model_config_from_hf(hf, dtype="float32")


# The released configs' text parts (Mistral Small 3.1's verbatim: saved by 4.50, no tie
# flag; Ministral 3 8B's as Ministral3Config's defaults, which transformers documents as
# that checkpoint's).
MISTRAL_SMALL_3_1 = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "image_token_index": 10,
    "model_type": "mistral3",
    "text_config": {
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
        "intermediate_size": 32768, "max_position_embeddings": 131072, "model_type": "mistral",
        "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None,
        "vocab_size": 131072,
    },
    "vision_config": {"model_type": "pixtral", "hidden_size": 1024},
}  # fmt: skip
MINISTRAL_3_8B = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "model_type": "mistral3",
    "text_config": {"model_type": "ministral3"},
    "tie_word_embeddings": False,
}


def test_released_configs_read_as_their_models():
    small = model_config_from_hf(MISTRAL_SMALL_3_1, dtype="bfloat16")
    assert (small.dim, small.n_layers, small.hidden_dim, small.vocab_size) == (
        5120, 40, 32768, 131072,
    )  # fmt: skip
    assert small.rope_theta == 1e9 and small.sliding_window is None
    assert small.rope_yarn_factor is None and small.query_scale_beta == 0.0
    eight = model_config_from_hf(MINISTRAL_3_8B, dtype="bfloat16")
    assert (eight.dim, eight.n_layers, eight.resolved_head_dim, eight.vocab_size) == (
        4096, 34, 128, 131072,
    )  # fmt: skip
    assert (eight.rope_yarn_factor, eight.rope_original_max_len, eight.query_scale_beta) == (
        16.0, 16384, 0.1,
    )  # fmt: skip
    assert eight.rope_attention_factor == 1.0 and not eight.tie_embeddings


# A tekken pattern of the kind Mistral's v7 files carry (tiktoken's style).
TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reward models score the chosen reply above the rejected one.",
    "  spaced   out\n\nnew lines 12345 and ünïcödé, 😀!",
    "[INST]not a special in plain text[/INST]",
]


def _as_tekken(folder: pathlib.Path) -> int:
    """Replace the fixture's tokenizer files by a tekken.json of its tokens (specials first,
    the byte-level tokens in id order as ranks), as Mistral ships some releases; returns the
    id of </s>."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    specials = sorted(tok["added_tokens"], key=lambda t: t["id"])
    byte_of = {name: byte for byte, name in tekken._byte_names().items()}
    regular = sorted((i, name) for name, i in tok["model"]["vocab"].items() if i >= len(specials))
    vocab = [
        {"rank": rank, "token_bytes": base64.b64encode(bytes(byte_of[c] for c in name)).decode()}
        for rank, (_, name) in enumerate(regular)
    ]
    size = len(vocab) + len(specials)
    (folder / "tekken.json").write_text(json.dumps({
        "config": {"pattern": TEKKEN_PATTERN, "num_vocab_tokens": size,
                   "default_vocab_size": size, "default_num_special_tokens": len(specials),
                   "version": "v7"},
        "vocab": vocab,
        "special_tokens": [{"rank": t["id"], "token_str": t["content"], "is_control": True}
                           for t in specials],
    }))  # fmt: skip
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    return next(t["id"] for t in specials if t["content"] == "</s>")


def test_a_tekken_only_folder_imports_with_the_tokens_transformers_converts(tmp_path):
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    folder = copy_fixture("ministral3_mm", tmp_path)
    eos = _as_tekken(folder)
    summary = import_hf(str(folder), str(tmp_path / "out"))
    ours = load_tokenizer(f"{summary['out']}/tokenizer")
    theirs = convert_tekken_tokenizer(str(folder / "tekken.json"))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text or "[INST]" in text  # decoding drops specials
    assert ours.stop_ids == (eos,) and ours.special_tokens()["bos_token"] == "<s>"
    rendered = ours.render_chat([{"role": "user", "content": "Hi"}], True)
    assert rendered.startswith("<s>[SYSTEM_PROMPT]") and rendered.endswith("[INST]Hi[/INST]")
    assert load_tokenizer(str(folder)).encode(TEXTS[0]) == ours.encode(TEXTS[0])
    (folder / "tekken.json").write_text('{"vocab": []}')
    with pytest.raises(HFImportError, match="tekken.json is not in Mistral's format"):
        import_hf(str(folder), str(tmp_path / "again"))
