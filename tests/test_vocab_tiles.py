"""Logits a tile at a time give what the whole logits give: log-probs, entropy, exact KL and
the reference's log-probs, and their gradients, within 1e-6 (fp32), for every path that
reduces logits (PPO, GRPO and RLOO's update and rollout scoring, SFT's and DPO's token
log-probs, evaluation's log-probs), tied and untied heads, soft-capped and tempered.

Tiles of 3 positions over 16 × 5 response positions: 27 tiles, the last one padded. "Within
1e-6" is of each tensor's scale: a gradient of the output head sums over every position,
and the tiles add them up in another order than one matmul does (float32 rounding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from components.core.model import vocab_tiles
from components.core.model.artifact import create_model
from components.core.model.config import ModelConfig
from components.core.model.scoring import response_stats
from components.core.training import parallel
from components.ppo import PPOConfig
from components.ppo.rollout import Models
from components.ppo.update import PPOState, make_update

VOCAB, PROMPT, RESPONSE, BATCH = 40, 6, 5, 16
TILE = 3 * VOCAB  # 3 positions a tile
ATOL = 1e-6


def _batch(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    prompt_mask = (np.arange(PROMPT)[None] >= rng.integers(0, PROMPT, (BATCH, 1))).astype(np.int32)
    response_mask = np.arange(RESPONSE)[None] < rng.integers(1, RESPONSE + 1, (BATCH, 1))
    return {
        "prompt_tokens": jnp.asarray(rng.integers(3, VOCAB, (BATCH, PROMPT)) * prompt_mask),
        "prompt_mask": jnp.asarray(prompt_mask),
        "response_tokens": jnp.asarray(rng.integers(3, VOCAB, (BATCH, RESPONSE)), jnp.int32),
        "response_mask": jnp.asarray(response_mask.astype(np.int32)),
    }


def _networks(tile: int, **overrides):
    """Policy and reference (same graph, other weights) with logits tiles of ``tile``."""
    make = dict(scalar_head=False, max_seq_len=32, logits_tile=tile, **overrides)
    policy = create_model("tiny", VOCAB, seed=1, **make)
    reference = create_model("tiny", VOCAB, seed=2, **make)
    graph, params = nnx.split(policy, nnx.Param)
    return graph, params, nnx.split(reference, nnx.Param)[1]


def _close(a, b) -> None:
    """Within 1e-6 of each tensor's scale (its largest magnitude, at least 1): a gradient
    sums over every position, and tiles add them up in another order than one matmul."""

    def close(x, y):
        scale = max(1.0, float(np.abs(np.asarray(y)).max()))
        np.testing.assert_allclose(x, y, atol=ATOL * scale, rtol=0)

    jax.tree.map(close, a, b)


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({}, id="tied"),
        pytest.param(
            {"tie_embeddings": False, "final_logit_softcap": 3.0},
            id="untied-capped",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_rollout_and_update_statistics_and_gradients_equal_the_whole_logits(overrides):
    batch, mask = _batch(), _batch()["response_mask"]
    results = []
    for tile in (0, TILE):
        graph, params, reference = _networks(tile, **overrides)

        def loss(p, graph=graph, reference=reference):
            stats = response_stats(graph, p, batch, 0.7, entropy=True, reference=reference)
            terms = (stats.logprobs, stats.entropy, stats.kl, stats.ref_logprobs)
            return sum(jnp.sum(t * mask * (i + 1)) for i, t in enumerate(terms)), stats

        (value, stats), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        results.append((value, [np.asarray(s) * np.asarray(mask) for s in stats], grads))
    (whole_value, whole_stats, whole_grads), (tiled_value, tiled_stats, tiled_grads) = results
    assert float(jnp.abs(whole_value)) > 1.0
    np.testing.assert_allclose(tiled_value, whole_value, rtol=1e-6)
    _close(tiled_stats, whole_stats)
    _close(tiled_grads, whole_grads)


def test_token_logprobs_of_sft_and_dpo_equal_the_whole_logits():
    batch = _batch(1)
    tokens = jnp.concatenate([batch["prompt_tokens"], batch["response_tokens"]], axis=1)
    mask = jnp.concatenate([batch["prompt_mask"], batch["response_mask"]], axis=1)
    results = []
    for tile in (0, TILE):
        graph, params, _ = _networks(tile)

        def loss(p, graph=graph):
            return jnp.sum(nnx.merge(graph, p).token_logprobs(tokens, mask) * mask[:, 1:])

        results.append(jax.jit(jax.value_and_grad(loss))(params))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-6)
    _close(results[1][1], results[0][1])


def test_tiles_cover_the_positions_and_the_demo_is_not_tiled():
    assert vocab_tiles.positions_per_tile(2**24, 151_936) == 110  # a 64 MiB fp32 tile
    assert vocab_tiles.positions_per_tile(0, 151_936) == 0  # whole
    assert vocab_tiles.positions_per_tile(10, 151_936) == 1
    head = vocab_tiles.Head(jnp.eye(4, dtype=jnp.float32), True, None)
    hidden = jnp.asarray(np.random.default_rng(0).normal(size=(3, 7, 4)), jnp.float32)
    targets = jnp.asarray(np.random.default_rng(1).integers(0, 4, (3, 7)))
    whole = vocab_tiles.token_stats(head, hidden, targets, tile=0, entropy=True)
    for tile in (4, 8, 20, 84, 10**6):  # 1, 2, 5 and 21 positions a tile; one tile
        tiled = vocab_tiles.token_stats(head, hidden, targets, tile=tile, entropy=True)
        _close(tiled.logprobs, whole.logprobs)
        _close(tiled.entropy, whole.entropy)


@pytest.mark.parametrize("algorithm", ["ppo", pytest.param("grpo", marks=pytest.mark.slow)])
def test_an_update_with_tiled_logits_equals_the_whole(algorithm):
    """One update (two epochs of two minibatches) on 8 devices: same metrics and weights."""
    config = PPOConfig(
        rollout_batch_size=BATCH, minibatches=2, ppo_epochs=2, prompt_len=PROMPT,
        max_new_tokens=RESPONSE, learning_rate=3e-3, critic_learning_rate=3e-3,
        warmup_steps=0, entropy_coef=0.01, algorithm=algorithm,
        group_size=2 if algorithm == "grpo" else 1,
    )  # fmt: skip
    batch = {k: np.asarray(v) for k, v in _batch(2).items()}
    rng = np.random.default_rng(3)
    mask = batch["response_mask"].astype(np.float32)
    for name in ("logprobs", "values", "advantages", "returns", "ref_logprobs"):
        batch[name] = (rng.normal(size=mask.shape) * mask - 2.0 * mask).astype(np.float32)
    if algorithm == "grpo":
        batch = {k: v for k, v in batch.items() if k not in ("values", "returns")}
    outcomes = []
    for tile in (0, TILE):
        graph, params, _ = _networks(tile)
        critic = create_model("tiny", VOCAB, scalar_head=True, seed=3, max_seq_len=32)
        critic_graph, critic_params = nnx.split(critic, nnx.Param)
        models = Models(graph, critic_graph, critic_graph)
        state = PPOState.create(params, critic_params if algorithm == "ppo" else None, config)
        update = make_update(models, config)
        new_state, metrics = update(
            parallel.place(state), parallel.shard_batch(batch), jax.random.PRNGKey(7),
            np.float32(1.0), np.float32(0.1),
        )  # fmt: skip
        outcomes.append(
            (parallel.unreplicate(new_state).policy.params, parallel.unreplicate(metrics))
        )
    (whole_params, whole_metrics), (tiled_params, tiled_metrics) = outcomes
    for name, value in whole_metrics.items():
        np.testing.assert_allclose(tiled_metrics[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    # Adam divides by the gradient's root mean square: where it is ~0 rounding is magnified.
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5), tiled_params,
        whole_params,
    )  # fmt: skip


def test_the_tile_is_a_model_setting_checked_and_saved():
    config = create_model("tiny", VOCAB, scalar_head=False, seed=0, logits_tile=TILE).config
    assert ModelConfig.from_dict(config.to_dict()) == config and config.logits_tile == TILE
    with pytest.raises(ValueError, match="logits_tile"):
        dataclasses.replace(config, logits_tile=-1)
