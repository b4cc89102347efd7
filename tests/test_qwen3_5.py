"""Qwen3.5 (hybrid Gated DeltaNet and gated attention): the rule, parity with transformers'
own classes at 512 tokens and over 256 greedy tokens, the sampler's states, import
refusals, export, fsdp and adapters.

The fixtures (tests/fixtures/hf/qwen3_5 and qwen3_5_mm, from tests/make_hf_fixtures.py) are
random-weight checkpoints saved by transformers 5's ``Qwen3_5ForCausalLM`` and
``Qwen3_5ForConditionalGeneration``: eight layers, two periods of three DeltaNet layers and
one attention layer, partial rotary and the output gate. transformers runs here live.
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
from transformers.models.qwen3_5 import modeling_qwen3_5 as reference_rule

from components.core.model import delta, lora, sampler
from components.core.model.artifact import load_model
from components.core.model.transformer import Transformer, model_config
from components.core.training import fsdp
from components.hf.export import export_hf
from components.hf.families import HFImportError, model_config_from_hf
from components.hf.importer import import_hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
LENGTH = 512  # the parity length: eight chunks of the parallel form
NEW_TOKENS = 256


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, str]:
    """Both fixtures imported once."""
    root = tmp_path_factory.mktemp("qwen3_5")
    return {
        f: import_hf(str(FIXTURES / f), str(root / f))["out"] for f in ("qwen3_5", "qwen3_5_mm")
    }


def _theirs(family: str) -> torch.nn.Module:
    kind = (
        transformers.AutoModelForImageTextToText
        if family.endswith("_mm")
        else transformers.AutoModelForCausalLM
    )
    return kind.from_pretrained(FIXTURES / family, dtype=torch.float32).eval()


def _tokens(length: int, rows: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 300, size=(rows, length))


def test_chunked_rule_equals_the_recurrence_and_transformers():
    rng = np.random.default_rng(0)
    batch, length, heads, dk, dv = 2, 150, 3, 8, 12  # 150: a partial last chunk
    q, k = (rng.normal(size=(batch, length, heads, dk)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(batch, length, heads, dv)).astype(np.float32)
    g = (-0.5 * np.abs(rng.normal(size=(batch, length, heads)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(batch, length, heads))))).astype(np.float32)
    state = rng.normal(size=(batch, heads, dk, dv)).astype(np.float32)
    qn = delta._l2norm(jnp.asarray(q)) * dk**-0.5
    kn = delta._l2norm(jnp.asarray(k))
    ours, final = delta.chunked_delta_rule(
        qn, kn, jnp.asarray(v), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(state), 64
    )
    steps, carried = [], jnp.asarray(state)
    for t in range(length):
        out, carried = delta.recurrent_step(
            qn[:, t], kn[:, t], jnp.asarray(v[:, t]), jnp.asarray(g[:, t]),
            jnp.asarray(beta[:, t]), carried,
        )  # fmt: skip
        steps.append(out)
    np.testing.assert_allclose(ours, jnp.stack(steps, 1), atol=5e-5)
    np.testing.assert_allclose(final, carried, atol=5e-5)
    theirs, their_final = reference_rule.torch_chunk_gated_delta_rule(
        *(torch.tensor(x) for x in (q, k, v, g, beta)),
        initial_state=torch.tensor(state),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    np.testing.assert_allclose(ours, theirs.numpy(), atol=5e-5)
    np.testing.assert_allclose(final, their_final.numpy(), atol=5e-5)


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("qwen3_5_mm", marks=pytest.mark.slow)])
def test_logits_match_transformers_at_512_tokens(imported, family):
    model, info = load_model(imported[family], dtype="float32")
    tokens = _tokens(LENGTH)
    with torch.no_grad():
        expected = _theirs(family)(torch.tensor(tokens)).logits.numpy()
    ids = jnp.asarray(tokens, jnp.int32)
    got = np.asarray(model.lm_logits(model(ids, jnp.ones_like(ids))))
    assert np.abs(got - expected).max() < 1e-4
    assert info["hf"]["family"] == "qwen3_5"
    assert ("text_only" in info["hf"]) == family.endswith("_mm")


# 64 new tokens in make test, 256 in the slow tier.
@pytest.mark.parametrize("new_tokens", [64, pytest.param(NEW_TOKENS, marks=pytest.mark.slow)])
def test_greedy_tokens_match_transformers_generate(imported, new_tokens):
    model, info = load_model(imported["qwen3_5"], dtype="float32")
    prompt = _tokens(12, rows=1, seed=1)
    settings = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        theirs = _theirs("qwen3_5").generate(torch.tensor(prompt), generation_config=settings)
    ids = jnp.asarray(prompt, jnp.int32)
    out = sampler.generate(
        model, ids, jnp.ones_like(ids), jax.random.key(0), max_new_tokens=new_tokens,
        eos_id=-1, pad_id=0, temperature=0.0,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), theirs[0, 12:].numpy())


def test_decoding_states_continue_the_prefill_under_left_pads(imported):
    model, _ = load_model(imported["qwen3_5"], dtype="float32")
    tokens = jnp.asarray(_tokens(40), jnp.int32)
    mask = jnp.ones_like(tokens).at[0, :5].set(0)  # a left-padded row beside a full one
    full = np.asarray(nnx.jit(lambda m, t, k: m(t, k))(model, tokens, mask))
    prompt = 30
    # Compiled: one program a step (eagerly, each of the hybrid layers' ops is dispatched and
    # compiled alone: this test took 22 s alone, 12 s so).
    prefill = nnx.jit(lambda m, t, k: m.prefill(t, k, 40))
    decode = nnx.jit(lambda m, t, c: m.decode(t, c))
    hidden, cache = prefill(model, tokens[:, :prompt], mask[:, :prompt])
    steps = [hidden[:, -1]]
    for t in range(prompt, 39):
        last, cache = decode(model, tokens[:, t], cache)
        steps.append(last)
    np.testing.assert_allclose(np.stack(steps, 1), full[:, prompt - 1 : -1], atol=5e-5)
    # Six DeltaNet states of fixed size, and keys and values for the two attention layers.
    assert len(cache.delta) == 6 and len(cache.k) == len(cache.v) == 2
    config = model.config
    assert cache.delta[0].recurrent.shape == (
        2, config.delta_value_heads, config.delta_key_dim, config.delta_value_dim,
    )  # fmt: skip
    # A left-padded row computes what the same tokens do unpadded.
    alone = np.asarray(nnx.jit(lambda m, t: m(t, jnp.ones_like(t)))(model, tokens[:1, 5:]))
    np.testing.assert_allclose(full[0, 5:], alone[0], atol=5e-5)


def test_export_loads_in_transformers_as_the_text_model(imported, tmp_path):
    out = tmp_path / "export"
    export_hf(imported["qwen3_5_mm"], str(out), dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["model_type"] == "qwen3_5_text"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(theirs).__name__ == "Qwen3_5ForCausalLM"
    tokens = _tokens(70)
    with torch.no_grad():
        exported = theirs(torch.tensor(tokens)).logits.numpy()
        original = _theirs("qwen3_5_mm")(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(exported, original, atol=1e-5)
    again = import_hf(str(out), str(tmp_path / "again"))["out"]
    first, _ = load_model(imported["qwen3_5_mm"], dtype="float32")
    second, _ = load_model(again, dtype="float32")
    for a, b in zip(
        jax.tree.leaves(nnx.state(first, nnx.Param)),
        jax.tree.leaves(nnx.state(second, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def _hf_config(**changes) -> dict:
    config = json.loads((FIXTURES / "qwen3_5_mm" / "config.json").read_text())
    config["text_config"].update(changes)
    return config


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"mlp_only_layers": [1]}, "mlp_only_layers"),
        ({"attention_bias": True}, "attention_bias"),
        ({"layer_types": ["linear_attention"] * 7 + ["global_attention"]}, "global_attention"),
    ],
)
def test_unmodelled_fields_are_refused_by_name(changes, named):
    with pytest.raises(HFImportError, match=named):
        model_config_from_hf(_hf_config(**changes), dtype="float32")


def test_moe_and_patternless_stacks_are_refused(tmp_path):
    folder = tmp_path / "moe"
    shutil.copytree(FIXTURES / "qwen3_5_mm", folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    (folder / "config.json").write_text(json.dumps(config))
    # Labelled MoE, it takes Qwen3_5MoeTextConfig's experts: the dense tensors do not fit.
    with pytest.raises(HFImportError, match="missing tensors(.|\n)*mlp.experts.0.gate_proj"):
        import_hf(str(folder), str(tmp_path / "out"))
    irregular = ["linear_attention"] * 9 + ["full_attention"] * 3
    with pytest.raises(ValueError, match="do not repeat"):
        model_config_from_hf(
            _hf_config(num_hidden_layers=12, layer_types=irregular), dtype="float32"
        )


def test_real_shapes_read_from_the_released_config():
    """Qwen3.5-9B's text config (as its config.json gives it): the 9B's parameter count."""
    text = {
        "attn_output_gate": True, "full_attention_interval": 4, "head_dim": 256,
        "hidden_size": 4096, "intermediate_size": 12288, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "num_attention_heads": 16, "num_hidden_layers": 32,
        "num_key_value_heads": 4, "vocab_size": 248320, "mtp_num_hidden_layers": 1,
        "mamba_ssm_dtype": "float32",
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                            "rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25},
    }  # fmt: skip
    hf = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}
    config = model_config_from_hf(hf, dtype="bfloat16")
    assert config.layer_period() == (True, True, True, False)
    assert config.rotary_dim == 64 and not config.tie_embeddings
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    with torch.device("meta"):  # transformers' own text model of that config, unallocated
        theirs = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**text))
    assert count == sum(p.numel() for p in theirs.parameters())


def _tiny_hybrid(**changes):
    return model_config(
        "tiny", 64, n_layers=8, head_dim=16, qk_norm=True, norm_scale_offset=1.0,
        attn_output_gate=True, rotary_fraction=0.25,
        layer_types=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
        + ("full_attention",),
        delta_key_heads=2, delta_value_heads=4, delta_key_dim=8, delta_value_dim=8,
        **{"delta_chunk": 8, **changes},
    )  # fmt: skip


# Slow tier: fsdp and remat against the replicated stack are in make test for the dense stack
# (test_fsdp.py, test_model.py).
@pytest.mark.slow
def test_fsdp_and_remat_compute_what_the_replicated_stack_does():
    config = _tiny_hybrid()
    model = Transformer(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 2, 20), 0, 64)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, tokens):
        m = nnx.merge(graphdef, fsdp.gather_outer(params))
        hidden = m(tokens, jnp.ones_like(tokens))
        return jnp.mean(m.lm_logits(hidden) ** 2)

    devices = jax.local_devices()[:8]
    sharded = fsdp.shard(nnx.to_pure_dict(params), devices)
    sharded_state = jax.tree.map(lambda x: x, params)
    nnx.replace_by_pure_dict(sharded_state, sharded)
    value = jax.pmap(loss, axis_name="data")(sharded_state, tokens)
    expected = jax.vmap(loss, in_axes=(None, 0))(params, tokens)
    np.testing.assert_allclose(value, expected, rtol=2e-5)
    unrolled = dataclasses.replace(config, remat="none")
    plain = Transformer(unrolled, rngs=nnx.Rngs(0))
    ids = tokens[0]
    np.testing.assert_allclose(
        plain(ids, jnp.ones_like(ids)), model(ids, jnp.ones_like(ids)), atol=1e-5
    )


# Slow tier: adapters on every DeltaNet projection are trained by test_hf_pipeline.py's Qwen3.5
# run, slow too.
@pytest.mark.slow
def test_adapters_reach_the_deltanet_projections():
    config = _tiny_hybrid()
    model = Transformer(config, rngs=nnx.Rngs(0))
    targets = ("q_proj", "in_proj_qkv", "in_proj_z", "out_proj", "down_proj")
    adapted = lora.attach(model, rank=2, alpha=4.0, targets=targets, seed=1)
    pure = nnx.to_pure_dict(nnx.state(adapted, nnx.Param))
    assert pure["linear_blocks"]["delta"]["w_qkv"]["lora"]["lora_a"].shape == (6, 32, 2)
    assert pure["blocks"]["attn"]["wq"]["lora"]["lora_b"].shape == (2, 2, 128)
    assert (
        "lora" in pure["linear_blocks"]["mlp"]["w_down"]
        and "lora" in pure["blocks"]["mlp"]["w_down"]
    )
    ids = jnp.ones((1, 9), jnp.int32)
    np.testing.assert_allclose(adapted(ids, ids), model(ids, ids), atol=1e-6)  # B = 0
    merged = lora.merge(adapted)
    assert merged.config.lora_rank == 0


# Slow tier: 8 devices against one are in make test for the dense stack (test_ppo_update.py,
# test_lora.py).
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gradients_under_pmap_on_8_devices_equal_one_device():
    """Every device differentiates the hybrid stack at once (a 64-row chunk: the size whose
    triangular solve hung XLA:CPU under pmap, delta.unit_lower_inverse)."""
    config = _tiny_hybrid(delta_chunk=64)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    tokens = jax.random.randint(jax.random.key(2), (8, 2, 70), 0, 64)

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        return jnp.mean(model.lm_logits(model(tokens, jnp.ones_like(tokens))) ** 2)

    grads = jax.pmap(jax.grad(loss), in_axes=(None, 0))(params, tokens)
    one = jax.grad(loss)(params, tokens[3])
    for many, single in zip(jax.tree.leaves(grads), jax.tree.leaves(one), strict=True):
        np.testing.assert_allclose(many[3], single, rtol=1e-4, atol=1e-7)
