"""Advantages without a critic (grpo, rloo) and their reward scalings, score normalization
(z-scores, quantiles, the missing-EOS penalty) and the loss aggregations, against NumPy
references and by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components.ppo.losses import group_advantages


def test_group_advantages_match_numpy_references():
    """GRPO: (s − group mean) / (Bessel std + 1e-4); RLOO: s − mean of the group's others."""
    rng = np.random.default_rng(3)
    scores = rng.normal(size=12).astype(np.float32)
    groups = scores.reshape(3, 4).astype(np.float64)
    mean = groups.mean(axis=1, keepdims=True)
    grpo = (groups - mean) / (groups.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    others = (groups.sum(axis=1, keepdims=True) - groups) / 3
    np.testing.assert_allclose(group_advantages(scores, 4, "grpo"), grpo.reshape(-1), rtol=1e-5)
    np.testing.assert_allclose(
        group_advantages(scores, 4, "rloo"), (groups - others).reshape(-1), rtol=1e-5, atol=1e-6
    )
    # A group of equal scores carries no signal: zero advantage, not a division by zero.
    np.testing.assert_array_equal(group_advantages(np.ones(4, np.float32), 4, "grpo"), 0.0)
    with pytest.raises(ValueError, match="grpo"):
        group_advantages(scores, 4, "ppo")


def test_grpo_reward_scalings_none_group_and_batch():
    """scale_rewards none: s − group mean exactly (Dr. GRPO); group: divided by the group's
    Bessel std + 1e-4, as before; batch: by the Bessel std + 1e-4 of every score of the
    batch, global over the devices under pmap (TRL's scale_rewards)."""
    rng = np.random.default_rng(4)
    scores = (rng.normal(size=(8, 8)) * np.arange(1, 9)[:, None]).astype(np.float32)
    groups = scores.reshape(-1, 4)
    centred = groups - groups.mean(axis=1, keepdims=True)
    np.testing.assert_array_equal(
        group_advantages(scores.reshape(-1), 4, "grpo", "none"), centred.reshape(-1)
    )
    by_group = centred / (groups.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(
        group_advantages(scores.reshape(-1), 4, "grpo", "group"), by_group.reshape(-1), rtol=1e-5
    )
    by_batch = centred / (scores.astype(np.float64).std(ddof=1) + 1e-4)
    global_scaled = jax.pmap(
        lambda s: group_advantages(s, 4, "grpo", "batch", axis_name="data"), axis_name="data"
    )(scores)
    np.testing.assert_allclose(
        np.asarray(global_scaled).reshape(-1), by_batch.reshape(-1), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        group_advantages(scores.reshape(-1), 4, "grpo", "batch"), by_batch.reshape(-1), rtol=1e-5
    )
    with pytest.raises(ValueError, match="reward scaling"):
        group_advantages(scores.reshape(-1), 4, "grpo", "std")


def test_scale_rewards_follows_the_dr_grpo_paper_by_default():
    """auto: none with loss_type dr_grpo (Liu et al. 2025), group otherwise; grpo only."""
    from components.ppo import PPOConfig

    grpo = {"algorithm": "grpo", "group_size": 4}
    assert PPOConfig(**grpo).reward_scaling == "group"
    assert PPOConfig(**grpo, loss_type="dr_grpo").reward_scaling == "none"
    assert PPOConfig(**grpo, loss_type="dr_grpo", scale_rewards="group").reward_scaling == "group"
    assert PPOConfig(**grpo, scale_rewards="batch").reward_scaling == "batch"
    with pytest.raises(ValueError, match="scale_rewards: 'none' applies to algorithm grpo"):
        PPOConfig(algorithm="rloo", scale_rewards="none")


def test_missing_eos_penalty_survives_the_clip():
    """Past clip + penalty, a truncated response still scores the penalty below a finished
    one (clip first, then subtract); within the clip the two orders agree."""
    from components.ppo.rollout import ScoreNorm, normalize_scores

    norm = ScoreNorm(mean=0.0, std=1.0, missing_eos_penalty=1.0, clip=5.0)
    raw = jnp.array([9.0, 9.0, 2.0, 2.0, -9.0, -9.0])
    has_eos = jnp.array([True, False, True, False, True, False])
    scores = normalize_scores(raw, has_eos, norm)
    np.testing.assert_allclose(scores, [5.0, 4.0, 2.0, 1.0, -5.0, -6.0])


def test_quantile_scores_are_the_chance_of_beating_a_starting_sample():
    """score_norm quantile: √12 (F − ½), F the share of the starting policy's scores below
    (ties half); over the starting policy's own scores mean 0 and variance 1, whatever their
    scale; then the clip and the missing-EOS penalty as for z-scores."""
    from components.ppo.rollout import ScoreNorm, normalize_scores, quantile_scores

    table = (0.0, 1.0, 2.0, 3.0)
    raw = jnp.array([1.5, 10.0, -1.0, 1.0])
    expected = np.sqrt(12) * (np.array([2 / 4, 1.0, 0.0, 3 / 8]) - 0.5)
    np.testing.assert_allclose(quantile_scores(raw, table), expected, rtol=1e-6)
    starting = np.random.default_rng(0).lognormal(3.0, 2.0, 4096)  # skewed, large scale
    calibrated = np.asarray(quantile_scores(jnp.asarray(starting), tuple(sorted(starting))))
    assert abs(calibrated.mean()) < 1e-3 and calibrated.var() == pytest.approx(1.0, abs=1e-3)
    norm = ScoreNorm(mean=5.0, std=0.1, missing_eos_penalty=1.0, clip=1.5, quantiles=table)
    scores = normalize_scores(raw, jnp.array([True, False, True, True]), norm)
    np.testing.assert_allclose(scores, [0.0, 0.5, -1.5, expected[3]], rtol=1e-6)


def test_loss_aggregations_by_hand():
    """Two responses of 1 and 3 tokens (of 4), losses 4 and 1, 1, 1."""
    from components.ppo.losses import aggregate

    per_token = jnp.array([[4.0, 9.0, 9.0, 9.0], [1.0, 1.0, 1.0, 9.0]])
    mask = jnp.array([[1, 0, 0, 0], [1, 1, 1, 0]])
    assert float(aggregate(per_token, mask, "dapo")) == pytest.approx(7 / 4)
    assert float(aggregate(per_token, mask, "grpo")) == pytest.approx((4 + 1) / 2)
    assert float(aggregate(per_token, mask, "dr_grpo", max_len=4)) == pytest.approx(7 / 8)
    with pytest.raises(ValueError, match="loss_type"):
        aggregate(per_token, mask, "bnpo")
