"""PPO's defaults and controls that need no rollout: critic units, KL controller range, defaults.

Each of these failed before the "PPO that aligns" fixes: the critic started in the reward
model's raw units, the controller could move kl_coef by at most ×0.94–×1.07 over a demo run,
the entropy bonus equalled kl_coef, and init_kl_controller's own default target (6 nats per
sequence, TRL's) disagreed with the config's (per token).
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from components.core.model.artifact import create_model
from components.ppo import PPOConfig
from components.ppo.kl_control import init_kl_controller, raise_kl_coef, update_kl_controller
from components.ppo.score_norm import SCORE_NORM_KEY, saved_score_stats
from components.ppo.stage import fold_normalization


def test_folded_critic_outputs_normalized_scores() -> None:
    critic = create_model("tiny", 40, scalar_head=True, seed=3, max_seq_len=16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 40, (4, 9)), jnp.int32)
    mask = jnp.ones_like(tokens)
    raw = np.asarray(critic.scalar(critic(tokens, mask), mask))
    fold_normalization(critic, mean=0.21, std=9.2)
    folded = np.asarray(critic.scalar(critic(tokens, mask), mask))
    np.testing.assert_allclose(folded, (raw - 0.21) / 9.2, rtol=1e-5, atol=1e-6)


def test_adaptive_controller_can_move_kl_coef_by_e_cubed_over_a_run() -> None:
    config = PPOConfig()
    state = init_kl_controller(
        "adaptive", config.kl_coef, target=config.kl_target, horizon=config.kl_horizon_sequences
    )
    up = down = state
    for _ in range(config.iterations):
        up = update_kl_controller(up, 10 * config.kl_target, config.rollout_batch_size)
        down = update_kl_controller(down, 0.0, config.rollout_batch_size)
    # 1.08^50 and 0.92^50: the coefficient follows the KL over the run, not a crawl.
    assert float(up.kl_coef) / config.kl_coef > math.exp(3.0)
    assert float(down.kl_coef) / config.kl_coef < math.exp(-3.0)
    assert float(raise_kl_coef(state, 2.0).kl_coef) == pytest.approx(2 * config.kl_coef)


def test_defaults_let_the_kl_penalty_bind() -> None:
    config = PPOConfig()
    assert config.adaptive_kl and config.entropy_coef == 0.0
    assert config.kl_target <= config.kl_stop / 2  # the guard catches divergence only
    assert init_kl_controller("adaptive", 0.1).target == pytest.approx(config.kl_target)
    assert config.kl_horizon_sequences == config.iterations * config.rollout_batch_size / 20
    assert PPOConfig(kl_horizon=5000.0).kl_horizon_sequences == 5000.0
    # A short run: one iteration still moves kl_coef by at most 8% (4 iterations of 64 gave
    # a horizon of 12.8 sequences and a multiplier of 1 − 0.2 · 64 / 12.8 = 0 before).
    short = PPOConfig(iterations=4)
    state = init_kl_controller("adaptive", 0.2, horizon=short.kl_horizon_sequences)
    low = update_kl_controller(state, 0.0, short.rollout_batch_size)
    assert float(low.kl_coef) == pytest.approx(0.2 * 0.92)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"kl_stop_patience": 0}, "kl_stop_patience"),
        ({"restore_kl_factor": 0.5}, "restore_kl_factor"),
        ({"kl_horizon": -1.0}, "kl_horizon"),
        ({"kl_horizon": 10.0}, "kl_horizon"),
        ({"algorithm": "dpo"}, "algorithm"),
        ({"algorithm": "grpo", "group_size": 1}, "group_size"),
        ({"algorithm": "rloo", "rollout_batch_size": 64, "group_size": 3}, "group_size"),
    ],
)
def test_guard_and_controller_fields_are_checked(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PPOConfig(**overrides)


def test_auto_learning_rates_follow_the_starting_policy() -> None:
    config = PPOConfig()
    with pytest.raises(ValueError, match="resolved"):
        config.policy_optim()
    scratch, pretrained = config.resolved(pretrained=False), config.resolved(pretrained=True)
    assert (scratch.learning_rate, scratch.critic_learning_rate) == (2e-5, 1e-4)
    assert (pretrained.learning_rate, pretrained.critic_learning_rate) == (1e-6, 1e-5)
    assert pretrained.policy_optim().learning_rate == 1e-6
    # grpo and rloo draw a quarter of PPO's prompts per iteration: 3e-5 from scratch.
    for algorithm in ("grpo", "rloo"):
        group = PPOConfig(algorithm=algorithm)
        assert group.resolved(pretrained=False).learning_rate == 3e-5
        assert group.resolved(pretrained=True).learning_rate == 1e-6
    # A rate the user set wins over auto.
    assert PPOConfig(learning_rate=3e-6).resolved(pretrained=True).learning_rate == 3e-6


def test_score_statistics_come_from_the_checkpoint_or_are_computed_again(caplog) -> None:
    """A resume reads the statistics its checkpoint holds; none without a checkpoint, and a
    warning (then they are computed again) for one written before checkpoints held them or
    with another score_norm."""

    def checkpointer(extra: dict | None) -> SimpleNamespace:
        return SimpleNamespace(directory="ckpt", latest_extra_json=lambda: extra)

    saved = {SCORE_NORM_KEY: {"source": "policy", "mean": 0.125, "std": 3.0}}
    assert saved_score_stats(checkpointer(saved), "policy") == {
        "mean": 0.125, "std": 3.0, "quantiles": [],
    }  # fmt: skip
    # score_norm quantile reads the starting policy's scores back; without them, recomputes.
    scores = {"source": "quantile", "mean": 0.0, "std": 1.0, "quantiles": [-1.0, 0.5, 2.0]}
    assert saved_score_stats(checkpointer({SCORE_NORM_KEY: scores}), "quantile")["quantiles"] == [
        -1.0, 0.5, 2.0,
    ]  # fmt: skip
    no_scores = {SCORE_NORM_KEY: {**scores, "quantiles": []}}
    assert saved_score_stats(checkpointer(no_scores), "quantile") is None
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert saved_score_stats(checkpointer(None), "policy") is None
        assert not caplog.records
        assert saved_score_stats(checkpointer({"kl_controller": {}}), "policy") is None
        assert "written before checkpoints held them" in caplog.text
        assert saved_score_stats(checkpointer(saved), "data") is None
        assert "its: policy" in caplog.text
