"""KV-cache sampler: matches full recomputation, stops at EOS, samples reproducibly."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from components.core.model import Transformer, model_config
from components.core.sampler import filter_logits, generate, generate_without_cache

VOCAB = 61
PAD_ID = 0
NEW_TOKENS = 10
# Rows of different lengths, left padded: 8, 5, 3 and 1 real tokens.
PROMPT_LENGTHS = (8, 5, 3, 1)


@pytest.fixture(scope="module")
def split():
    """A tiny model whose weights are scaled x5 so greedy paths vary instead of repeating."""
    model = Transformer(model_config("tiny", VOCAB), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, jax.tree.map(lambda x: 5.0 * x, params)


@pytest.fixture(scope="module")
def prompts():
    width = max(PROMPT_LENGTHS)
    mask = jnp.array([[0] * (width - n) + [1] * n for n in PROMPT_LENGTHS], jnp.int32)
    tokens = jax.random.randint(jax.random.key(0), mask.shape, 3, VOCAB, dtype=jnp.int32)
    return tokens * mask, mask


@functools.cache
def _compiled(graphdef, cached: bool, **settings):
    """generate (or the no-cache greedy reference) jitted once per set of static settings."""

    def run(params, tokens, mask, rng):
        if cached:
            return generate((graphdef, params), tokens, mask, rng, **settings)
        settings_without_sampling = {k: v for k, v in settings.items() if k != "temperature"}
        return generate_without_cache((graphdef, params), tokens, mask, **settings_without_sampling)

    return jax.jit(run)


def sample(split, prompts, seed=0, *, cached=True, **settings):
    graphdef, params = split
    settings = dict(max_new_tokens=NEW_TOKENS, eos_id=VOCAB + 1, pad_id=PAD_ID) | settings
    fn = _compiled(graphdef, cached, **settings)
    return fn(params, *prompts, jax.random.key(seed))


@pytest.fixture(scope="module")
def greedy(split, prompts):
    return sample(split, prompts, temperature=0.0)


def test_greedy_with_cache_equals_full_recomputation(split, prompts, greedy):
    reference = sample(split, prompts, cached=False)
    assert greedy.tokens.shape == (len(PROMPT_LENGTHS), NEW_TOKENS)
    assert greedy.tokens.dtype == jnp.int32 and greedy.logprobs.dtype == jnp.float32
    np.testing.assert_array_equal(greedy.tokens, reference.tokens)
    np.testing.assert_allclose(greedy.logprobs, reference.logprobs, atol=1e-4)
    # The paths are not trivially constant, so the comparison means something.
    assert len(np.unique(np.asarray(greedy.tokens))) > NEW_TOKENS


def test_eos_stops_each_sequence(split, prompts, greedy):
    eos_id = int(greedy.tokens[0, 3])
    out = sample(split, prompts, temperature=0.0, eos_id=eos_id)
    for row in range(len(PROMPT_LENGTHS)):
        hits = np.flatnonzero(np.asarray(greedy.tokens[row]) == eos_id)
        stop = int(hits[0]) if hits.size else NEW_TOKENS
        expected_mask = np.arange(NEW_TOKENS) <= stop
        np.testing.assert_array_equal(out.mask[row], expected_mask.astype(np.int32))
        np.testing.assert_array_equal(out.tokens[row, : stop + 1], greedy.tokens[row, : stop + 1])
        assert bool(jnp.all(out.tokens[row, stop + 1 :] == PAD_ID))
        assert bool(jnp.all(out.logprobs[row, stop + 1 :] == 0.0))
    assert int(out.mask[0].sum()) <= 4


def test_sampling_is_deterministic_per_key(split, prompts):
    first = sample(split, prompts, seed=1, temperature=1.0)
    again = sample(split, prompts, seed=1, temperature=1.0)
    other = sample(split, prompts, seed=2, temperature=1.0)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    assert not np.array_equal(first.tokens, other.tokens)


@pytest.mark.parametrize("settings", [dict(top_k=1), dict(top_p=1e-4)])
def test_top_k_1_and_tiny_top_p_are_greedy(split, prompts, greedy, settings):
    out = sample(split, prompts, seed=3, temperature=0.7, **settings)
    np.testing.assert_array_equal(out.tokens, greedy.tokens)


def test_logprobs_match_recomputed_policy(split, prompts):
    out = sample(split, prompts, seed=4, temperature=1.3, top_k=20, top_p=0.95)
    graphdef, params = split
    tokens = jnp.concatenate([prompts[0], out.tokens], axis=1)
    mask = jnp.concatenate([prompts[1], out.mask], axis=1)
    recomputed = nnx.merge(graphdef, params).token_logprobs(tokens, mask)
    width = prompts[0].shape[1]
    generated = recomputed[:, width - 1 :]
    np.testing.assert_allclose(generated * out.mask, out.logprobs, atol=1e-4)


def test_filter_logits():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.isfinite(filter_logits(logits, 1.0, 2, 1.0)).sum() == 2
    # Mass before each token: 0, .5, .8, .95 -> top_p 0.6 keeps the first two.
    np.testing.assert_array_equal(
        np.isfinite(filter_logits(logits, 1.0, 0, 0.6)), [[True, True, False, False]]
    )
    np.testing.assert_allclose(filter_logits(logits, 2.0, 0, 1.0), logits / 2.0)


def test_generate_under_pmap(split, prompts, greedy):
    graphdef, params = split
    devices = jax.local_devices()[:2]

    def rollout(params, tokens, mask, rng):
        rng = jax.random.fold_in(rng, jax.lax.axis_index("data"))
        return generate(
            (graphdef, params), tokens, mask, rng,
            max_new_tokens=NEW_TOKENS, eos_id=VOCAB + 1, pad_id=PAD_ID, temperature=0.0,
        )  # fmt: skip

    shard = lambda x: x.reshape(len(devices), -1, *x.shape[1:])  # noqa: E731
    replicated = jax.tree.map(lambda x: jnp.stack([x] * len(devices)), params)
    rngs = jnp.stack([jax.random.key(0)] * len(devices))
    out = jax.pmap(rollout, axis_name="data", devices=devices)(
        replicated, shard(prompts[0]), shard(prompts[1]), rngs
    )
    np.testing.assert_array_equal(out.tokens.reshape(greedy.tokens.shape), greedy.tokens)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(max_new_tokens=200), "max_seq_len"),
    ],
)
def test_bad_settings_are_rejected(split, prompts, settings, message):
    settings = dict(max_new_tokens=4, eos_id=1, pad_id=PAD_ID) | settings
    with pytest.raises(ValueError, match=message):
        generate(split, *prompts, jax.random.key(0), **settings)
