"""Transformer: shapes, causality, padding invariance, GQA, remat equivalence, bf16, configs."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from components.core.model.transformer import PRESETS, ModelConfig, Transformer, model_config

VOCAB = 61


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return model_config("tiny", VOCAB)


@pytest.fixture(scope="module")
def split(config):
    """(graphdef, params) of a tiny model with a scalar head."""
    return nnx.split(Transformer(config, rngs=nnx.Rngs(0), scalar_head=True), nnx.Param)


@pytest.fixture(scope="module")
def forward(split):
    """Jitted (hidden, scalar) of the tiny model; compiled once per input shape."""
    graphdef, params = split

    @jax.jit
    def run(tokens, mask):
        model = nnx.merge(graphdef, params)
        hidden = model(tokens, mask)
        return hidden, model.scalar(hidden, mask)

    return run


def random_tokens(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 1, VOCAB, dtype=jnp.int32)


def test_shapes_and_dtypes(split, config):
    graphdef, params = split
    model = nnx.merge(graphdef, params)
    tokens, mask = random_tokens(0, (2, 7)), jnp.ones((2, 7), jnp.int32)
    hidden = model(tokens, mask)
    assert hidden.shape == (2, 7, config.dim) and hidden.dtype == jnp.float32
    logits = model.lm_logits(hidden)
    assert logits.shape == (2, 7, VOCAB) and logits.dtype == jnp.float32
    assert model.scalar(hidden, mask).shape == (2,)
    logprobs = model.token_logprobs(tokens, mask)
    assert logprobs.shape == (2, 6) and logprobs.dtype == jnp.float32
    assert bool(jnp.all(logprobs <= 0))


def test_params_are_stacked_fp32_and_the_only_state(split, config):
    graphdef, params = split
    assert params["blocks"]["attn"]["wq"]["kernel"].shape[0] == config.n_layers
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    model = nnx.merge(graphdef, params)
    assert not jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))


def test_causal(forward):
    tokens = random_tokens(1, (1, 10))
    changed = tokens.at[0, 6].set((tokens[0, 6] + 1) % VOCAB)
    mask = jnp.ones_like(tokens)
    before, _ = forward(tokens, mask)
    after, _ = forward(changed, mask)
    np.testing.assert_allclose(before[:, :6], after[:, :6], atol=1e-6)
    assert not np.allclose(before[:, 6:], after[:, 6:], atol=1e-4)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_invariance(forward, side):
    real = random_tokens(2, (1, 6))
    reference, reference_scalar = forward(real, jnp.ones_like(real))
    pads = jnp.zeros((1, 4), jnp.int32)
    ones = jnp.ones_like(real)
    if side == "left":
        tokens, mask, where = jnp.concatenate([pads, real], 1), jnp.concatenate([pads, ones], 1), 4
    else:
        tokens, mask, where = jnp.concatenate([real, pads], 1), jnp.concatenate([ones, pads], 1), 0
    hidden, scalar = forward(tokens, mask)
    np.testing.assert_allclose(hidden[:, where : where + 6], reference, atol=1e-5)
    np.testing.assert_allclose(scalar, reference_scalar, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads(split, config, forward):
    graphdef, params = split
    mha = Transformer(dataclasses.replace(config, n_kv_heads=config.n_heads), rngs=nnx.Rngs(1))
    mha_graphdef, mha_params = nnx.split(mha, nnx.Param)
    group = config.n_heads // config.n_kv_heads
    head_dim = config.resolved_head_dim

    def repeat_heads(kernel: jax.Array) -> jax.Array:
        layers, dim, _ = kernel.shape
        per_head = kernel.reshape(layers, dim, config.n_kv_heads, head_dim)
        # Query head h reads kv head h // group.
        return jnp.repeat(per_head, group, axis=2).reshape(layers, dim, -1)

    copied = jax.tree.map(lambda x: x, nnx.State(params))
    del copied["scalar_head"]
    for name in ("wk", "wv"):
        copied["blocks"]["attn"][name]["kernel"] = nnx.Param(
            repeat_heads(params["blocks"]["attn"][name]["kernel"][...])
        )
    assert jax.tree.map(jnp.shape, copied) == jax.tree.map(jnp.shape, mha_params)
    tokens, mask = random_tokens(3, (2, 9)), jnp.ones((2, 9), jnp.int32)
    expected, _ = forward(tokens, mask)
    got = nnx.merge(mha_graphdef, copied)(tokens, mask)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def _loss_and_grads(config: ModelConfig, params: nnx.State, tokens, mask):
    graphdef = nnx.graphdef(Transformer(config, rngs=nnx.Rngs(0), scalar_head=True))

    def loss_fn(params):
        model = nnx.merge(graphdef, params)
        hidden = model(tokens, mask)
        nll = -jnp.mean(model.token_logprobs(tokens, mask))
        return nll + jnp.mean(model.scalar(hidden, mask) ** 2)

    return jax.jit(jax.value_and_grad(loss_fn))(params)


def test_remat_policies_agree(split, config):
    _, params = split
    tokens = random_tokens(4, (2, 12))
    mask = jnp.ones_like(tokens).at[1, :3].set(0)
    results = {
        policy: _loss_and_grads(dataclasses.replace(config, remat=policy), params, tokens, mask)
        for policy in ("none", "full", "dots_saveable")
    }
    loss_none, grads_none = results["none"]
    for policy in ("full", "dots_saveable"):
        loss, grads = results[policy]
        np.testing.assert_allclose(loss, loss_none, rtol=1e-6)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads, grads_none)


def test_bfloat16_compute_close_to_float32(split, config):
    graphdef, params = split
    bf16_model = Transformer(
        dataclasses.replace(config, dtype="bfloat16"), rngs=nnx.Rngs(0), scalar_head=True
    )
    nnx.update(bf16_model, params)
    tokens, mask = random_tokens(5, (2, 8)), jnp.ones((2, 8), jnp.int32)
    assert bf16_model(tokens, mask).dtype == jnp.bfloat16
    got = bf16_model.token_logprobs(tokens, mask)
    assert got.dtype == jnp.float32
    expected = nnx.merge(graphdef, params).token_logprobs(tokens, mask)
    np.testing.assert_allclose(got, expected, atol=0.05)


def test_untied_embeddings_have_their_own_head(config):
    model = Transformer(dataclasses.replace(config, tie_embeddings=False), rngs=nnx.Rngs(0))
    assert model.lm_head.shape == (config.dim, VOCAB)
    hidden = model(random_tokens(6, (1, 4)), jnp.ones((1, 4), jnp.int32))
    assert model.lm_logits(hidden).shape == (1, 4, VOCAB)


def test_scalar_head_init():
    config = ModelConfig(
        vocab_size=8, dim=512, n_layers=1, n_heads=4, n_kv_heads=4, hidden_dim=8, max_seq_len=8
    )
    head = Transformer(config, rngs=nnx.Rngs(0), scalar_head=True).scalar_head
    assert float(jnp.abs(head.bias[...]).max()) == 0.0
    assert abs(float(jnp.std(head.kernel[...])) * (512 + 1) ** 0.5 - 1.0) < 0.15


def test_scalar_without_head_is_an_error(config):
    model = Transformer(config, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="scalar_head=True"):
        model.scalar(jnp.zeros((1, 2, config.dim)), jnp.ones((1, 2)))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(dim=30), "dim"),
        (dict(head_dim=7), "head_dim"),
        (dict(dtype="float16"), "dtype"),
        (dict(remat="some"), "remat"),
        (dict(n_layers=0), "n_layers"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        model_config("tiny", VOCAB, **overrides)


def test_config_round_trip_through_json(config):
    restored = ModelConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert restored == config
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        ModelConfig.from_dict({**config.to_dict(), "num_experts": 8})


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="tiny"):
        model_config("13b", VOCAB)


@pytest.mark.parametrize(
    ("preset", "vocab", "low", "high"),
    [
        ("tiny", VOCAB, 1e4, 1e5),
        ("demo", 512, 5e5, 2e6),  # 8.5e5
        ("1b", 128256, 1.2e9, 1.3e9),  # Llama-3.2-1B: 1.24e9
        ("2b", 256000, 2.5e9, 2.7e9),  # Gemma-2-2B: 2.61e9
        ("7b", 32000, 6.6e9, 6.9e9),  # Llama-2-7B: 6.74e9
    ],
)
def test_preset_param_counts(preset, vocab, low, high):
    assert preset in PRESETS
    config = model_config(preset, vocab)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    count = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    assert low <= count <= high, f"{preset}: {count:.3e} params"


def test_forward_under_pmap(split, forward):
    graphdef, params = split
    devices = jax.local_devices()[:2]

    def per_device(params, tokens, mask):
        return nnx.merge(graphdef, params)(tokens, mask)

    tokens = random_tokens(7, (2, 1, 5))
    mask = jnp.ones_like(tokens)
    replicated = jax.tree.map(lambda x: jnp.stack([x] * len(devices)), params)
    hidden = jax.pmap(per_device, axis_name="data", devices=devices)(replicated, tokens, mask)
    np.testing.assert_allclose(hidden[:, 0], forward(tokens[:, 0], mask[:, 0])[0], atol=1e-5)
