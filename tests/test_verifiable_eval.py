"""The verifiable task's figures: pass@k is Chen et al.'s estimator, the summary's numbers
and intervals are those of hand-made and simulated policies."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from components.evaluate.verifiable import pass_at_k, pass_at_k_mean, verifiable_summary

BOOT = {"n_resamples": 400, "confidence": 0.95, "seed": 0}


def _policy(rng: np.random.Generator, prompts: int, samples: int, rate: float) -> dict:
    """A policy that solves each prompt with probability ``rate``, greedy and sampled alike."""
    return {
        "greedy_correct": rng.random(prompts) < rate,
        "sampled_correct": rng.random((prompts, samples)) < rate,
        "lengths": rng.integers(5, 50, size=prompts),
        "ended": rng.random(prompts) < 0.9,
    }


@pytest.mark.parametrize(
    ("n", "c", "k"),
    [(10, 3, 1), (10, 3, 4), (10, 7, 3), (20, 1, 5), (16, 5, 16), (5, 2, 3), (100, 13, 10)],
)
def test_pass_at_k_matches_the_combinatorial_formula(n: int, c: int, k: int) -> None:
    expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_pass_at_k_edges() -> None:
    assert pass_at_k(10, 0, 4) == 0.0  # nothing correct: no subset passes
    assert pass_at_k(10, 10, 4) == 1.0
    assert pass_at_k(10, 7, 4) == 1.0  # 3 wrong samples cannot fill a 4-subset
    assert pass_at_k(10, 6, 4) == pytest.approx(1.0 - 1.0 / math.comb(10, 4))
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)  # no overflow for large n
    assert pass_at_k(1000, 3, 500) == pytest.approx(
        1.0 - math.comb(997, 500) / math.comb(1000, 500)
    )


@pytest.mark.parametrize(
    ("n", "c", "k", "names"),
    [(10, 3, 0, "k: 0"), (10, 3, -1, "k: -1"), (4, 1, 5, "k: 5 exceeds n: 4"), (4, 5, 2, "c: 5")],
)
def test_pass_at_k_rejects_bad_arguments(n: int, c: int, k: int, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        pass_at_k(n, c, k)
    with pytest.raises(ValueError, match="c: -1"):
        pass_at_k(4, -1, 2)


def test_pass_at_1_is_the_mean_and_pass_at_k_grows_with_k() -> None:
    correct = np.random.default_rng(0).random((50, 16)) < 0.3
    assert pass_at_k_mean(correct, 1) == pytest.approx(correct.mean(), rel=1e-12)
    curve = [pass_at_k_mean(correct, k) for k in range(1, 17)]
    assert all(a <= b for a, b in zip(curve, curve[1:], strict=False))
    assert curve[0] < curve[1] < curve[3] < curve[7]
    assert curve[-1] == pytest.approx(correct.any(axis=1).mean())  # pass@n: any correct
    by_hand = np.mean([pass_at_k(16, int(row.sum()), 4) for row in correct])
    assert pass_at_k_mean(correct, 4) == pytest.approx(by_hand, rel=1e-12)
    with pytest.raises(ValueError, match="k: 17 exceeds n: 16"):
        pass_at_k_mean(correct, 17)
    with pytest.raises(ValueError, match=r"\[prompts, n\]"):
        pass_at_k_mean(correct[0], 1)


def test_summary_of_a_hand_made_example() -> None:
    sampled = np.array(
        [[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]], bool
    )  # 4, 0, 1, 2 of 4 correct
    summary = verifiable_summary(
        [1, 0, 1, 1], sampled, [10, 20, 30, 40], [True, True, False, True], ks=(8, 2, 1), **BOOT
    )
    assert summary["accuracy"] == 0.75
    assert summary["mean_response_length"] == 25.0
    assert summary["ended_fraction"] == 0.75
    assert (summary["prompts"], summary["samples_per_prompt"]) == (4, 4)
    assert list(summary["pass_at_k"]) == ["1", "2"]  # 8 exceeds the 4 samples drawn
    assert summary["pass_at_k"]["1"]["value"] == pytest.approx(7 / 16)
    # pass@2 per prompt: 1, 0, 1 − C(3,2)/C(4,2) = 1/2, 1 − C(2,2)/C(4,2) = 5/6.
    assert summary["pass_at_k"]["2"]["value"] == pytest.approx((1 + 0 + 1 / 2 + 5 / 6) / 4)
    low, high = summary["accuracy_interval"]
    assert 0.0 <= low <= 0.75 <= high <= 1.0 and low < high
    for entry in summary["pass_at_k"].values():
        assert entry["interval"][0] <= entry["value"] <= entry["interval"][1]
    assert json.loads(json.dumps(summary)) == summary  # plain Python values only
    assert "reference" not in summary and "accuracy_gain" not in summary


def test_summary_without_samples_has_no_pass_at_k() -> None:
    summary = verifiable_summary([1, 0], None, [3, 5], [True, False], ks=(1, 4), **BOOT)
    assert summary["pass_at_k"] == {}
    assert summary["samples_per_prompt"] == 0
    assert summary["accuracy"] == 0.5


def test_accuracy_gain_of_a_clearly_better_policy() -> None:
    rng = np.random.default_rng(1)
    aligned, reference = _policy(rng, 200, 8, 0.8), _policy(rng, 200, 8, 0.3)
    summary = verifiable_summary(**aligned, ks=(1, 4), reference=reference, **BOOT)
    gain = summary["accuracy_gain"]
    assert gain["value"] == pytest.approx(
        aligned["greedy_correct"].mean() - reference["greedy_correct"].mean()
    )
    low, high = gain["interval"]
    assert 0.0 < low < 0.5 < high  # excludes 0, holds the true difference
    assert high - low < 0.25
    assert summary["reference"]["accuracy"] == reference["greedy_correct"].mean()
    assert summary["reference"]["pass_at_k"]["4"]["value"] < summary["pass_at_k"]["4"]["value"]


def test_accuracy_gain_of_equal_policies_includes_zero() -> None:
    rng = np.random.default_rng(2)
    policy = _policy(rng, 200, 4, 0.5)
    same = verifiable_summary(**policy, ks=(1,), reference=policy, **BOOT)["accuracy_gain"]
    assert same == {"value": 0.0, "interval": [0.0, 0.0]}  # paired: every resample cancels
    other = _policy(rng, 200, 4, 0.5)
    low, high = verifiable_summary(**policy, ks=(1,), reference=other, **BOOT)["accuracy_gain"][
        "interval"
    ]
    assert low < 0.0 < high


def test_fixed_seed_gives_identical_intervals() -> None:
    rng = np.random.default_rng(3)
    aligned, reference = _policy(rng, 60, 4, 0.6), _policy(rng, 60, 4, 0.4)
    first = verifiable_summary(**aligned, ks=(1, 2), reference=reference, **BOOT)
    assert first == verifiable_summary(**aligned, ks=(1, 2), reference=reference, **BOOT)
    reseeded = verifiable_summary(**aligned, ks=(1, 2), reference=reference, **{**BOOT, "seed": 1})
    assert reseeded["accuracy_gain"]["interval"] != first["accuracy_gain"]["interval"]


def test_summary_rejects_mismatched_shapes() -> None:
    rng = np.random.default_rng(4)
    policy = _policy(rng, 10, 4, 0.5)
    with pytest.raises(ValueError, match="same prompts"):
        verifiable_summary(**policy, ks=(1,), reference=_policy(rng, 9, 4, 0.5), **BOOT)
    with pytest.raises(ValueError, match="lengths"):
        verifiable_summary(**{**policy, "lengths": np.ones(9)}, ks=(1,), **BOOT)
    with pytest.raises(ValueError, match="sampled_correct"):
        verifiable_summary(**{**policy, "sampled_correct": np.ones((9, 4))}, ks=(1,), **BOOT)
