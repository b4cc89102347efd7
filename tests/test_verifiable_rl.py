"""Reward functions in the RL stage (8 CPU devices, the built-in reasoning task): GRPO with the
exact-match function and no reward model raises the reward; a function's None, weights and
metrics under TRL's names; a broken or slow function fails the stage in the first rollout,
naming it; ppo's critic starts from the policy when there is no reward model; and the
scores and advantages of unscorable responses."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from components.core.rewards.scoring import RewardFunctionError, weighted_total
from components.core.training.metrics import read_metrics
from components.ppo import PPOConfig, run
from components.ppo.rollout import ScoreNorm, _fill_unscorable, combine_scores
from tests import verifiable_task

pytestmark = pytest.mark.slow

USER_FUNCTIONS = """
import os
import time


def short(prompts, completions, completion_ids, max_completion_length, answer, **kwargs):
    assert len(answer) == len(completions) and max_completion_length == 6
    return [1.0 - len(ids) / max_completion_length for ids in completion_ids]


def only_even(prompts, completions, answer, **kwargs):
    # TRL's multi-task convention: None where this function does not judge.
    return [None if int(a) % 2 else float(a in c) for c, a in zip(completions, answer)]


def broken_on_seven(prompts, completions, **kwargs):
    if any("7" in p for p in prompts):
        raise KeyError("no rule for seven")
    return [0.0] * len(completions)


CALLS = []


def breaks_on_fourth_rollout(prompts, completions, answer, **kwargs):
    CALLS.append(1)  # once per rollout: this module is loaded once per stage run
    if len(CALLS) == 4 and os.environ.get("BREAK_GRADER"):
        raise RuntimeError("the grader's service went away")
    return [float(a in c) for c, a in zip(completions, answer)]


def slow(prompts, completions, **kwargs):
    time.sleep(60)
    return [0.0] * len(completions)
"""
GRPO = dict(
    algorithm="grpo", group_size=8, rollout_batch_size=128, minibatches=2,
    max_new_tokens=6, missing_eos_penalty=0.0, save_every=1000,
    # A verifiable reward's usual setting (TRL's GRPO default beta 0, DAPO): no KL penalty.
    adaptive_kl=False, kl_coef=0.0, kl_stop=50.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("verifiable")
    paths = verifiable_task.build(root)
    paths["functions"] = str(root / "my_rewards.py")
    (root / "my_rewards.py").write_text(USER_FUNCTIONS)
    return paths


def _run(task, output, **overrides) -> dict[str, float]:
    config = PPOConfig(**{**GRPO, **overrides})
    return run(config, task["prompts"], task["sft"], "", str(output))


def _curve(output, name: str) -> np.ndarray:
    return np.array([row[name] for row in read_metrics(str(output)) if name in row])


def test_grpo_with_exact_match_alone_raises_the_reward(task, tmp_path) -> None:
    _run(task, tmp_path, iterations=150, learning_rate=3e-4,
         reward_functions="builtin/exact-match")  # fmt: skip
    exact = _curve(tmp_path, "rewards/exact_match/mean")
    assert len(exact) == 150
    first, last = exact[:20].mean(), exact[-20:].mean()
    assert last > first + 0.1, (first, last)
    # Host scoring is a small share of each rollout (the budget: 15%).
    share = (
        _curve(tmp_path, "time/reward_functions_s").sum() / _curve(tmp_path, "time/rollout_s").sum()
    )
    assert share < 0.15, share


def test_weights_none_and_columns_reach_the_functions(task, tmp_path) -> None:
    functions = f"builtin/exact-match,{task['functions']}:short,{task['functions']}:only_even"
    _run(task, tmp_path, iterations=2, reward_functions=functions, reward_weights="1,0.5,2")
    row = [r for r in read_metrics(str(tmp_path)) if "reward" in r][0]
    for name in ("exact_match", "short", "only_even"):
        assert f"rewards/{name}/mean" in row and f"rewards/{name}/std" in row
    # Every response is judged by exact-match, so none is unscorable; only_even skips odd
    # answers, so its mean is over fewer responses than the others'.
    assert row["rewards/unscorable_fraction"] == 0.0
    total = (
        row["rewards/exact_match/mean"] + 0.5 * row["rewards/short/mean"]
    )  # only_even judged a subset: its share of the total differs from its own mean
    assert row["reward"] >= total - 1e-6
    assert 0.0 < row["rewards/short/mean"] < 1.0


def test_a_broken_function_fails_the_first_rollout_naming_it(task, tmp_path) -> None:
    with pytest.raises(RewardFunctionError, match=r"'broken_on_seven'.*raised on prompt") as err:
        _run(task, tmp_path, iterations=3, reward_functions=f"{task['functions']}:broken_on_seven")
    assert "KeyError: 'no rule for seven'" in str(err.value)
    assert "7" in str(err.value).split("raised on prompt")[1].splitlines()[0]
    assert not _curve(tmp_path, "reward").size  # no rollout was logged


def test_a_function_failing_mid_run_keeps_the_checkpoint_and_a_rerun_resumes(
    task, tmp_path, monkeypatch
) -> None:
    spec = f"{task['functions']}:breaks_on_fourth_rollout"
    monkeypatch.setenv("BREAK_GRADER", "1")
    with pytest.raises(RewardFunctionError, match="grader's service went away"):
        _run(task, tmp_path, iterations=6, save_every=2, reward_functions=spec)
    monkeypatch.delenv("BREAK_GRADER")
    # Iterations 1-3 were logged; the checkpoint of iteration 2 is kept.
    assert [r["step"] for r in read_metrics(str(tmp_path)) if "reward" in r] == [1, 2, 3]
    summary = _run(task, tmp_path, iterations=6, save_every=2, reward_functions=spec)
    assert summary["step"] == 6.0
    # The rerun resumed from iteration 2: the log holds each step once, in order.
    assert [r["step"] for r in read_metrics(str(tmp_path)) if "reward" in r] == list(range(1, 7))


def test_a_slow_function_fails_on_its_timeout(task, tmp_path) -> None:
    with pytest.raises(RewardFunctionError, match=r"'slow'.*longer than 2 s.*reward_timeout"):
        _run(task, tmp_path, iterations=2, reward_functions=f"{task['functions']}:slow",
             reward_workers=1, reward_timeout=2.0)  # fmt: skip


def test_ppo_without_a_reward_model_trains_a_critic_from_the_policy(task, tmp_path) -> None:
    summary = _run(task, tmp_path, algorithm="ppo", rollout_batch_size=64, iterations=3,
                   reward_functions="builtin/exact-match")  # fmt: skip
    assert summary["step"] == 3.0
    assert np.isfinite(_curve(tmp_path, "val/mean")).all()


def test_lora_grpo_with_functions_alone_trains_adapters_only(task, tmp_path) -> None:
    summary = _run(task, tmp_path, iterations=2, lora_rank=4, learning_rate=1e-3,
                   reward_functions="builtin/exact-match")  # fmt: skip
    assert summary["step"] == 2.0
    assert np.isfinite(_curve(tmp_path, "rewards/exact_match/mean")).all()


def test_nothing_to_score_with_is_refused(task, tmp_path) -> None:
    with pytest.raises(ValueError, match="--reward-model, or reward functions"):
        _run(task, tmp_path, iterations=1)


def test_unscorable_responses_get_no_advantage_and_leave_their_group_alone() -> None:
    norm = ScoreNorm(mean=0.0, std=1.0, missing_eos_penalty=1.0, clip=0.0)
    has_eos = jnp.array([True, True, False, True])
    functions = jnp.array([1.0, jnp.nan, 0.5, jnp.nan])
    scores, scorable = combine_scores(jnp.zeros(4), has_eos, norm, functions, reward_model=False)
    np.testing.assert_allclose(scores, [1.0, 0.0, -0.5, 0.0])
    assert scorable.tolist() == [True, False, True, False]
    # A reward model judges every response: its score plus the functions' where they judged.
    scores, scorable = combine_scores(jnp.full(4, 2.0), has_eos, norm, functions, reward_model=True)
    np.testing.assert_allclose(scores, [3.0, 2.0, 1.5, 2.0])
    assert scorable.all()
    # Groups of two: the unscorable takes its group's scorable mean, or 0 when none is.
    filled = _fill_unscorable(jnp.array([1.0, 9.0, 9.0, 9.0]), jnp.array([1, 0, 0, 0]) > 0, 2)
    np.testing.assert_allclose(filled, [1.0, 1.0, 0.0, 0.0])


def test_the_weighted_total_is_trls_nansum() -> None:
    per_function = jnp.array([[1.0, 0.5], [jnp.nan, 0.5], [jnp.nan, jnp.nan], [0.0, jnp.nan]])
    total = weighted_total(per_function, (2.0, -1.0), xp=jnp)
    np.testing.assert_allclose(total, [1.5, -0.5, np.nan, 0.0])
