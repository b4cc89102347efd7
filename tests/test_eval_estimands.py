"""Each promoted figure is the estimand its label names (issue 48): the win rate of
independent draws, best-of-n on its real curve at any n, intervals over prompts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from components.evaluate import best_of_n, measures
from components.evaluate.config import EvalConfig
from components.evaluate.gate import decide

BOOT = {"n_resamples": 400, "confidence": 0.95, "seed": 0}


def _identical_policies(prompts: int, samples: int, draws: int, levels: int, seed: int = 0):
    """Judge scores of two identical policies sampled with shared keys: sample s of both is
    one response (common random numbers), the reference's further draws are fresh."""
    rng = np.random.default_rng(seed)
    reference = rng.integers(0, levels, size=(prompts, draws)).astype(float)
    return reference[:, :samples].copy(), reference


def test_identical_policies_win_half_under_independent_pairs() -> None:
    """A judge of 10 equally likely levels: independent draws tie 1 time in 10, so the
    coupled pairing's 100% ties are the sampler's, not the judge's resolution."""
    covered = 0
    for seed in range(20):
        aligned, reference = _identical_policies(300, 4, 16, levels=10, seed=seed)
        est = measures.win_rate_with_interval(aligned, reference, **BOOT)
        covered += est["low"] < 0.5 < est["high"]
        assert est["value"] == pytest.approx(0.5, abs=0.03)
        assert est["ties"] / est["pairs"] == pytest.approx(0.1, abs=0.01)
    assert covered >= 17  # a 95% interval: 19 of 20 expected, 17 or more 98% of the time
    assert est["pairs"] == 300 * (4 * 16 - 4)  # every pair but the 4 of shared keys
    # The old pairing: every comparison a tie, 0.5 [0.5, 0.5] whatever the judge.
    assert est["coupled"] == {"value": 0.5, "ties": 1200, "pairs": 1200}


def test_a_better_policy_wins_its_true_probability_not_the_coupled_one() -> None:
    """Aligned moves 20% of a prompt's responses up one level; with shared keys the other
    80% tie their reference sample, which the coupled pairing counts as halves. The
    independent estimate meets P(y > y') + P(y = y')/2 computed from the two laws."""
    rng = np.random.default_rng(1)
    prompts, levels = 400, 5
    reference = rng.integers(0, levels, size=(prompts, 16)).astype(float)
    moved = rng.random((prompts, 4)) < 0.2
    aligned = np.minimum(reference[:, :4] + moved, levels - 1)
    # Aligned's law: reference's uniform law, 20% shifted up one level (capped at the top).
    up = np.full(levels, 0.8 / levels) + np.r_[0.0, np.full(levels - 1, 0.2 / levels)]
    up[-1] += 0.2 / levels
    ref = np.full(levels, 1.0 / levels)
    truth = sum(
        up[i] * ref[j] * (1.0 if i > j else 0.5 if i == j else 0.0)
        for i in range(levels)
        for j in range(levels)
    )
    est = measures.win_rate_with_interval(aligned, reference, **BOOT)
    assert est["low"] < truth < est["high"]
    assert est["value"] == pytest.approx(truth, abs=0.01)
    # Coupled: 0.5 + (moved and not at the top) / 2 = 0.5 + 0.2 * 0.8 / 2, far from truth.
    assert est["coupled"]["value"] == pytest.approx(0.58, abs=0.01)
    assert est["coupled"]["value"] - truth > 0.03


def test_the_gate_does_not_bless_an_unchanged_sampled_policy() -> None:
    aligned, reference = _identical_policies(200, 4, 16, levels=10, seed=2)
    mask = np.ones((200, 4, 3))
    outputs = measures.PolicyOutputs(aligned, mask, np.ones((200, 4), bool))
    same = measures.PolicyOutputs(reference[:, :4], mask, np.ones((200, 4), bool))
    logp = np.full((200, 4, 3), -1.0)
    config = EvalConfig(bootstrap_samples=400, best_of_n="1,2,4,8,16")
    summary = measures.summarize(
        outputs, same, aligned_logprobs=logp, reference_logprobs=logp, config=config,
        best_of_n_draws=measures.BestOfNDraws(reference),
    )  # fmt: skip
    assert summary["win_rate"]["low"] < 0.5 < summary["win_rate"]["high"]
    assert not decide(summary, config).blessed


def _uniform_draws(prompts: int, draws: int, seed: int = 0) -> np.ndarray:
    """Scores uniform on (0, 1), judge and gold alike: best-of-n's gold is n / (n + 1) and
    its KL log n − (n − 1)/n exactly, for any real n."""
    return np.random.default_rng(seed).uniform(size=(prompts, draws))


@pytest.mark.parametrize("n", [1.0, 1.5, 2.0, 3.7, 8.0])
def test_best_of_n_curve_meets_the_closed_form_at_any_n(n: float) -> None:
    draws = _uniform_draws(4, 2000)
    point = best_of_n.curve(best_of_n.score_levels(draws, draws), n)
    assert np.mean(point.kl) == pytest.approx(best_of_n.best_of_n_kl_bound(n), abs=1e-3)
    assert np.mean(point.gold) == pytest.approx(n / (n + 1), abs=0.01)


def test_ppo_vs_best_of_n_matches_the_closed_form_where_the_chord_does_not() -> None:
    """An aligned policy exactly as good as best-of-1.5 (KL 0.072 nats, gold gain 0.1):
    ratio 1 on the any-n curve; the chord through n = 1 and 2 reads 1.6."""
    draws = _uniform_draws(4, 2000)
    n0 = 1.5
    aligned = best_of_n.AlignedPoint(
        gold_gain=np.full(4, n0 / (n0 + 1) - 0.5),
        kl_per_sequence=np.full(4, best_of_n.best_of_n_kl_bound(n0)),
    )
    part = best_of_n.summary_part(
        best_of_n.BestOfNDraws(draws, draws), (1, 2, 4, 8, 16), aligned, BOOT
    )
    assert part["best_of_n_at_kl"]["n"] == pytest.approx(n0, abs=0.01)
    assert part["ppo_vs_best_of_n"] == pytest.approx(1.0, abs=0.02)
    assert part["ppo_vs_best_of_n_capped"] is False
    interval = part["ppo_vs_best_of_n_interval"]
    assert interval["low"] <= part["ppo_vs_best_of_n"] <= interval["high"]
    # The chord: 0.1 against 0.072 / 0.193 of best-of-2's gain 1/6, i.e. 0.062.
    chord = best_of_n.best_of_n_kl_bound(n0) / best_of_n.best_of_n_kl_bound(2) * (2 / 3 - 0.5)
    assert part["ppo_vs_best_of_n_chord"] == pytest.approx(0.1 / chord, rel=0.03)
    assert part["ppo_vs_best_of_n_chord"] > 1.5
    # The report's curve: real n from 1 to the number of draws, on the closed form.
    dense = part["best_of_n_curve"]
    assert len(dense) == best_of_n.CURVE_POINTS
    assert (dense[0]["n"], dense[-1]["n"]) == (pytest.approx(1.0), pytest.approx(2000))
    kls = [point["kl_per_sequence"] for point in dense]
    assert kls == sorted(kls)
    for point in dense[:12]:  # n up to 35: the plug-in's bias grows as n nears N
        n = point["n"]
        assert point["gold"] == pytest.approx(n / (n + 1), abs=0.01)
        assert point["kl_per_sequence"] == pytest.approx(best_of_n.best_of_n_kl_bound(n), abs=2e-3)


def test_ratio_interval_covers_the_truth_and_narrows_with_prompts() -> None:
    """Noisy aligned gains around best-of-2's own gain at best-of-2's KL (truth: ratio 1)."""
    widths = []
    for prompts in (50, 400):
        rng = np.random.default_rng(prompts)
        draws = rng.uniform(size=(prompts, 16))
        levels = best_of_n.score_levels(draws, draws)
        point = best_of_n.curve(levels, 2.0)
        gain = point.gold - best_of_n.curve(levels, 1.0).gold  # each prompt's best-of-2 gain
        aligned = best_of_n.AlignedPoint(gain + rng.normal(0, 0.05, prompts), point.kl)
        part = best_of_n.summary_part(
            best_of_n.BestOfNDraws(draws, draws), (1, 2, 4, 8, 16), aligned, BOOT
        )
        interval = part["ppo_vs_best_of_n_interval"]
        assert interval["low"] < 1.0 < interval["high"]
        assert part["best_of_n_at_kl"]["n"] == pytest.approx(2.0, abs=0.05)
        widths.append(interval["high"] - interval["low"])
    assert widths[1] < widths[0] / 2  # 8 times the prompts: about √8 narrower


def test_the_gain_baseline_is_the_mean_of_every_draw() -> None:
    """Best-of-1 is the reference's mean over all N draws, not the first draw's gold."""
    draws = np.array([[0.0, 1.0, 2.0, 3.0], [5.0, 1.0, 1.0, 1.0]])
    gold = np.array([[9.0, 1.0, 2.0, 3.0], [0.0, 4.0, 4.0, 4.0]])
    frontier = measures.best_of_n(draws, gold, [1])
    assert frontier[0]["gold"] == pytest.approx(np.mean(gold))  # 3.375, the first draws' 4.5
    assert not math.isclose(frontier[0]["gold"], np.mean(gold[:, 0]))
