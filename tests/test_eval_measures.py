"""Evaluation measures against hand-computed values on small fixed inputs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import numpy as np
import pytest

from components.core.data import builtin_task
from components.core.flags import add_config_flags, config_from_flags
from components.evaluate import best_of_n as best_of_n_module
from components.evaluate import measures
from components.evaluate.config import EvalConfig

BOOT = {"n_resamples": 500, "confidence": 0.95, "seed": 0}
GOLD = builtin_task.GOLD_REWARD_NAME


def test_win_rate_counts_ties_half() -> None:
    assert measures.win_rate([1, 2, 3, 4], [0, 2, 5, 1]) == pytest.approx((2 + 0.5) / 4)
    assert measures.win_rate([1, 1], [1, 1]) == 0.5
    assert measures.win_rate([0, 0], [1, 1]) == 0.0


def test_win_rate_pairs_sample_s_with_sample_s() -> None:
    aligned = [[1, 5, 2], [0, 0, 9]]
    reference = [[0, 5, 3], [1, 1, 1]]
    # prompt 0: win, tie, loss; prompt 1: loss, loss, win -> (2 + 0.5) / 6
    assert measures.win_rate(aligned, reference) == pytest.approx(2.5 / 6)
    # The interval's win rate pairs every sample i with every sample j != i (independent
    # draws): prompt 0 wins 3 of 6, prompt 1 wins 2 of 6; the same-key pairs stay beside it.
    est = measures.win_rate_with_interval(aligned, reference, **BOOT)
    assert est["value"] == pytest.approx((3 / 6 + 2 / 6) / 2)
    assert (est["wins"], est["ties"], est["losses"], est["pairs"]) == (5, 0, 7, 12)
    assert est["coupled"] == {"value": pytest.approx(2.5 / 6), "ties": 1, "pairs": 6}
    # Resampling prompts: prompt 0 alone gives 0.5, prompt 1 alone 1/3; pairs mix them.
    assert 1 / 3 <= est["low"] <= est["value"] <= est["high"] <= 0.5


def test_more_samples_narrow_the_win_rate_interval() -> None:
    """Aligned better by 0.1 sd per sample on 200 prompts: 4 samples per prompt vs 1 (drawn
    with independent keys, so every pair counts)."""
    rng = np.random.default_rng(3)
    widths = {}
    for samples in (1, 4):
        aligned = rng.normal(0.1, 1, (200, samples))
        reference = rng.normal(0.0, 1, (200, samples))
        est = measures.win_rate_with_interval(aligned, reference, shared_keys=False, **BOOT)
        widths[samples] = est["high"] - est["low"]
        assert est["pairs"] == 200 * samples * samples and est["coupled"] is None
    assert widths[1] == pytest.approx(0.138, abs=0.02)  # ±1.96 sqrt(0.25 / 200) = ±0.069
    # The 16 pairs of a prompt share its samples: narrower than 1 pair, wider than 16 apart.
    assert widths[1] / 4 < widths[4] < widths[1] / 1.6
    assert widths[4] <= 0.1  # the default's target: at most ±0.05


def test_win_rate_rejects_bad_input_and_propagates_nan() -> None:
    assert math.isnan(measures.win_rate([1.0, np.nan], [0.0, 0.0]))
    with pytest.raises(ValueError, match="one shape"):
        measures.win_rate([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match=r"\[prompts\] or \[prompts, samples\]"):
        measures.win_rate(np.zeros((2, 2, 2)), np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match="empty"):
        measures.win_rate([], [])


def test_reward_model_accuracy_counts_ties_half() -> None:
    # pair 1 right, pair 2 tied, pair 3 wrong: (1 + 0.5) / 3
    assert measures.reward_model_accuracy([1, 1, 2], [0, 1, 3]) == pytest.approx(0.5)


def test_win_rate_with_interval_reports_counts() -> None:
    est = measures.win_rate_with_interval([1, 2, 3, 4], [0, 2, 5, 1], shared_keys=False, **BOOT)
    assert (est["wins"], est["ties"], est["losses"]) == (2, 1, 1)
    assert est["value"] == pytest.approx(0.625)
    assert est["low"] <= est["value"] <= est["high"]


def test_bootstrap_contains_estimate_and_narrows_with_more_data() -> None:
    rng = np.random.default_rng(1)
    widths = []
    for n in (40, 1600):
        aligned, reference = rng.normal(0.3, 1, n), rng.normal(0, 1, n)
        low, high = measures.bootstrap_interval(measures.win_rate, aligned, reference, **BOOT)
        assert low <= measures.win_rate(aligned, reference) <= high
        widths.append(high - low)
    assert widths[1] < widths[0] / 3  # width shrinks like 1/sqrt(n): about 1/6 here


def test_bootstrap_is_seeded_and_resamples_pairs_jointly() -> None:
    x = np.arange(30.0)
    first = measures.bootstrap_interval(lambda a, b: np.mean(a - b), x, x - 1.0, **BOOT)
    assert first == measures.bootstrap_interval(lambda a, b: np.mean(a - b), x, x - 1.0, **BOOT)
    # Indices are shared across arrays, so every paired difference stays exactly 1.
    assert first == pytest.approx((1.0, 1.0))


def test_bootstrap_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        measures.bootstrap_interval(measures.win_rate, [1, 2], [1], **BOOT)
    with pytest.raises(ValueError, match="confidence"):
        measures.bootstrap_interval(np.mean, [1, 2], n_resamples=10, confidence=1.0, seed=0)


def test_paired_difference_by_hand() -> None:
    result = measures.paired_difference([1, 2, 3, 4], [0, 2, 5, 1], **BOOT)
    assert result["aligned"] == {"mean": 2.5, "median": 2.5}
    assert result["reference"] == {"mean": 2.0, "median": 1.5}
    diff = result["difference"]
    assert diff["value"] == pytest.approx(0.5)  # differences 1, 0, -2, 3
    assert -2.0 <= diff["low"] <= diff["value"] <= diff["high"] <= 3.0


def test_kl_is_zero_for_identical_policies() -> None:
    logp = np.log(np.full((3, 5), 0.25))
    mask = np.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    assert measures.sequence_kl(logp, logp, mask) == {"per_sequence": 0.0, "per_token": 0.0}


def test_kl_by_hand_ignores_padding_garbage() -> None:
    aligned = np.array([[-1.0, -2.0, np.inf], [-0.5, np.nan, -np.inf]])
    reference = np.array([[-1.5, -2.5, np.inf], [-1.0, 7.0, -np.inf]])
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    kl = measures.sequence_kl(aligned, reference, mask, "k1")
    # log ratios 0.5 + 0.5 and 0.5: sequences 1.0 and 0.5; 1.5 nats over 3 tokens
    assert kl["per_sequence"] == pytest.approx(0.75)
    assert kl["per_token"] == pytest.approx(0.5)
    # k3 of a log-ratio of 0.5 per token: e^-0.5 − 1 + 0.5
    k3 = measures.sequence_kl(aligned, reference, mask)
    term = np.exp(-0.5) - 1 + 0.5
    assert k3["per_sequence"] == pytest.approx((2 * term + term) / 2)
    assert k3["per_token"] == pytest.approx(term)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_estimate_matches_analytic_kl_of_two_categoricals(estimator: str) -> None:
    p, q = np.array([0.7, 0.2, 0.1]), np.array([0.4, 0.4, 0.2])
    tokens = np.random.default_rng(0).choice(3, size=(20000, 1), p=p)
    logp, logq, mask = np.log(p)[tokens], np.log(q)[tokens], np.ones_like(tokens)
    kl = measures.sequence_kl(logp, logq, mask, estimator)
    analytic = float(np.sum(p * np.log(p / q)))
    assert kl["per_token"] > 0
    assert kl["per_token"] == pytest.approx(analytic, abs=0.02)


def test_k3_has_less_noise_than_k1_and_the_summary_uses_it() -> None:
    """k3, the evaluation's estimator, has a fraction of k1's spread per sample (here a
    third): over 100 samples its estimates of the same KL scatter a third as far."""
    p, q = np.array([0.7, 0.2, 0.1]), np.array([0.4, 0.4, 0.2])
    analytic = float(np.sum(p * np.log(p / q)))
    rng = np.random.default_rng(1)
    errors = {"k1": [], "k3": []}
    for _ in range(200):
        tokens = rng.choice(3, size=(100, 1), p=p)
        for name in errors:
            kl = measures.sequence_kl(np.log(p)[tokens], np.log(q)[tokens], tokens * 0 + 1, name)
            errors[name].append(kl["per_token"] - analytic)
    k1, k3 = (np.sqrt(np.mean(np.square(errors[n]))) for n in ("k1", "k3"))
    assert abs(np.mean(errors["k3"])) < 0.01  # unbiased
    assert k3 < 0.5 * k1
    config = EvalConfig()
    assert measures.kl_estimator(config) == "k3"
    assert measures.kl_estimator(dataclasses.replace(config, greedy=True)) == "k1"


def test_kl_rejects_mismatched_shapes_and_empty_masks() -> None:
    with pytest.raises(ValueError, match="shape"):
        measures.sequence_kl(np.zeros((2, 3)), np.zeros((2, 4)), np.ones((2, 3)))
    with pytest.raises(ValueError, match="no response tokens"):
        measures.sequence_kl(np.zeros((2, 3)), np.zeros((2, 3)), np.zeros((2, 3)))


def test_lengths_and_eos_from_masks_and_tokens() -> None:
    eos = 2
    tokens = np.array([[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    assert measures.response_lengths(mask).tolist() == [2, 4, 1]
    ended = measures.ends_with_eos(tokens, mask, eos)
    assert ended.tolist() == [True, False, True]
    assert measures.eos_rate(ended) == pytest.approx(2 / 3)
    # [P, S, T] inputs flatten to one row per response
    assert measures.response_lengths(mask[None]).tolist() == [2, 4, 1]


def test_gold_scores_of_known_responses() -> None:
    prompts = ["Tell me about the river."] * 4
    responses = ["good river.", "bad.", "", "the river is calm"]
    scores = measures.gold_scores(GOLD, prompts, responses)
    # mean sentiment per word (the topic is a neutral word); an empty response scores -1
    np.testing.assert_allclose(scores, [0.5, -1.0, -1.0, 0.25])
    assert measures.gold_win_rate(GOLD, prompts[:2], ["good.", "sad."], ["bad.", "sad."]) == 0.75
    with pytest.raises(ValueError, match="one prompt per response"):
        measures.gold_scores(GOLD, prompts, responses[:2])
    with pytest.raises(ValueError, match="gold reward 'nope' is not a built-in one"):
        measures.gold_scores("nope", prompts, responses)


# Two prompts, four reference samples each: hand-picked rewards and gold scores.
BON_REWARDS = [[0.1, 0.5, 0.3, 0.9], [0.7, 0.2, 0.8, 0.1]]
BON_GOLD = [[0.0, 0.2, 0.4, 0.6], [1.0, -1.0, 0.5, 0.0]]
BOUND2, BOUND4 = math.log(2) - 0.5, math.log(4) - 0.75
# Four distinct scores per prompt: levels of 1/4 each, winning with (k/4)^n − ((k−1)/4)^n.
KL2 = sum(p * math.log(4 * p) for p in (1 / 16, 3 / 16, 5 / 16, 7 / 16))  # 0.1740
KL4 = sum(p * math.log(4 * p) for p in (1 / 256, 15 / 256, 65 / 256, 175 / 256))  # 0.5903


def test_best_of_n_kl_bound_is_analytic() -> None:
    assert measures.best_of_n_kl_bound(1) == 0.0
    assert measures.best_of_n_kl_bound(2) == pytest.approx(0.193147, abs=1e-6)
    assert measures.best_of_n_kl_bound(16) == pytest.approx(math.log(16) - 15 / 16)
    with pytest.raises(ValueError, match="at least 1"):
        measures.best_of_n_kl_bound(0)


def test_best_of_n_kl_with_two_score_levels_is_far_below_the_bound() -> None:
    # Beirami et al. (2024): two equally likely levels at n = 16 give log 2 nats (the best
    # of 16 is the upper level but for 2^-16), not the bound's 1.835.
    exact = (0.5**16) * math.log(0.5**16 / 0.5) + (1 - 0.5**16) * math.log((1 - 0.5**16) / 0.5)
    assert measures.best_of_n_kl([[0.0] * 8 + [1.0] * 8], 16) == pytest.approx(exact)
    assert exact == pytest.approx(math.log(2), abs=1e-3)  # 0.69296
    # Drawn: 16 samples per prompt of a judge with two levels, estimated per prompt. The
    # plug-in's finite-sample bias is +0.03 at N = 16 (log of the upper level's estimated
    # share is convex); the bound would say 1.835.
    draws = np.random.default_rng(0).integers(0, 2, size=(4000, 16)).astype(float)
    assert measures.best_of_n_kl(draws, 16) == pytest.approx(math.log(2), abs=0.05)
    assert measures.best_of_n_kl(draws, 1) == 0.0
    # A judge that ties everything: best-of-n is the reference.
    assert measures.best_of_n_kl(np.ones((3, 16)), 16) == 0.0


def test_best_of_n_kl_of_distinct_scores_stays_just_below_the_bound() -> None:
    scores = np.random.default_rng(1).normal(size=(50, 16))
    for n in (2, 4, 8, 16):
        estimate = measures.best_of_n_kl(scores, n)
        assert 0.95 * measures.best_of_n_kl_bound(n) < estimate <= measures.best_of_n_kl_bound(n)
    assert measures.best_of_n_kl([[0.1, 0.5, 0.3, 0.9]], 2) == pytest.approx(KL2)
    with pytest.raises(ValueError, match="prompts, samples"):
        measures.best_of_n_kl([0.1, 0.2], 2)


# The draws ordered by reward: prompt 0's gold reads 0.0, 0.4, 0.2, 0.6 and its rewards 0.1,
# 0.3, 0.5, 0.9; prompt 1's gold 0.0, -1.0, 1.0, 0.5 and rewards 0.1, 0.2, 0.7, 0.8.
BON_SORTED_GOLD = ([0.0, 0.4, 0.2, 0.6], [0.0, -1.0, 1.0, 0.5])
BON_SORTED_REWARDS = ([0.1, 0.3, 0.5, 0.9], [0.1, 0.2, 0.7, 0.8])


def _bon_by_hand(n: float, values=BON_SORTED_GOLD) -> tuple[float, float]:
    """(mean KL, mean value) of best-of-n from 4 distinct draws a prompt, by the formula."""
    weights = [(k / 4) ** n - ((k - 1) / 4) ** n for k in range(1, 5)]
    kl = sum(w * math.log(4 * w) for w in weights)
    return kl, float(
        np.mean([sum(w * v for w, v in zip(weights, row, strict=True)) for row in values])
    )


def test_best_of_n_frontier_is_the_exact_expectation_over_all_draws() -> None:
    frontier = measures.best_of_n(BON_REWARDS, BON_GOLD, [4, 1, 2])
    assert [p["n"] for p in frontier] == [1, 2, 4]
    assert [p["kl_per_sequence"] for p in frontier] == pytest.approx([0.0, KL2, KL4])
    assert [p["kl_bound"] for p in frontier] == pytest.approx([0.0, BOUND2, BOUND4])
    # n = 1 is the mean over every draw (not the first draw's): (0.3 + 0.125) / 2.
    assert frontier[0]["gold"] == pytest.approx(np.mean(BON_GOLD))
    # n = 2: weights 1, 3, 5, 7 (/16): (6.4 + 5.5) / 16 / 2; n = 4: 1, 15, 65, 175 (/256).
    assert [p["gold"] for p in frontier] == pytest.approx([0.2125, 0.371875, 0.5107421875])
    assert [p["reward"] for p in frontier] == pytest.approx(
        [_bon_by_hand(n, BON_SORTED_REWARDS)[1] for n in (1, 2, 4)]
    )
    assert all(p["gold"] is None for p in measures.best_of_n(BON_REWARDS, None, [1, 2]))
    # Tied scores share their level's pick: two tied draws of gold 0 and 1 read as 0.5.
    tied = measures.best_of_n([[1.0, 1.0, 0.0]], [[0.0, 1.0, 9.0]], [1, 3])
    assert tied[1]["gold"] == pytest.approx((1 - (1 / 3) ** 3) * 0.5 + (1 / 3) ** 3 * 9.0)


def test_best_of_n_at_a_real_n_solves_for_the_aligned_kl() -> None:
    levels = best_of_n_module.score_levels(BON_REWARDS, BON_GOLD)
    for n in (1.0, 1.37, 2.0, 3.5):
        kl, gold = _bon_by_hand(n)
        point = best_of_n_module.curve(levels, n)
        assert (np.mean(point.kl), np.mean(point.gold)) == (pytest.approx(kl), pytest.approx(gold))
        assert measures.best_of_n_kl(BON_REWARDS, n) == pytest.approx(kl)
    n, capped = best_of_n_module.n_at_kl(levels, _bon_by_hand(1.37)[0], 4.0)
    assert (n, capped) == (pytest.approx(1.37, abs=1e-9), False)
    assert best_of_n_module.n_at_kl(levels, 5.0, 4.0) == (4.0, True)  # beyond n = 4's KL
    assert best_of_n_module.n_at_kl(levels, -0.2, 4.0)[0] == pytest.approx(1.0)
    # Best-of-n that loses gold (reward hacking) gives no ratio rather than a negative one.
    worse = best_of_n_module.score_levels(BON_REWARDS, -np.asarray(BON_GOLD))
    assert best_of_n_module.versus_aligned(worse, 0.1, 0.1, 4.0)["ratio"] is None
    assert best_of_n_module.versus_aligned(levels, 0.1, 0.0, 4.0)["ratio"] is None


def test_gain_at_kl_interpolates_linearly_and_caps() -> None:
    kls, gains = [0.0, KL2, KL4], [0.0, 0.1, 0.05]
    assert measures.gain_at_kl(kls, gains, 0.1) == (pytest.approx(0.1 * 0.1 / KL2), False)
    halfway = (KL2 + KL4) / 2
    assert measures.gain_at_kl(kls, gains, halfway) == (pytest.approx(0.075), False)
    assert measures.gain_at_kl(kls, gains, 3.0) == (0.05, True)
    assert measures.gain_at_kl(kls, gains, -0.2) == (0.0, False)
    with pytest.raises(ValueError, match="not decreasing"):
        measures.gain_at_kl([0.0, 0.2, 0.1], [0.0, 1.0, 2.0], 0.5)
    # Equal KLs (a judge that ties every draw) count once, at their best gain.
    assert measures.gain_at_kl([0.0, 0.0, 0.0], [0.0, 0.3, 0.1], 0.5) == (0.3, True)
    assert measures.gain_at_kl([0.0, 0.1, 0.1], [0.0, 0.3, 0.1], 0.05) == (0.15, False)


def _outputs(rewards, lengths, t=6, gold=None) -> measures.PolicyOutputs:
    mask = np.arange(t)[None, :] < np.asarray(lengths)[:, None]
    return measures.PolicyOutputs(
        rewards=rewards,
        response_mask=mask,
        ended_with_eos=np.asarray(lengths) < t,
        gold_rewards=gold,
    )


def test_summarize_assembles_json_ready_measures() -> None:
    config = EvalConfig(bootstrap_samples=200, samples_per_prompt=2)
    aligned = _outputs([[1, 1], [1, 3], [3, 3], [4, 4]], [2, 6, 3, 1, 4, 4, 2, 2])
    reference = _outputs([[0, 0], [2, 2], [5, 5], [0, 2]], [6, 6, 6, 6, 1, 1, 1, 1])
    logp = np.full((8, 6), -1.0)
    summary = measures.summarize(
        aligned, reference, aligned_logprobs=logp, reference_logprobs=logp - 0.1, config=config
    )
    json.dumps(summary, allow_nan=False)  # plain numbers only
    assert summary["win_rate"]["value"] == pytest.approx(0.625)  # per-prompt means as above
    assert summary["reward"]["difference"]["value"] == pytest.approx(0.5)
    k3 = np.exp(-0.1) - 1 + 0.1  # a log-ratio of 0.1 on every token
    assert summary["kl_estimator"] == "k3"
    assert summary["kl"]["per_token"] == pytest.approx(k3)
    assert summary["kl"]["per_sequence"] == pytest.approx(k3 * 24 / 8)
    assert summary["response_length"]["aligned"]["mean"] == pytest.approx(3.0)
    assert summary["eos_rate"] == {"aligned": 0.875, "reference": 0.5}
    assert summary["reward_model_accuracy"] is None and summary["gold"] is None
    assert sum(summary["reward_histogram"]["aligned"]) == 4
    assert summary["num_prompts"] == 4 and summary["samples_per_prompt"] == 2
    assert summary["best_of_n"] is None and summary["ppo_vs_best_of_n"] is None


def _log_ratio_of_k3(term: float) -> float:
    """x > 0 with e^-x − 1 + x = ``term`` (Newton's method from the quadratic's root)."""
    x = math.sqrt(2 * term)
    for _ in range(20):
        x -= (math.expm1(-x) + x - term) / (1 - math.exp(-x))
    return x


def test_summarize_with_best_of_n_and_gold() -> None:
    """Aligned gold gain 0.03 at a KL of 0.1 nats per sequence against the hand frontier."""
    config = EvalConfig(bootstrap_samples=100, samples_per_prompt=1, best_of_n="1,2,4")
    summary = measures.summarize(
        _outputs([1.0, 2.0], [3, 3], gold=[0.53, 0.53]),
        _outputs([0.0, 3.0], [3, 3], gold=[0.5, 0.5]),
        aligned_logprobs=np.full((2, 6), -1.0),
        # k3 of 0.1 / 3 nats per token, over 3 tokens: 0.1 nats per sequence
        reference_logprobs=np.full((2, 6), -1.0 - _log_ratio_of_k3(0.1 / 3)),
        config=config,
        gold_name=GOLD,
        best_of_n_draws=measures.BestOfNDraws(BON_REWARDS, BON_GOLD),
    )
    json.dumps(summary, allow_nan=False)
    assert summary["kl"]["per_sequence"] == pytest.approx(0.1)
    assert [p["gold"] for p in summary["best_of_n"]] == pytest.approx(
        [0.2125, 0.371875, 0.5107421875]
    )
    # At the aligned KL: the real n whose exact KL is 0.1 nats, and the gold gain there.
    n = summary["best_of_n_at_kl"]["n"]
    kl, gold = _bon_by_hand(n)
    assert 1 < n < 2 and kl == pytest.approx(0.1)
    gain = gold - 0.2125
    assert summary["ppo_vs_best_of_n"] == pytest.approx(0.03 / gain)
    assert summary["ppo_vs_best_of_n_capped"] is False
    assert summary["ppo_vs_best_of_n_gains"] == {
        "aligned": pytest.approx(0.03),
        "best_of_n": pytest.approx(gain),
    }
    # The chord from (0, 0) to n = 2 lies below the curve: it credits best-of-n less.
    chord = 0.1 * (0.371875 - 0.2125) / KL2
    assert summary["ppo_vs_best_of_n_chord"] == pytest.approx(0.03 / chord)
    assert chord < gain
    # The bound puts best-of-n at a smaller n for the same KL: a smaller gain.
    n_bound = best_of_n_module.n_at_bound(0.1, 4.0)
    assert measures.best_of_n_kl_bound(n_bound) == pytest.approx(0.1)
    bound_gain = _bon_by_hand(n_bound)[1] - 0.2125
    assert summary["ppo_vs_best_of_n_bound"] == pytest.approx(0.03 / bound_gain)
    interval = summary["ppo_vs_best_of_n_interval"]
    assert interval["low"] <= summary["ppo_vs_best_of_n"] <= interval["high"]
    without_gold = measures.summarize(
        _outputs([1.0, 2.0], [3, 3]), _outputs([0.0, 3.0], [3, 3]),
        aligned_logprobs=np.zeros((2, 6)), reference_logprobs=np.zeros((2, 6)), config=config,
        best_of_n_draws=measures.BestOfNDraws(BON_REWARDS),
    )  # fmt: skip
    assert [p["reward"] for p in without_gold["best_of_n"]] == pytest.approx(
        [0.45, 0.6125, 0.74844], abs=1e-5
    )
    assert without_gold["best_of_n"][0]["gold"] is None
    assert without_gold["ppo_vs_best_of_n"] is None
    assert without_gold["ppo_vs_best_of_n_gains"] is None


def test_summarize_with_gold_and_reward_model_pairs() -> None:
    config = EvalConfig(bootstrap_samples=100)
    summary = measures.summarize(
        _outputs([[1.0, 1.0], [2.0, 2.0]], [3] * 4, gold=[[1.0, 1.0], [0.0, 0.0]]),
        _outputs([[0.0, 0.0], [3.0, 3.0]], [3] * 4, gold=[[0.0, 0.0], [0.0, 0.0]]),
        aligned_logprobs=np.zeros((4, 6)),
        reference_logprobs=np.zeros((4, 6)),
        config=config,
        chosen_rewards=[1, 1, 2],
        rejected_rewards=[0, 1, 3],
        gold_name=GOLD,
    )
    assert summary["reward_model_accuracy"] == {"value": 0.5, "num_pairs": 3}
    assert summary["gold"]["name"] == GOLD
    assert summary["gold"]["win_rate"]["value"] == 0.75
    assert summary["gold"]["aligned"]["mean"] == 0.5


def test_summarize_records_its_judge() -> None:
    """Gold as the judge: the rewards are the gold scores, and the summary says so."""
    config = EvalConfig(bootstrap_samples=100)
    gold = [[1.0, 0.0], [0.5, 0.5]]
    args = dict(aligned_logprobs=np.zeros((4, 6)), reference_logprobs=np.zeros((4, 6)))
    aligned = _outputs(gold, [3, 3, 3, 3], gold=gold)
    reference = _outputs([[0.0, 0.0], [0.5, 1.0]], [3, 3, 3, 3], gold=[[0.0, 0.0], [0.5, 1.0]])
    summary = measures.summarize(
        aligned, reference, config=config, gold_name=GOLD, judge=measures.JUDGE_GOLD, **args
    )
    assert summary["judge"] == "gold" and summary["reward_model_accuracy"] is None
    assert summary["win_rate"] == summary["gold"]["win_rate"]
    default = measures.summarize(aligned, reference, config=config, **args)
    assert default["judge"] == "reward_model"
    with pytest.raises(ValueError, match="judge: 'oracle' must be one of reward_model, gold"):
        measures.summarize(aligned, reference, config=config, judge="oracle", **args)


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"samples_per_prompt": 0}, "samples_per_prompt"),
        ({"temperature": 0.0}, "temperature"),
        ({"confidence": 1.0}, "confidence"),
        ({"min_win_rate_lower": 1.5}, "min_win_rate_lower"),
        ({"max_kl": -0.1}, "max_kl"),
        ({"bootstrap_samples": 0}, "bootstrap_samples"),
        ({"num_report_samples": -1}, "num_report_samples"),
        ({"gold_reward": "nope"}, "gold_reward"),
        ({"best_of_n": "2,4"}, "best_of_n"),
        ({"best_of_n": "1,two"}, "best_of_n"),
        ({"best_of_n": (0, 1)}, "best_of_n"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EvalConfig(**overrides)


def test_config_flags_round_trip() -> None:
    assert EvalConfig(greedy=True, temperature=0.0).greedy  # temperature unused when greedy
    parser = argparse.ArgumentParser()
    add_config_flags(parser, EvalConfig)
    args = parser.parse_args(["--max-kl", "0.2", "--greedy", "--bootstrap-samples", "50"])
    config = config_from_flags(EvalConfig, args)
    assert (config.max_kl, config.greedy, config.bootstrap_samples) == (0.2, True, 50)
    assert config.min_win_rate_lower == 0.5
    args = parser.parse_args(["--best-of-n", "1,4,16", "--gold-reward", "json:dumps"])
    config = config_from_flags(EvalConfig, args)
    assert config.best_of_n_sizes() == (1, 4, 16) and config.gold_reward == "json:dumps"
    assert EvalConfig().best_of_n_sizes() == (1, 2, 4, 8, 16)
    assert EvalConfig(best_of_n=(8, 1, 2)).best_of_n_sizes() == (1, 2, 8)
    assert EvalConfig(best_of_n="").best_of_n_sizes() == ()
    assert EvalConfig(greedy=True).best_of_n_sizes() == ()  # n greedy answers are one answer
