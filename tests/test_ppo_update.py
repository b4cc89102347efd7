"""PPO update phase: 8 devices equal 1 on the same global batch; non-finite steps are skipped;
the first step's log-probs equal the rollout's at any temperature; the guard's rules.

Tiny model, synthetic rollout batch; the 8-device and 1-device updates compile once each.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from components.core.model.artifact import create_model
from components.core.model.scoring import halved_width, response_logprobs, trim_padding
from components.core.training import parallel
from components.ppo import PPOConfig
from components.ppo.guard import KL_METRIC, KLGuard
from components.ppo.rollout import AXIS, Models
from components.ppo.update import (
    PPOState,
    make_ema_update,
    make_update,
    shuffled_minibatches,
)

VOCAB, PROMPT, RESPONSE, BATCH = 40, 6, 5, 16
# The update's results before its speed-ups (metrics and per-tensor sums of each parameter's
# change), captured with ALIGNPIPE_WRITE_GOLDEN=1: the faster update must compute the same.
GOLDEN = Path(__file__).parent / "fixtures" / "ppo_update_golden.json"
CONFIG = PPOConfig(
    rollout_batch_size=BATCH,
    minibatches=2,
    ppo_epochs=2,
    prompt_len=PROMPT,
    max_new_tokens=RESPONSE,
    learning_rate=3e-3,
    critic_learning_rate=3e-3,
    warmup_steps=0,
)


def _networks():
    policy = create_model("tiny", VOCAB, scalar_head=False, seed=1, max_seq_len=32)
    critic = create_model("tiny", VOCAB, scalar_head=True, seed=2, max_seq_len=32)
    policy_graph, policy_params = nnx.split(policy, nnx.Param)
    critic_graph, critic_params = nnx.split(critic, nnx.Param)
    models = Models(policy_graph, critic_graph, critic_graph)
    return models, jax.device_get(policy_params), jax.device_get(critic_params)


def _batch(models: Models, policy_params, seed: int = 0) -> dict[str, np.ndarray]:
    """A rollout-shaped batch: left-padded prompts, responses ending early, random targets."""
    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(1, PROMPT + 1, BATCH)
    response_lengths = rng.integers(1, RESPONSE + 1, BATCH)
    prompt_mask = (np.arange(PROMPT)[None] >= PROMPT - prompt_lengths[:, None]).astype(np.int32)
    response_mask = (np.arange(RESPONSE)[None] < response_lengths[:, None]).astype(np.int32)
    batch = {
        "prompt_tokens": rng.integers(3, VOCAB, (BATCH, PROMPT)).astype(np.int32) * prompt_mask,
        "prompt_mask": prompt_mask,
        "response_tokens": rng.integers(3, VOCAB, (BATCH, RESPONSE)).astype(np.int32),
        "response_mask": response_mask,
    }
    old = np.asarray(response_logprobs(models.policy, policy_params, batch))
    # Old log-probs a little off the current policy, so ratios and clipping are exercised.
    noise = rng.normal(0.0, 0.3, old.shape)
    batch.update(
        logprobs=((old + noise) * response_mask).astype(np.float32),
        values=(rng.normal(size=old.shape) * response_mask).astype(np.float32),
        advantages=(rng.normal(size=old.shape) * response_mask).astype(np.float32),
        returns=(rng.normal(size=old.shape) * response_mask).astype(np.float32),
    )
    return batch


@pytest.fixture(scope="module")
def setup():
    models, policy_params, critic_params = _networks()
    return models, policy_params, critic_params, _batch(models, policy_params)


@pytest.fixture(scope="module")
def update_8(setup):
    return make_update(setup[0], CONFIG)


def _run(update, state: PPOState, batch: dict, devices=None, sharded: bool = False, kl_coef=0.1):
    placed = parallel.place(state, sharded=sharded, devices=devices)
    scale, kl_coef = np.float32(1.0), np.float32(kl_coef)
    new_state, metrics = update(
        placed, parallel.shard_batch(batch, devices), jax.random.PRNGKey(7), scale, kl_coef
    )
    return parallel.unreplicate(new_state), parallel.unreplicate(metrics)


def _fingerprint(before: PPOState, after: PPOState, metrics: dict) -> dict[str, float]:
    """The metrics, and the sum and absolute sum of every parameter tensor's change."""
    figures = {f"metric {name}": float(value) for name, value in metrics.items()}
    changes = jax.tree_util.tree_flatten_with_path(
        jax.tree.map(lambda a, b: np.asarray(b, np.float64) - a, before, after)
    )[0]
    for path, change in changes:
        name = jax.tree_util.keystr(path)
        if "opt_state" not in name:
            figures[f"{name} sum"] = float(change.sum())
            figures[f"{name} abs"] = float(np.abs(change).sum())
    return figures


def _check_golden(case: str, before: PPOState, after: PPOState, metrics: dict) -> None:
    """``case``'s figures equal those recorded before the update was made faster."""
    figures = _fingerprint(before, after, metrics)
    if os.environ.get("ALIGNPIPE_WRITE_GOLDEN"):
        recorded = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        GOLDEN.write_text(json.dumps({**recorded, case: figures}, indent=1, sort_keys=True))
    expected = json.loads(GOLDEN.read_text())[case]
    assert sorted(figures) == sorted(expected)
    for name, value in expected.items():
        # Summation order differs between CPUs (Adam magnifies it where a gradient is ~0):
        # a change's sum is held to 1e-5 of its absolute sum. A changed formula moves more.
        scale = expected.get(name.replace(" sum", " abs"), 0.0) if name.endswith(" sum") else 0
        assert figures[name] == pytest.approx(value, rel=2e-4, abs=2e-5 + 1e-5 * scale), name


def _shuffle(rows: np.ndarray, key: int, count: int, devices: int) -> np.ndarray:
    """Global minibatches [count, rows / count] of ``rows`` laid out over ``devices``."""
    per_device = rows.reshape(devices, -1)
    split = jax.pmap(
        lambda x: shuffled_minibatches({"x": x}, jax.random.PRNGKey(key), count)["x"],
        axis_name=AXIS,
        devices=jax.local_devices()[:devices],
    )(per_device)
    return np.concatenate(list(np.asarray(split)), axis=1)  # devices side by side


def test_shuffled_minibatches_redraw_each_epoch_and_ignore_the_layout() -> None:
    rows = np.arange(32)
    one, eight = _shuffle(rows, 0, 2, 1), _shuffle(rows, 0, 2, 8)
    # Every row once; each block of 2 consecutive rows gives one row to each minibatch.
    np.testing.assert_array_equal(np.sort(one.reshape(-1)), rows)
    np.testing.assert_array_equal(np.sort(one // 2, axis=1), [np.arange(16)] * 2)
    # The same global minibatches on 1 device and on 8 (row order inside aside).
    np.testing.assert_array_equal(np.sort(one, axis=1), np.sort(eight, axis=1))
    # Another epoch's key draws other minibatches (TRL reshuffles every epoch too).
    other = _shuffle(rows, 1, 2, 1)
    assert not np.array_equal(np.sort(one, axis=1), np.sort(other, axis=1))


def test_eight_devices_equal_one_device(setup, update_8) -> None:
    models, policy_params, critic_params, batch = setup
    assert jax.local_device_count() == 8
    state = PPOState.create(policy_params, critic_params, CONFIG)
    one = [jax.local_devices()[0]]
    new_8, metrics_8 = _run(update_8, state, batch)
    new_1, metrics_1 = _run(make_update(models, CONFIG, devices=one), state, batch, one)
    assert int(new_8.policy.step) == CONFIG.ppo_epochs * CONFIG.minibatches
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), new_8, state))
    assert max(float(m) for m in moved) > 1e-4  # the update really changed the parameters
    # atol 2e-5: Adam divides by sqrt(v), so where a gradient is ~0 the summation order of
    # 8 devices vs 1 shows (1 of 4096 weights off by 9.6e-6 with the epoch-drawn minibatches).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), new_8, new_1)
    for name in ("loss/policy", "loss/value", "policy/clipfrac", "policy/entropy", "val/clipfrac"):
        np.testing.assert_allclose(metrics_8[name], metrics_1[name], rtol=1e-4, atol=1e-6)
    assert metrics_8["skipped"] == 0.0
    _check_golden("ppo", state, new_8, metrics_8)


def test_padding_no_row_uses_is_cut_and_changes_nothing(setup, update_8) -> None:
    """Prompts padded on the left and responses on the right past what any row uses: the
    update cuts the columns (in halves) and computes what it computes on the unpadded batch,
    reusing its compiled program. The cut columns hold nan: they are never read."""
    _, policy_params, critic_params, batch = setup
    state = PPOState.create(policy_params, critic_params, CONFIG)
    padded = {}
    for name, value in batch.items():
        side = [(0, 0), (PROMPT, 0)] if name.startswith("prompt_") else [(0, 0), (0, RESPONSE)]
        fill = np.nan if value.dtype == np.float32 else 0
        padded[name] = np.pad(value, side, constant_values=fill)
    cut = trim_padding(padded, ["response_mask", "logprobs"])
    assert cut["prompt_tokens"].shape[-1] == PROMPT and cut["logprobs"].shape[-1] == RESPONSE
    assert cut["values"].shape[-1] == 2 * RESPONSE  # only the named response fields
    new_state, metrics = _run(update_8, state, padded)
    _check_golden("ppo", state, new_state, metrics)


def test_halved_width_keeps_few_shapes() -> None:
    assert [halved_width(32, used) for used in (1, 8, 9, 16, 17, 32)] == [1, 8, 16, 16, 32, 32]
    assert halved_width(12, 6) == 6 and halved_width(12, 7) == 12 and halved_width(5, 1) == 5
    assert halved_width(8, 0) == 1


def test_sharded_state_update_equals_replicated(setup, update_8) -> None:
    """fsdp: the policy and critic in chunks over 8 devices take the same steps."""
    _, policy_params, critic_params, batch = setup
    state = PPOState.create(policy_params, critic_params, CONFIG)
    replicated, metrics_r = _run(update_8, state, batch)
    sharded, metrics_s = _run(update_8, state, batch, sharded=True)
    assert int(sharded.critic.step) == CONFIG.ppo_epochs * CONFIG.minibatches
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6), sharded, replicated
    )
    for name in ("loss/policy", "loss/value", "policy/grad_norm", "val/grad_norm"):
        np.testing.assert_allclose(metrics_s[name], metrics_r[name], rtol=1e-4, atol=1e-6)


def test_non_finite_minibatch_is_skipped(setup, update_8) -> None:
    _, policy_params, critic_params, batch = setup
    state = PPOState.create(policy_params, critic_params, CONFIG)
    poisoned = dict(batch, advantages=np.full_like(batch["advantages"], np.nan))
    new_state, metrics = _run(update_8, state, poisoned)
    assert metrics["skipped"] == CONFIG.ppo_epochs * CONFIG.minibatches
    jax.tree.map(np.testing.assert_array_equal, new_state.policy.params, state.policy.params)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"rollout_batch_size": 10, "minibatches": 4}, "rollout_batch_size"),
        ({"kl_stop": 0.0}, "kl_stop"),
        ({"restore_lr_factor": 1.5}, "restore_lr_factor"),
        ({"ref_ema_decay": 1.0}, "ref_ema_decay"),
        ({"temperature": 0.0}, "temperature"),
        ({"ppo_epochs": 0}, "ppo_epochs"),
        ({"loss_type": "grpo"}, "loss_type"),  # grpo only; ppo is the default algorithm
    ],
)
def test_config_names_the_bad_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PPOConfig(**overrides)


def test_ema_reference_moves_toward_the_policy() -> None:
    reference = parallel.replicate({"w": np.zeros(3, np.float32)})
    policy = parallel.replicate({"w": np.ones(3, np.float32)})
    updated = parallel.unreplicate(make_ema_update(0.9)(reference, policy))
    np.testing.assert_allclose(updated["w"], 0.1, rtol=1e-6)


def test_guard_trips_after_patience_restores_then_stops_and_persists(tmp_path) -> None:
    guard = KLGuard(
        kl_stop=0.05, max_restores=1, lr_factor=0.5, kl_factor=2.0, patience=2,
        work_dir=str(tmp_path),
    )  # fmt: skip
    ok = guard.judge_rollout({KL_METRIC: 0.01})
    assert ok.good and ok.trip is None
    # One noisy batch over kl_stop: not kept, not a trip; a good one in between resets.
    first = guard.judge_rollout({KL_METRIC: 0.2})
    assert not first.good and first.trip is None
    assert guard.judge_rollout({KL_METRIC: 0.01}).trip is None
    assert guard.judge_rollout({KL_METRIC: 0.2}).trip is None
    assert "2 rollout(s) in a row" in guard.judge_rollout({KL_METRIC: 0.2}).trip
    # The final check and non-finite figures trip at once.
    assert "final check" in guard.judge_rollout({KL_METRIC: 0.2}, final=True).trip
    assert "non-finite" in guard.judge_rollout({KL_METRIC: float("nan")}).trip
    assert "non-finite" in guard.update_trip({"skipped": 2.0, "loss/total": 1.0})
    assert not guard.exhausted
    guard.record(
        iteration=3, reason="test", restored_to=2, policy_updates=2, stopped=False, kl_coef=0.4
    )
    assert guard.exhausted and guard.state.lr_scale == 0.5 and guard.state.over == 0
    again = KLGuard(kl_stop=0.05, max_restores=1, lr_factor=0.5, work_dir=str(tmp_path))
    assert again.state.restores == 1 and again.state.events[0]["restored_to"] == 2
    assert again.state.events[0]["kl_coef"] == 0.4


def test_first_step_log_probs_equal_the_rollouts_at_temperature(setup) -> None:
    """At T = 0.7 the update scores tokens as the rollout did: ratio 1 before any step.

    Before this, the update's log-probs were untempered while the sampler drew from
    softmax(logits / T): the first ratio was exp(log p_1 − log p_T), far from 1.
    """
    models, policy_params, critic_params, batch = setup
    # With an entropy bonus: its gradient flows only when entropy_coef > 0.
    config = dataclasses.replace(CONFIG, temperature=0.7, entropy_coef=0.05)
    tempered = np.asarray(response_logprobs(models.policy, policy_params, batch, 0.7))
    untempered = np.asarray(response_logprobs(models.policy, policy_params, batch))
    real = batch["response_mask"] != 0
    assert np.abs(tempered - untempered)[real].max() > 0.05  # the temperature matters here
    exact = dict(batch, logprobs=(tempered * batch["response_mask"]).astype(np.float32))
    state = PPOState.create(policy_params, critic_params, config)
    tempered_state, metrics = _run(make_update(models, config), state, exact)
    assert metrics["policy/logprob_mismatch"] < 1e-5
    _check_golden("ppo temperature 0.7 entropy 0.05", state, tempered_state, metrics)
    _, untempered_metrics = _run(make_update(models, CONFIG), state, exact)
    assert untempered_metrics["policy/logprob_mismatch"] > 0.05


def _group_case(setup, **overrides):
    """(models, config, state, batch) of a critic-free update: groups of 2, no values or
    returns, the reference's log-probs half the rollout's."""
    models, policy_params, _, batch = setup
    config = dataclasses.replace(CONFIG, group_size=2, **overrides)
    group_batch = {k: v for k, v in batch.items() if k not in ("values", "returns")}
    group_batch["ref_logprobs"] = (batch["logprobs"] * 0.5).astype(np.float32)
    return models, config, PPOState.create(policy_params, None, config), group_batch


def _on_eight_and_one(models, config, state, batch):
    """((state, metrics) of the update on 8 devices, the state of the same on 1)."""
    one = [jax.local_devices()[0]]
    eight = _run(make_update(models, config), state, batch)
    return eight, _run(make_update(models, config, devices=one), state, batch, one)[0]


@pytest.mark.parametrize("algorithm", ["grpo", pytest.param("rloo", marks=pytest.mark.slow)])
def test_group_update_without_critic_eight_devices_equal_one(setup, algorithm) -> None:
    """grpo/rloo: the policy alone is updated; grpo's k3 KL term in the loss moves it too."""
    models, config, state, group_batch = _group_case(setup, algorithm=algorithm)
    (new_8, metrics_8), new_1 = _on_eight_and_one(models, config, state, group_batch)
    assert new_8.critic is None and "val/grad_norm" not in metrics_8
    _check_golden(algorithm, state, new_8, metrics_8)
    assert int(new_8.policy.step) == config.ppo_epochs * config.minibatches
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), new_8, new_1)
    if algorithm == "grpo":
        assert metrics_8["kl"] > 0
        no_kl, _ = _run(make_update(models, config), state, group_batch, kl_coef=0.0)
        moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), new_8.policy, no_kl.policy)
        assert max(jax.tree.leaves(moved)) > 1e-6  # the KL term changes the step


# dr_grpo's aggregation (its formula: test_ppo_advantages.py) over 8 devices: the slow tier; grpo's
# per-response mean, the one that could go wrong across devices, in make test with the entropy
# bonus (below); alone, and against dapo's step, in the slow tier too.
DR_GRPO = pytest.param("dr_grpo", marks=pytest.mark.slow)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_grpo_loss_types_eight_devices_equal_one(setup, loss_type) -> None:
    """Per-response aggregations (TRL's grpo, dr_grpo) stay device-count independent, and
    move the policy otherwise than the token mean (dapo) does."""
    models, config, state, group_batch = _group_case(setup, algorithm="grpo", loss_type=loss_type)
    (new_8, _), new_1 = _on_eight_and_one(models, config, state, group_batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), new_8, new_1)
    dapo = dataclasses.replace(config, loss_type="dapo")
    by_token, _ = _run(make_update(models, dapo), state, group_batch)
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), new_8.policy, by_token.policy)
    assert max(jax.tree.leaves(moved)) > 1e-6


@pytest.mark.parametrize("loss_type", ["grpo", DR_GRPO])
def test_entropy_bonus_is_a_token_mean_over_all_devices(setup, loss_type) -> None:
    """With a per-response loss_type the entropy bonus is still Σ entropy / Σ tokens over the
    global minibatch, not the mean of each device's mean: 8 devices holding unequal token
    counts take the step 1 device takes on the same batch."""
    models, config, state, group_batch = _group_case(
        setup, algorithm="grpo", loss_type=loss_type, entropy_coef=0.5
    )
    per_device = group_batch["response_mask"].reshape(8, -1).sum(axis=1)
    assert len(set(per_device.tolist())) > 1  # devices hold unequal token counts
    (new_8, metrics_8), new_1 = _on_eight_and_one(models, config, state, group_batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5), new_8, new_1)
    no_bonus = dataclasses.replace(config, entropy_coef=0.0)
    without, _ = _run(make_update(models, no_bonus), state, group_batch)
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), new_8.policy, without.policy)
    assert max(jax.tree.leaves(moved)) > 1e-4  # the bonus really changes the step
