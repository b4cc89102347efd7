"""KV-cache sampler: matches full recomputation, stops at EOS (and stops decoding once every
sequence has), samples reproducibly, keeps its cache in the compute dtype."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from components.core.model.sampler import filter_logits, generate, generate_without_cache
from components.core.model.transformer import Transformer, model_config
from components.core.training import parallel

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


def ending_token(tokens: np.ndarray) -> tuple[int, int]:
    """The token every row emits soonest (as EOS it ends them all), and the step at which the
    last row first emits it."""
    firsts = {
        int(value): max(int(np.flatnonzero(row == value)[0]) for row in tokens)
        for value in np.unique(tokens)
        if all((row == value).any() for row in tokens)
    }
    eos_id = min(firsts, key=firsts.get)
    return eos_id, firsts[eos_id]


def assert_ended_at_eos(out, full, eos_id: int, atol: float = 0.0) -> None:
    """``out`` is the EOS-free run ``full`` with each row ended at its first ``eos_id``."""
    full_tokens = np.asarray(full.tokens)
    for row, tokens in enumerate(full_tokens):
        end = int(np.flatnonzero(tokens == eos_id)[0]) + 1 if eos_id in tokens else len(tokens)
        expected = np.where(np.arange(len(tokens)) < end, tokens, PAD_ID)
        np.testing.assert_array_equal(out.tokens[row], expected)
        np.testing.assert_array_equal(out.mask[row], np.arange(len(tokens)) < end)
        np.testing.assert_allclose(out.logprobs[row, :end], full.logprobs[row, :end], atol=atol)
        assert not np.any(out.logprobs[row, end:])


def test_decoding_stops_once_every_sequence_has_ended(split, prompts, greedy, monkeypatch):
    """The decode loop runs until the last row's EOS, and its outputs are the full loop's."""
    rows = 3  # the fixture's first three rows all end early under one EOS id
    eos_id, last_end = ending_token(np.asarray(greedy.tokens[:rows]))
    assert last_end < NEW_TOKENS - 2, "no EOS id ends every row early: the test means nothing"
    steps = []
    decode = Transformer.decode

    def counted(self, tokens, cache, layers=None):
        jax.debug.callback(lambda: steps.append(1))
        return decode(self, tokens, cache, layers)

    monkeypatch.setattr(Transformer, "decode", counted)
    graphdef, params = split
    settings = dict(max_new_tokens=NEW_TOKENS, eos_id=eos_id, pad_id=PAD_ID, temperature=0.0)
    run = jax.jit(lambda p, t, m: generate((graphdef, p), t, m, jax.random.key(0), **settings))
    out = jax.block_until_ready(run(params, prompts[0][:rows], prompts[1][:rows]))
    jax.effects_barrier()
    assert len(steps) == last_end < NEW_TOKENS - 1  # the first token comes from the prefill
    full = jax.tree.map(lambda x: x[:rows], greedy)
    assert_ended_at_eos(out, full, eos_id)


@pytest.mark.timeout(120)  # devices disagreeing on when to stop would hang in a collective
def test_early_stop_with_sharded_params_agrees_across_devices(split, prompts, greedy):
    """fsdp gathers layers at every decode step: a device whose rows ended keeps stepping."""
    graphdef, params = split
    eos_id, last_end = ending_token(np.asarray(greedy.tokens[:2]))  # device 0's rows
    devices = jax.local_devices()[:2]

    def rollout(params, tokens, mask):
        return generate(
            (graphdef, params), tokens, mask, jax.random.key(0),
            max_new_tokens=NEW_TOKENS, eos_id=eos_id, pad_id=PAD_ID, temperature=0.0,
        )  # fmt: skip

    shard = lambda x: x.reshape(len(devices), -1, *x.shape[1:])  # noqa: E731
    sharded = parallel.place(params, sharded=True, devices=devices)
    out = jax.pmap(rollout, axis_name="data", devices=devices)(sharded, *map(shard, prompts))
    out = jax.tree.map(lambda x: np.asarray(x).reshape(greedy.tokens.shape), out)
    lengths = out.mask.sum(axis=-1)
    assert lengths[:2].max() == last_end + 1 < lengths[2:].max()  # device 0 ends first
    assert_ended_at_eos(out, greedy, eos_id, atol=1e-5)  # gathered weights: other fusions


def test_kv_cache_is_in_the_compute_dtype(prompts):
    model = Transformer(model_config("tiny", VOCAB, dtype="bfloat16"), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def prefill_and_decode(params, tokens, mask):
        model = nnx.merge(graphdef, params)
        _, cache = model.prefill(tokens, mask, cache_size=12)
        return model.decode(tokens[:, -1], cache)[1]

    cache = jax.eval_shape(prefill_and_decode, params, *prompts)
    assert {array.dtype for array in (*cache.k, *cache.v)} == {jnp.dtype(jnp.bfloat16)}
    # One array a layer, heads major: k [B, Kv, Hd, S], v [B, Kv, S, Hd] (layers.attend).
    config, rows = model.config, prompts[0].shape[0]
    head = (rows, config.n_kv_heads)
    assert len(cache.k) == len(cache.v) == config.n_layers
    assert cache.k[0].shape == (*head, config.resolved_head_dim, 12)
    assert cache.v[0].shape == (*head, 12, config.resolved_head_dim)


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


def test_embedding_rows_past_the_tokenizer_are_never_sampled(split, prompts, greedy):
    """Qwen2.5 pads its embedding past its tokenizer; those rows are no token, so neither
    greedy nor sampled decoding may pick them, and logprobs stay the whole softmax's."""
    limit = 31  # about half the rows: an unlimited draw picks past it at once
    unlimited = sample(split, prompts, temperature=1.0)
    assert (np.asarray(unlimited.tokens) >= limit).any() and (
        np.asarray(greedy.tokens) >= limit
    ).any()
    for temperature in (0.0, 1.0):
        limited = sample(split, prompts, temperature=temperature, vocab_size=limit)
        tokens = np.asarray(limited.tokens)
        assert tokens.max() < limit and (tokens > 0).any()
        logprobs = np.asarray(limited.logprobs)
        assert (logprobs < 0).all() and np.isfinite(logprobs).all()
    # A limit at the embedding's size changes nothing.
    same = sample(split, prompts, temperature=0.0, vocab_size=VOCAB)
    np.testing.assert_array_equal(same.tokens, greedy.tokens)
