"""PPO math against direct NumPy loop references, under jit and under pmap over 8 devices."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components.ppo.losses import (
    entropy_from_logits,
    gae,
    kl_penalty,
    last_token_index,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    token_entropy,
    token_rewards,
    value_loss,
)

B, T = 6, 9
ATOL = 1e-5
# Padding holds this value so a leak of any padded position into a result is loud.
PAD_GARBAGE = 1e4


def ragged_mask(rng: np.random.Generator, batch: int = B, length: int = T) -> np.ndarray:
    """Response masks with lengths 1..T, including a full row and a length-1 row."""
    lengths = rng.integers(1, length + 1, size=batch)
    lengths[0], lengths[-1] = length, 1
    return (np.arange(length)[None, :] < lengths[:, None]).astype(np.float32)


def with_garbage(x: np.ndarray, mask: np.ndarray, garbage: float = PAD_GARBAGE) -> np.ndarray:
    """``x`` in float32 with padding overwritten by a large value."""
    return np.where(mask > 0, x, garbage).astype(np.float32)


def lengths_of(mask: np.ndarray) -> list[int]:
    """Number of real tokens per row of a prefix mask."""
    return [int(row.sum()) for row in mask]


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded NumPy generator per test."""
    return np.random.default_rng(0)


# ---------------------------------------------------------------- NumPy references (loops)


def ref_masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
    """Mean over real tokens by an explicit loop."""
    total, count = 0.0, 0
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[b, t]:
                total += float(x[b, t])
                count += 1
    return total / count


def ref_masked_var(x: np.ndarray, mask: np.ndarray) -> float:
    """Bessel-corrected variance over real tokens by an explicit loop."""
    values = [float(x[b, t]) for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t]]
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / (len(values) - 1)


def ref_whiten(x: np.ndarray, mask: np.ndarray, shift_mean: bool) -> np.ndarray:
    """TRL's masked_whiten by explicit loops, 0 on padding."""
    mean, var = ref_masked_mean(x, mask), ref_masked_var(x, mask)
    out = np.zeros(x.shape, np.float64)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask[b, t]:
                out[b, t] = (x[b, t] - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean)
    return out


def ref_gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float):
    """GAE per sequence over its real tokens only, value 0 after the last one."""
    advantages = np.zeros(rewards.shape, np.float64)
    for b, length in enumerate(lengths_of(mask)):
        last_gae = 0.0
        for t in reversed(range(length)):
            next_value = float(values[b, t + 1]) if t + 1 < length else 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            last_gae = delta + gamma * lam * last_gae
            advantages[b, t] = last_gae
    returns = np.where(mask > 0, advantages + np.where(mask > 0, values, 0.0), 0.0)
    return advantages, returns


def ref_policy_loss(logp, old, adv, mask, clip_eps):
    """Clipped surrogate, clipfrac and approxkl by explicit loops."""
    losses, clipped_flags, sq = [], [], []
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            ratio = math.exp(logp[b, t] - old[b, t])
            unclipped = -adv[b, t] * ratio
            clipped = -adv[b, t] * min(max(ratio, 1 - clip_eps), 1 + clip_eps)
            losses.append(max(unclipped, clipped))
            clipped_flags.append(1.0 if clipped > unclipped else 0.0)
            sq.append((logp[b, t] - old[b, t]) ** 2)
    return np.mean(losses), np.mean(clipped_flags), 0.5 * np.mean(sq)


def ref_value_loss(v, old_v, returns, mask, clip_eps):
    """Clipped value loss and clipfrac by explicit loops."""
    losses, clipped_flags = [], []
    for b in range(v.shape[0]):
        for t in range(v.shape[1]):
            if not mask[b, t]:
                continue
            v_clip = min(max(v[b, t], old_v[b, t] - clip_eps), old_v[b, t] + clip_eps)
            unclipped = (v[b, t] - returns[b, t]) ** 2
            clipped = (v_clip - returns[b, t]) ** 2
            losses.append(max(unclipped, clipped))
            clipped_flags.append(1.0 if clipped > unclipped else 0.0)
    return 0.5 * np.mean(losses), np.mean(clipped_flags)


# ---------------------------------------------------------------- KL estimates and rewards


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_matches_reference(rng, estimator):
    """k1 = logp − logp_ref and k3 = (r − 1) − log r per token, 0 on padding."""
    mask = ragged_mask(rng)
    logp = rng.normal(-2.0, 1.0, (B, T))
    ref = logp + rng.normal(0.0, 0.5, (B, T))
    expected = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                r = math.exp(ref[b, t] - logp[b, t])
                expected[b, t] = (
                    logp[b, t] - ref[b, t] if estimator == "k1" else r - 1 - math.log(r)
                )
    fn = jax.jit(kl_penalty, static_argnames="estimator")
    got = fn(
        with_garbage(logp, mask), with_garbage(ref, mask, -PAD_GARBAGE), mask, estimator=estimator
    )
    np.testing.assert_allclose(got, expected, atol=ATOL)
    if estimator == "k3":
        assert np.all(np.asarray(got) >= 0.0)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_penalty_is_zero_for_identical_logprobs(rng, estimator):
    """Policy equal to the reference has zero KL on every token."""
    logp = rng.normal(-2.0, 1.0, (B, T)).astype(np.float32)
    got = kl_penalty(logp, logp, ragged_mask(rng), estimator=estimator)
    np.testing.assert_array_equal(got, np.zeros((B, T)))


def test_kl_penalty_rejects_unknown_estimator():
    """A misspelled estimator fails with a message naming the choices."""
    with pytest.raises(ValueError, match="'k1' or 'k3'"):
        kl_penalty(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), estimator="k2")


def test_token_rewards_put_score_at_last_real_token(rng):
    """−kl_coef·kl on each real token, the score added at the last one, per-row KL sum."""
    mask = ragged_mask(rng)
    kl = rng.normal(0.1, 0.3, (B, T))
    score = rng.normal(0.0, 2.0, (B,))
    kl_coef = 0.05
    expected = np.zeros((B, T))
    expected_non_score = np.zeros(B)
    for b, length in enumerate(lengths_of(mask)):
        for t in range(length):
            expected[b, t] = -kl_coef * kl[b, t]
            expected_non_score[b] += -kl_coef * kl[b, t]
        expected[b, length - 1] += score[b]
    rewards, non_score = jax.jit(token_rewards)(score, with_garbage(kl, mask), mask, kl_coef)
    np.testing.assert_allclose(rewards, expected, atol=ATOL)
    np.testing.assert_allclose(non_score, expected_non_score, atol=ATOL)
    np.testing.assert_array_equal(last_token_index(mask), np.array(lengths_of(mask)) - 1)


# ---------------------------------------------------------------- GAE


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)])
def test_gae_matches_reference(rng, gamma, lam):
    """Reverse-scan GAE equals the per-sequence loop, with garbage in the padding."""
    mask = ragged_mask(rng)
    rewards = rng.normal(0.0, 1.0, (B, T))
    values = rng.normal(0.0, 1.0, (B, T))
    expected_adv, expected_ret = ref_gae(rewards, values, mask, gamma, lam)
    fn = jax.jit(gae, static_argnames=("gamma", "lam"))
    adv, ret = fn(
        with_garbage(rewards, mask), with_garbage(values, mask), mask, gamma=gamma, lam=lam
    )
    np.testing.assert_allclose(adv, expected_adv, atol=ATOL)
    np.testing.assert_allclose(ret, expected_ret, atol=ATOL)


def test_gae_padding_does_not_leak_into_earlier_tokens(rng):
    """Rewards or values on padding, or after a hole in the mask, change nothing before them."""
    mask = ragged_mask(rng)
    rewards = rng.normal(0.0, 1.0, (B, T)).astype(np.float32)
    values = rng.normal(0.0, 1.0, (B, T)).astype(np.float32)
    base_adv, _ = gae(rewards, values, mask)
    noisy = rng.normal(0.0, 100.0, (B, T)).astype(np.float32)
    adv, _ = gae(np.where(mask > 0, rewards, noisy), np.where(mask > 0, values, -noisy), mask)
    np.testing.assert_allclose(adv, base_adv, atol=ATOL)
    # A hole ends the episode there: tokens before it see only what lies before it.
    holed = np.ones((1, T), np.float32)
    holed[0, 4] = 0.0
    adv_holed, _ = gae(rewards[:1], values[:1], holed)
    adv_cut, _ = gae(rewards[:1, :4], values[:1, :4], np.ones((1, 4), np.float32))
    np.testing.assert_allclose(adv_holed[:, :4], adv_cut, atol=ATOL)
    assert float(adv_holed[0, 4]) == 0.0


# ---------------------------------------------------------------- masked statistics


def test_masked_mean_and_var_match_reference(rng):
    """Per-token mean and Bessel-corrected variance over real tokens only."""
    mask = ragged_mask(rng)
    x = rng.normal(3.0, 2.0, (B, T))
    padded = with_garbage(x, mask)
    np.testing.assert_allclose(
        jax.jit(masked_mean)(padded, mask), ref_masked_mean(x, mask), atol=ATOL
    )
    np.testing.assert_allclose(
        jax.jit(masked_var)(padded, mask), ref_masked_var(x, mask), rtol=1e-5, atol=ATOL
    )


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_local_matches_reference(rng, shift_mean):
    """Local whitening equals TRL's formula by loops; 0 on padding."""
    mask = ragged_mask(rng)
    x = rng.normal(1.5, 3.0, (B, T))
    fn = jax.jit(masked_whiten, static_argnames="shift_mean")
    got = fn(with_garbage(x, mask), mask, shift_mean=shift_mean)
    np.testing.assert_allclose(got, ref_whiten(x, mask, shift_mean), atol=ATOL)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_global_under_pmap_equals_whitening_concatenated_batch(rng, shift_mean):
    """With axis_name, each device whitens by the statistics of the whole global batch."""
    devices = jax.local_device_count()
    assert devices == 8, "tests/conftest.py should provide 8 virtual CPU devices"
    mask = ragged_mask(rng, batch=devices * 3).reshape(devices, 3, T)
    # A different mean per device, so local and global whitening visibly disagree.
    x = rng.normal(0.0, 1.0, (devices, 3, T)) + np.arange(devices)[:, None, None]
    whiten = jax.pmap(
        lambda x, m: masked_whiten(x, m, shift_mean=shift_mean, axis_name="data"),
        axis_name="data",
    )
    got = np.asarray(whiten(with_garbage(x, mask), mask)).reshape(devices * 3, T)
    expected = ref_whiten(x.reshape(-1, T), mask.reshape(-1, T), shift_mean)
    np.testing.assert_allclose(got, expected, atol=ATOL)
    local = np.asarray(masked_whiten(x[1], mask[1], shift_mean=shift_mean))
    assert not np.allclose(local, got[3:6], atol=1e-2)


def test_masked_mean_and_var_global_under_pmap(rng):
    """psum'd mean and variance equal those of the concatenated batch on every device."""
    devices = jax.local_device_count()
    mask = ragged_mask(rng, batch=devices * 2).reshape(devices, 2, T)
    x = rng.normal(0.0, 1.0, (devices, 2, T)) * (1 + np.arange(devices))[:, None, None]
    stats = jax.pmap(
        lambda x, m: (masked_mean(x, m, axis_name="data"), masked_var(x, m, axis_name="data")),
        axis_name="data",
    )
    mean, var = stats(with_garbage(x, mask), mask)
    flat_x, flat_mask = x.reshape(-1, T), mask.reshape(-1, T)
    np.testing.assert_allclose(
        mean, np.full(devices, ref_masked_mean(flat_x, flat_mask)), atol=ATOL
    )
    np.testing.assert_allclose(var, np.full(devices, ref_masked_var(flat_x, flat_mask)), rtol=1e-5)


# ---------------------------------------------------------------- losses


def test_policy_loss_matches_reference_on_random_inputs(rng):
    """Surrogate, clipfrac and approxkl equal the loop reference with a mix of clipped tokens."""
    mask = ragged_mask(rng)
    old = rng.normal(-2.0, 1.0, (B, T))
    logp = old + rng.normal(0.0, 0.3, (B, T))
    adv = rng.normal(0.0, 1.0, (B, T))
    loss, metrics = jax.jit(policy_loss)(
        with_garbage(logp, mask),
        with_garbage(old, mask, -PAD_GARBAGE),
        with_garbage(adv, mask),
        mask,
    )
    expected_loss, expected_clipfrac, expected_approxkl = ref_policy_loss(logp, old, adv, mask, 0.2)
    assert 0.0 < expected_clipfrac < 1.0
    np.testing.assert_allclose(loss, expected_loss, atol=ATOL)
    np.testing.assert_allclose(metrics["policy/clipfrac"], expected_clipfrac, atol=ATOL)
    np.testing.assert_allclose(metrics["policy/approxkl"], expected_approxkl, atol=ATOL)
    np.testing.assert_allclose(metrics["loss/policy"], expected_loss, atol=ATOL)


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_loss", "expected_clipped"),
    [
        (1.1, 1.0, -1.1, 0.0),  # inside the range: plain ratio·A
        (1.1, -1.0, 1.1, 0.0),
        (1.5, 2.0, -2.0 * 1.2, 1.0),  # A > 0, ratio above 1 + ε: clipped, no incentive to push
        (1.5, -2.0, 2.0 * 1.5, 0.0),  # A < 0, ratio above: the unclipped, larger loss is kept
        (0.5, -2.0, 2.0 * 0.8, 1.0),  # A < 0, ratio below 1 − ε: clipped
        (0.5, 2.0, -2.0 * 0.5, 0.0),  # A > 0, ratio below: unclipped, pessimistic
    ],
)
def test_policy_loss_clip_cases(ratio, advantage, expected_loss, expected_clipped):
    """Each side of the clip range, for both signs of the advantage."""
    old = np.array([[-1.0, -1.0]], np.float32)
    logp = old + np.float32(math.log(ratio))
    adv = np.array([[advantage, 99.0]], np.float32)
    mask = np.array([[1.0, 0.0]], np.float32)
    loss, metrics = policy_loss(logp, old, adv, mask, clip_eps=0.2)
    np.testing.assert_allclose(loss, expected_loss, atol=ATOL)
    np.testing.assert_allclose(metrics["policy/clipfrac"], expected_clipped, atol=ATOL)
    np.testing.assert_allclose(metrics["policy/approxkl"], 0.5 * math.log(ratio) ** 2, atol=ATOL)


def test_value_loss_matches_reference(rng):
    """Clipped value loss and val/clipfrac equal the loop reference."""
    mask = ragged_mask(rng)
    old_v = rng.normal(0.0, 1.0, (B, T))
    v = old_v + rng.normal(0.0, 0.3, (B, T))
    returns = old_v + rng.normal(0.0, 1.0, (B, T))
    loss, metrics = jax.jit(value_loss)(
        with_garbage(v, mask), with_garbage(old_v, mask), with_garbage(returns, mask), mask
    )
    expected_loss, expected_clipfrac = ref_value_loss(v, old_v, returns, mask, 0.2)
    assert 0.0 < expected_clipfrac < 1.0
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, atol=ATOL)
    np.testing.assert_allclose(metrics["val/clipfrac"], expected_clipfrac, atol=ATOL)


@pytest.mark.parametrize(
    ("value", "expected_loss", "expected_clipped"),
    [
        (0.1, 0.5 * 0.9**2, 0.0),  # within ±ε of the old value
        (0.5, 0.5 * 0.8**2, 1.0),  # moved toward the return past ε: the clipped error counts
        (-0.5, 0.5 * 1.5**2, 0.0),  # moved away: the larger unclipped error counts
    ],
)
def test_value_loss_clip_cases(value, expected_loss, expected_clipped):
    """Old value 0, return 1, ε = 0.2."""
    mask = np.array([[1.0, 0.0]], np.float32)
    values = np.array([[value, 7.0]], np.float32)
    loss, metrics = value_loss(values, np.zeros((1, 2), np.float32), np.array([[1.0, -7.0]]), mask)
    np.testing.assert_allclose(loss, expected_loss, atol=ATOL)
    np.testing.assert_allclose(metrics["val/clipfrac"], expected_clipped, atol=ATOL)


def test_entropy_of_uniform_logits_is_log_vocab():
    """Equal logits over V tokens have entropy log V."""
    vocab = 37
    logits = jnp.full((2, 5, vocab), 3.0)
    mask = np.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], np.float32)
    np.testing.assert_allclose(entropy_from_logits(logits, mask), math.log(vocab), atol=ATOL)


def test_entropy_matches_reference_and_ignores_padding(rng):
    """Mean over real tokens of −Σ p log p, with −inf logits and garbage on padding."""
    mask = ragged_mask(rng)
    logits = rng.normal(0.0, 2.0, (B, T, 11))
    logits[:, :, 0] = -np.inf  # a banned token: p = 0 must contribute 0, not nan
    entropies = []
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                finite = logits[b, t, 1:]
                p = np.exp(finite - finite.max())
                p /= p.sum()
                entropies.append(-sum(pi * math.log(pi) for pi in p))
    padded = np.where(mask[:, :, None] > 0, logits, np.nan).astype(np.float32)
    got = jax.jit(entropy_from_logits)(padded, mask)
    np.testing.assert_allclose(got, np.mean(entropies), atol=ATOL)


def test_token_entropy_reuses_a_given_log_normalizer(rng):
    """The update passes the logsumexp its log-probs computed: the same entropies."""
    logits = jnp.asarray(rng.normal(0.0, 3.0, (B, T, 13)), jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    np.testing.assert_allclose(token_entropy(logits, log_z), token_entropy(logits), atol=ATOL)


# ---------------------------------------------------------------- everything under pmap


def test_functions_under_pmap_equal_their_jit_results(rng):
    """Without axis_name, each device's result equals the same call on its shard alone."""
    devices = jax.local_device_count()
    mask = ragged_mask(rng, batch=devices * 2).reshape(devices, 2, T)
    logp = rng.normal(-2.0, 1.0, (devices, 2, T)).astype(np.float32)
    ref = (logp + rng.normal(0.0, 0.3, logp.shape)).astype(np.float32)
    values = rng.normal(0.0, 1.0, logp.shape).astype(np.float32)
    score = rng.normal(0.0, 1.0, (devices, 2)).astype(np.float32)

    def shard_step(logp, ref, values, score, mask):
        """The rollout-side math of one PPO iteration on one shard."""
        kl = kl_penalty(logp, ref, mask, estimator="k3")
        rewards, non_score = token_rewards(score, kl, mask, 0.1)
        advantages, returns = gae(rewards, values, mask)
        pg_loss, _ = policy_loss(logp, ref, advantages, mask)
        vf_loss, _ = value_loss(values, values, returns, mask)
        return kl, rewards, non_score, advantages, returns, pg_loss, vf_loss

    pmapped = jax.pmap(shard_step, axis_name="data")(logp, ref, values, score, mask)
    for device in range(devices):
        single = jax.jit(shard_step)(
            logp[device], ref[device], values[device], score[device], mask[device]
        )
        for got, expected in zip(pmapped, single, strict=True):
            np.testing.assert_allclose(got[device], expected, atol=ATOL)
