"""The length-controlled win rate: a judge that rewards length makes a longer policy win;
at equal lengths it does not. Checked on synthetic samples whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from components.evaluate import length_control
from components.evaluate.measures import PolicyOutputs, independent_pairs, lc_win_rate

BOOTSTRAP = {"n_resamples": 200, "confidence": 0.95, "seed": 0}


def _policies(rng, prompts: int, samples: int, length_gain: float, quality_gain: float):
    """Two policies' [P, S] lengths and a judge's scores: score = quality + 0.05 · length."""
    ref_len = rng.integers(10, 40, size=(prompts, samples))
    ali_len = ref_len + rng.integers(0, 2 * int(length_gain) + 1, size=(prompts, samples))
    ref_q = rng.normal(0, 1, size=(prompts, samples))
    ali_q = rng.normal(quality_gain, 1, size=(prompts, samples))
    return (ali_q + 0.05 * ali_len, ref_q + 0.05 * ref_len), (ali_len, ref_len)


def _outputs(scores, lengths, width=64):
    mask = (np.arange(width)[None, None, :] < lengths[:, :, None]).astype(np.int32)
    return PolicyOutputs(scores, mask, np.ones(scores.shape, bool))


def test_a_length_preferring_judge_wins_only_by_length():
    rng = np.random.default_rng(0)
    (ali, ref), (ali_len, ref_len) = _policies(rng, 200, 4, length_gain=20, quality_gain=0.0)
    result = lc_win_rate(
        _outputs(ali, ali_len), _outputs(ref, ref_len), "rewards", shared_keys=True, **BOOTSTRAP
    )
    # Raw: the longer policy wins most pairs; at equal lengths it is no better (0.5).
    assert result["raw"] > 0.6
    assert abs(result["value"] - 0.5) < 0.05 and result["low"] < 0.5 < result["high"]
    assert result["length_coefficient"] > 0.5 and result["mean_length_difference"] > 15
    assert result["pairs"] == 200 * 4 * 3  # independent pairs: not sample s with sample s
    assert "sigmoid(b0)" in result["model"]


def test_without_a_length_difference_it_is_the_raw_win_rate():
    rng = np.random.default_rng(1)
    (ali, ref), (ali_len, ref_len) = _policies(rng, 200, 4, length_gain=0, quality_gain=0.8)
    result = lc_win_rate(
        _outputs(ali, ali_len), _outputs(ref, ref_len), "rewards", shared_keys=True, **BOOTSTRAP
    )
    assert result["raw"] > 0.65 and result["value"] == pytest.approx(result["raw"], abs=0.02)
    assert result["low"] <= result["value"] <= result["high"]


def test_the_fit_stays_finite_when_one_policy_wins_every_pair():
    outcome, difference = np.ones(50), np.linspace(-5, 5, 50)
    b0, b1 = length_control.fit(outcome, difference)
    # The weak ridge shrinks a little: 50 wins of 50 give 0.94 (thousands of pairs: ~1).
    assert np.isfinite([b0, b1]).all() and 1 / (1 + np.exp(-b0)) > 0.9
    # A tie counts half: all ties, no length effect, 0.5.
    b0, _ = length_control.fit(np.full(40, 0.5), np.zeros(40))
    assert b0 == pytest.approx(0.0, abs=1e-9)
    assert independent_pairs(2, 2, shared_keys=True).sum() == 2
