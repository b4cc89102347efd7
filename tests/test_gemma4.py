"""Gemma 4 (text): parity with transformers' own classes at 512 tokens and over 256 greedy
tokens, the shared KV cache, the fields read and refused, export, fsdp and adapters.

The fixtures (tests/fixtures/hf/gemma4 and gemma4_mm, from tests/make_hf_fixtures.py) are
random-weight checkpoints saved by transformers 5's ``Gemma4ForCausalLM`` and
``Gemma4ForConditionalGeneration``: nine layers, three periods of two sliding layers and a
full one; the full layers' heads twice as wide with one KV head and keys serving as values;
the last period reusing the second's keys and values with a double-wide MLP; per-layer
inputs; proportional rotary; random per-layer scalars. transformers runs here live.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from components.core.data.tokenizers import load_tokenizer
from components.core.model import layer_kinds, lora, sampler
from components.core.model.artifact import load_model
from components.core.model.transformer import Transformer
from components.core.training import fsdp
from components.hf.export import export_hf
from components.hf.families import HFImportError, model_config_from_hf
from components.hf.importer import import_hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
LENGTH = 512
NEW_TOKENS = 256


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, str]:
    """Both fixtures imported once."""
    root = tmp_path_factory.mktemp("gemma4")
    return {f: import_hf(str(FIXTURES / f), str(root / f))["out"] for f in ("gemma4", "gemma4_mm")}


@pytest.fixture(scope="module")
def gemma4(imported) -> Transformer:
    return load_model(imported["gemma4"], dtype="float32")[0]


def _theirs(family: str) -> torch.nn.Module:
    kind = (
        transformers.AutoModelForImageTextToText
        if family.endswith("_mm")
        else transformers.AutoModelForCausalLM
    )
    return kind.from_pretrained(FIXTURES / family, dtype=torch.float32).eval()


def _tokens(length: int, rows: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 300, size=(rows, length))


def test_the_fixture_has_every_layer_kind(gemma4):
    config = gemma4.config
    assert layer_kinds.stack_counts(config) == {
        "blocks": 4, "global_blocks": 2, "shared_blocks": 2, "shared_global_blocks": 1,
    }  # fmt: skip
    assert [(s.start, s.end, s.periods) for s in layer_kinds.segments(config)] == [
        (0, 6, 2), (6, 9, 1),
    ]  # fmt: skip
    assert layer_kinds.store_layers(config) == {True: 4, False: 5}
    pure = nnx.to_pure_dict(nnx.state(gemma4, nnx.Param))
    assert pure["blocks"]["attn"]["wk"]["kernel"].shape == (4, 32, 2 * 16)
    assert pure["global_blocks"]["attn"]["wk"]["kernel"].shape == (2, 32, 1 * 32)
    assert "wv" not in pure["global_blocks"]["attn"]  # keys serve as values
    assert "wk" not in pure["shared_blocks"]["attn"]  # reused from layer 4
    assert pure["shared_global_blocks"]["mlp"]["w_up"]["kernel"].shape == (1, 32, 128)
    assert pure["per_layer_inputs"]["table"].shape == (306, 9 * 8)


@pytest.mark.parametrize("family", ["gemma4", pytest.param("gemma4_mm", marks=pytest.mark.slow)])
def test_logits_match_transformers_at_512_tokens(imported, family):
    model, info = load_model(imported[family], dtype="float32")
    tokens = _tokens(LENGTH)
    with torch.no_grad():
        expected = _theirs(family)(torch.tensor(tokens)).logits.numpy()
    ids = jnp.asarray(tokens, jnp.int32)
    got = np.asarray(model.lm_logits(model(ids, jnp.ones_like(ids))))
    assert np.abs(got - expected).max() < 1e-4
    assert info["hf"]["family"] == "gemma4"
    assert ("text_only" in info["hf"]) == family.endswith("_mm")


# 64 new tokens in make test (past Gemma 4's 8-token window), 256 in the slow tier.
@pytest.mark.parametrize("new_tokens", [64, pytest.param(NEW_TOKENS, marks=pytest.mark.slow)])
def test_greedy_tokens_match_transformers_generate(gemma4, new_tokens):
    theirs = _theirs("gemma4")
    theirs.generation_config.eos_token_id = None  # through any stop token
    prompt = _tokens(12, rows=1, seed=1)
    settings = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        expected = theirs.generate(torch.tensor(prompt), generation_config=settings)
    ids = jnp.asarray(prompt, jnp.int32)
    out = sampler.generate(
        gemma4, ids, jnp.ones_like(ids), jax.random.key(0), max_new_tokens=new_tokens,
        eos_id=-1, pad_id=0, temperature=0.0,
    )  # fmt: skip
    assert expected.shape[1] == 12 + new_tokens
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), expected[0, 12:].numpy())


# Slow tier: the storing layers' cache is read by the greedy test above; left pads are in
# make test for the dense, Mistral 3 and Qwen3.5 stacks.
@pytest.mark.slow
def test_decoding_reads_the_storing_layers_cache_under_left_pads(gemma4):
    tokens = jnp.asarray(_tokens(40), jnp.int32)
    mask = jnp.ones_like(tokens).at[0, :5].set(0)
    full = np.asarray(gemma4(tokens, mask))
    prompt = 30
    hidden, cache = gemma4.prefill(tokens[:, :prompt], mask[:, :prompt], 40)
    steps = [hidden[:, -1]]
    for t in range(prompt, 39):
        last, cache = gemma4.decode(tokens[:, t], cache)
        steps.append(last)
    np.testing.assert_allclose(np.stack(steps, 1), full[:, prompt - 1 : -1], atol=5e-5)
    # Six layers own a cache (their own head widths); the three shared layers have none.
    assert len(cache.k) == 6
    assert [k.shape[1:3] for k in cache.k[:3]] == [(2, 16), (2, 16), (1, 32)]
    alone = np.asarray(gemma4(tokens[:1, 5:], jnp.ones_like(tokens[:1, 5:])))
    np.testing.assert_allclose(full[0, 5:], alone[0], atol=5e-5)


def test_export_loads_in_transformers_as_the_text_model(imported, tmp_path):
    out = tmp_path / "export"
    export_hf(imported["gemma4_mm"], str(out), dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma4ForCausalLM"]
    assert config["model_type"] == "gemma4_text"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(theirs).__name__ == "Gemma4ForCausalLM"
    tokens = _tokens(70)
    with torch.no_grad():
        exported = theirs(torch.tensor(tokens)).logits.numpy()
        original = _theirs("gemma4_mm")(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(exported, original, atol=1e-5)
    again = import_hf(str(out), str(tmp_path / "again"))["out"]
    first, _ = load_model(imported["gemma4_mm"], dtype="float32")
    second, _ = load_model(again, dtype="float32")
    for a, b in zip(
        jax.tree.leaves(nnx.state(first, nnx.Param)),
        jax.tree.leaves(nnx.state(second, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def _hf_config(**changes) -> dict:
    config = json.loads((FIXTURES / "gemma4_mm" / "config.json").read_text())
    config["text_config"].update(changes)
    return config


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"enable_moe_block": True, "num_experts": 128}, "top_k_experts"),  # lacks it
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"attention_bias": True}, "attention_bias"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        ({"per_layer_config": {"2": {"head_dim": 32, "sliding_window": 4}}}, "sliding_window"),
        ({"per_layer_config": {"0": {"head_dim": 32}}}, "sliding layer"),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
            "yarn",
        ),
        ({"num_kv_shared_layers": 9}, "num_kv_shared_layers"),
    ],
)
def test_unmodelled_fields_are_refused_by_name(changes, named):
    with pytest.raises(HFImportError, match=named):
        model_config_from_hf(_hf_config(**changes), dtype="float32")


def test_vision_only_bidirectional_attention_is_read_as_causal_text():
    config = model_config_from_hf(_hf_config(use_bidirectional_attention="vision"), dtype="float32")
    assert config == model_config_from_hf(_hf_config(), dtype="float32")


def test_the_released_spelling_of_the_full_layers_reads_the_same():
    """config.json as released (global_head_dim, num_global_key_value_heads) and as
    transformers 5.25 saves it (per_layer_config) read as one model."""
    text = json.loads((FIXTURES / "gemma4" / "config.json").read_text())
    saved = model_config_from_hf(text, dtype="float32")
    released = {k: v for k, v in text.items() if k != "per_layer_config"}
    released.update(global_head_dim=32, num_global_key_value_heads=1)
    assert model_config_from_hf(released, dtype="float32") == saved
    # Without attention_k_eq_v, transformers keeps the sliding layers' KV heads there.
    released.update(attention_k_eq_v=False)
    assert model_config_from_hf(released, dtype="float32").global_kv_heads == 2


def test_experts_beside_double_wide_mlps_are_refused(tmp_path):
    """26B-A4B's experts are read (tests/test_moe.py); beside the shared-KV layers' double-wide
    MLPs, which no release combines with them, they are refused."""
    folder = tmp_path / "moe"
    shutil.copytree(FIXTURES / "gemma4_mm", folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"].update(
        enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=24
    )
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HFImportError, match="double-wide"):
        import_hf(str(folder), str(tmp_path / "out"))


# The released text configs (google/gemma-4-E2B-it's and gemma-4-31B-it's config.json, as
# Tunix's and fairseq2's model tables give their shapes): our parameter count is
# transformers' own model's, plus one scalar a layer (a buffer there, a parameter here).
E2B = {
    "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
    "global_head_dim": 512, "sliding_window": 512, "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144, "num_kv_shared_layers": 20,
    "use_double_wide_mlp": True, "final_logit_softcapping": 30.0, "vocab_size": 262144,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
}  # fmt: skip
G31B = {
    "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60,
    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256,
    "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
    "sliding_window": 1024, "hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0,
    "use_bidirectional_attention": "vision", "vocab_size": 262144,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10,
}  # fmt: skip


@pytest.mark.parametrize("text", [E2B, G31B], ids=["E2B", "31B"])
def test_real_shapes_read_from_the_released_configs(text):
    hf = {"architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
    config = model_config_from_hf(hf, dtype="bfloat16")
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    with torch.device("meta"):
        theirs = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**text))
    assert count == sum(p.numel() for p in theirs.parameters()) + config.n_layers
    periods = [s.periods for s in layer_kinds.segments(config)]
    assert periods == ([3, 4] if text is E2B else [10])


def _tiny(**changes):
    text = json.loads((FIXTURES / "gemma4" / "config.json").read_text())
    return dataclasses.replace(model_config_from_hf(text, dtype="float32"), **changes)


# Slow tier: fsdp and remat against the replicated stack are in make test for the dense stack
# (test_fsdp.py, test_model.py).
@pytest.mark.slow
def test_fsdp_and_remat_compute_what_the_replicated_stack_does():
    config = _tiny()
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 2, 20), 0, 300)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, tokens):
        m = nnx.merge(graphdef, fsdp.gather_outer(params))
        return jnp.mean(m.lm_logits(m(tokens, jnp.ones_like(tokens))) ** 2)

    sharded = fsdp.shard(nnx.to_pure_dict(params), jax.local_devices()[:8])
    sharded_state = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(sharded_state, sharded)
    value = jax.pmap(loss, axis_name="data")(sharded_state, tokens)
    expected = jax.vmap(loss, in_axes=(None, 0))(params, tokens)
    np.testing.assert_allclose(value, expected, rtol=2e-5)
    plain = Transformer(dataclasses.replace(config, remat="none"), rngs=nnx.Rngs(0))
    ids = tokens[0]
    np.testing.assert_allclose(
        plain(ids, jnp.ones_like(ids)), model(ids, jnp.ones_like(ids)), atol=1e-5
    )


# Slow tier: adapters and their merge are in make test for the dense stack (test_lora.py).
@pytest.mark.slow
def test_adapters_sit_where_each_kind_has_the_projection():
    model = Transformer(_tiny(), rngs=nnx.Rngs(0))
    targets = ("q_proj", "k_proj", "v_proj", "down_proj")
    adapted = lora.attach(model, rank=2, alpha=4.0, targets=targets, seed=1)
    pure = nnx.to_pure_dict(nnx.state(adapted, nnx.Param))
    assert "lora" in pure["blocks"]["attn"]["wv"]
    assert "lora" in pure["global_blocks"]["attn"]["wk"]  # its keys are its values
    assert "lora" in pure["shared_global_blocks"]["attn"]["wq"]
    assert pure["shared_global_blocks"]["mlp"]["w_down"]["lora"]["lora_a"].shape == (1, 128, 2)
    ids = jnp.ones((1, 9), jnp.int32)
    # B = 0: the same function; float32 sums reordered by the adapter's path differ by a
    # few ulps (1.2e-6 at a logit of -1.006 with jax 0.10.2), so a relative bound as well.
    np.testing.assert_allclose(adapted(ids, ids), model(ids, ids), rtol=1e-5, atol=1e-6)

    def loss(m):
        return jnp.mean(m.lm_logits(m(ids, ids)) ** 2)

    grads = nnx.to_pure_dict(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.LoRAParam))(adapted))
    b_grad = grads["global_blocks"]["attn"]["wk"]["lora"]["lora_b"]
    assert float(jnp.abs(b_grad).max()) > 0


@pytest.mark.parametrize("enable_thinking", [True, False, None])
def test_chat_template_and_stop_tokens_as_transformers_reads_them(enable_thinking):
    """Gemma 4's template (<|turn>user ... <turn|>, the assistant as ``model``, thinking on
    through ``<|think|>`` in a system turn, past thoughts stripped) rendered as transformers
    renders it; the stop set is generation_config.json's <eos> and <turn|>."""
    ours = load_tokenizer(str(FIXTURES / "gemma4"))
    theirs = transformers.AutoTokenizer.from_pretrained(FIXTURES / "gemma4")
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    chats = [
        [{"role": "user", "content": "Name a colour."}],
        [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "<|channel>thought\nPick one.<channel|>Blue."},
            {"role": "user", "content": "Another?"},
        ],
    ]
    for messages in chats:
        for generation in (True, False):
            expected = theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation, **kwargs
            )
            assert ours.render_chat(messages, generation, **kwargs) == expected
    prompt = ours.render_chat(chats[0], True, **kwargs)
    assert prompt.endswith("<|turn>model\n")
    assert ("<|think|>" in prompt) == bool(enable_thinking)
    assert "Pick one." not in ours.render_chat(chats[1], True, **kwargs)
    stops = set(theirs.convert_ids_to_tokens(list(ours.stop_ids)))
    assert stops == {"<eos>", "<turn|>"}
