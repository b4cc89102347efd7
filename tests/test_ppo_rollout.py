"""The rollout's KL measure (the exact KL of each position's next-token distributions), and
the KL controller acting on the rollout it measured.

The KL controller steers and the guard watches ``objective/kl_per_token``. It is the KL of
the policy's and the reference's whole next-token distributions at every sampled position
(losses.exact_kl), not a one-token estimator: on the demo the sampled token's noise (k3's)
had the controller chasing it. Tiny networks on 8 devices, checked against numpy.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from components.core.model.artifact import create_model
from components.core.model.scoring import response_logits
from components.core.training import parallel
from components.ppo import PPOConfig, losses
from components.ppo.kl_control import init_kl_controller, update_kl_controller
from components.ppo.rollout import Models, RolloutParams, ScoreNorm, TokenIds, make_rollout

VOCAB, PROMPT, RESPONSE, BATCH = 40, 6, 5, 32


def _kl_by_hand(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    p = np.exp(p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True))
    log_q = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    log_p = np.log(p)
    return np.sum(p * (log_p - log_q), axis=-1)


def test_exact_kl_of_two_categoricals_by_hand() -> None:
    p, q = np.array([0.7, 0.2, 0.1]), np.array([0.4, 0.4, 0.2])
    # Logits up to a constant: the KL does not see it.
    kl = losses.exact_kl(np.log(p) + 3.0, np.log(q) - 1.0)
    assert float(kl) == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-6)
    assert float(losses.exact_kl(np.log(p), np.log(p))) == pytest.approx(0.0, abs=1e-7)
    # A token the policy never gives mass adds nothing, even where the reference gives none.
    masked = losses.exact_kl(np.array([0.0, 0.0, -np.inf]), np.array([0.0, 1.0, -np.inf]))
    assert np.isfinite(float(masked))
    expected = np.log(0.5) - np.log(np.exp(0.0) / (1 + np.e)) / 2 - np.log(np.e / (1 + np.e)) / 2
    assert float(masked) == pytest.approx(expected, rel=1e-6)


def test_rollout_kl_per_token_is_the_exact_kl_of_its_samples() -> None:
    policy = create_model("tiny", VOCAB, scalar_head=False, seed=1, max_seq_len=32)
    critic = create_model("tiny", VOCAB, scalar_head=True, seed=2, max_seq_len=32)
    (graph, policy_params), (critic_graph, critic_params) = (
        nnx.split(policy, nnx.Param),
        nnx.split(critic, nnx.Param),
    )
    noise = jax.random.split(jax.random.PRNGKey(3), len(jax.tree.leaves(policy_params)))
    leaves, tree = jax.tree.flatten(policy_params)
    # A reference a little away from the policy: a KL of a few hundredths per token.
    reference_params = jax.tree.unflatten(
        tree, [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, noise, strict=True)]
    )
    config = PPOConfig(
        rollout_batch_size=BATCH, prompt_len=PROMPT, max_new_tokens=RESPONSE, temperature=0.8
    )
    rollout = make_rollout(
        Models(graph, critic_graph, critic_graph), config, TokenIds(1, 0), ScoreNorm(0, 1, 0, 0)
    )
    rng = np.random.default_rng(0)
    prompts = {
        "prompt_tokens": rng.integers(3, VOCAB, (BATCH, PROMPT)).astype(np.int32),
        "prompt_mask": np.ones((BATCH, PROMPT), np.int32),
    }
    trees = (policy_params, reference_params, critic_params, critic_params)
    params = RolloutParams(*(parallel.replicate(t) for t in trees))
    before = init_kl_controller("pid", 0.5, target=0.02)
    batch, metrics, after = rollout(
        params, parallel.shard_batch(prompts), jax.random.PRNGKey(0), before
    )
    batch = {k: np.asarray(v).reshape(BATCH, *v.shape[2:]) for k, v in batch.items()}
    metrics, after = parallel.unreplicate(metrics), parallel.unreplicate(after)

    def logits(p):
        return np.asarray(response_logits(graph, p, batch, config.temperature), np.float64)

    per_position = _kl_by_hand(logits(policy_params), logits(reference_params))
    real = batch["response_mask"] != 0
    expected = per_position[real].mean()
    assert 0.005 < expected < 0.5
    assert float(metrics["objective/kl_per_token"]) == pytest.approx(expected, rel=1e-4)
    # The controller observed this rollout's KL, and its new coefficient weighs this
    # rollout's penalty (TRL's would weigh it with the coefficient before: 0.5).
    observed = update_kl_controller(before, metrics["objective/kl_per_token"], BATCH)
    assert float(after.kl_coef) == pytest.approx(float(observed.kl_coef), rel=1e-5)
    assert abs(float(after.kl_coef) - 0.5) > 0.05
    penalty = -float(after.kl_coef) * float(metrics["objective/kl"])
    assert float(metrics["objective/non_score_reward"]) == pytest.approx(penalty, rel=1e-5)
