"""The length-controlled win rate: the win rate at equal response lengths.

A judge that prefers longer responses (reward models do: Singhal et al. 2023) makes a policy
that learnt to write more look better than it is. AlpacaEval 2 (Dubois et al. 2024) fits a
logistic model of the judge's preference with a length term and reports the win rate with
that term at zero. The model fitted here, over the independent (aligned, reference) pairs of
each prompt (``measures.independent_pairs``)::

    logit P(aligned wins) = b0 + b1 · tanh(Δlen / sd(Δlen))

Δlen is the aligned response's length minus the reference's, in tokens (EOS included), sd its
standard deviation over the pairs; a tie counts as half a win (a fractional target).
AlpacaEval 2 counts characters (``str.len()`` of each output); tokens here, since both
policies share one tokenizer and the judge, a reward model, reads tokens. On the built-in
task the two agreed (a bench_overoptimisation screen whose annotators credited characters:
within 0.03 of each other at every save, 2026-12-06). The LC win rate is sigmoid(b0).
AlpacaEval 2's instruction-difficulty term is left out: both policies answer the same
prompts, so it would only add one parameter per prompt. A weak ridge (0.5·(b0² + b1²))
keeps the fit finite when one policy wins every pair. The interval is the percentile
bootstrap over prompts, as the other figures'.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from components.evaluate.bootstrap import bootstrap_interval

MODEL = "logistic: logit P(win) = b0 + b1·tanh(Δlen / sd(Δlen)); LC win rate = sigmoid(b0)"
RIDGE = 1.0
NEWTON_STEPS = 50


def fit(outcome: np.ndarray, length_difference: np.ndarray) -> tuple[float, float]:
    """(b0, b1) of the module's model by Newton's method (targets in [0, 1])."""
    scale = float(np.std(length_difference))
    x = np.tanh(length_difference / scale) if scale > 0 else np.zeros_like(length_difference)
    design = np.stack([np.ones_like(x), x], axis=1)
    beta = np.zeros(2)
    for _ in range(NEWTON_STEPS):
        p = 1.0 / (1.0 + np.exp(-(design @ beta)))
        gradient = design.T @ (outcome - p) - RIDGE * beta
        hessian = (design * (p * (1 - p))[:, None]).T @ design + RIDGE * np.eye(2)
        step = np.linalg.solve(hessian, gradient)
        beta += step
        if np.max(np.abs(step)) < 1e-10:
            break
    return float(beta[0]), float(beta[1])


def _pairs(
    a: np.ndarray, r: np.ndarray, a_len: np.ndarray, r_len: np.ndarray, mask: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Outcomes (1, ½, 0) and length differences of every independent, scored pair."""
    outcome = (a[:, :, None] > r[:, None, :]) + 0.5 * (a[:, :, None] == r[:, None, :])
    difference = a_len[:, :, None] - r_len[:, None, :]
    keep = mask[None] & ~np.isnan(a)[:, :, None] & ~np.isnan(r)[:, None, :]
    return outcome[keep].astype(np.float64), difference[keep].astype(np.float64)


def _lc_win_rate(a, r, a_len, r_len, mask) -> float:
    outcome, difference = _pairs(a, r, a_len, r_len, mask)
    if outcome.size == 0:
        return math.nan
    b0, _ = fit(outcome, difference)
    return 1.0 / (1.0 + math.exp(-b0))


def length_controlled_win_rate(
    aligned_rewards: ArrayLike,
    reference_rewards: ArrayLike,
    aligned_lengths: ArrayLike,
    reference_lengths: ArrayLike,
    *,
    pairs: np.ndarray,
    n_resamples: int,
    confidence: float,
    seed: int,
) -> dict[str, Any]:
    """The LC win rate of [P, S] aligned and [P, N] reference samples (their judge's scores
    and lengths) over the [S, N] ``pairs`` mask, with its interval, the raw win rate of the
    same pairs, the length coefficient b1 and the model it fitted."""
    a, r = np.asarray(aligned_rewards, np.float64), np.asarray(reference_rewards, np.float64)
    a_len = np.asarray(aligned_lengths, np.float64).reshape(a.shape)
    r_len = np.asarray(reference_lengths, np.float64).reshape(r.shape)
    outcome, difference = _pairs(a, r, a_len, r_len, pairs)
    b0, b1 = fit(outcome, difference) if outcome.size else (math.nan, math.nan)

    def statistic(*rows: np.ndarray) -> float:
        return _lc_win_rate(*rows, pairs)

    low, high = bootstrap_interval(
        statistic, a, r, a_len, r_len, n_resamples=n_resamples, confidence=confidence, seed=seed
    )
    return {
        "value": 1.0 / (1.0 + math.exp(-b0)) if math.isfinite(b0) else math.nan,
        "low": low,
        "high": high,
        "raw": float(np.mean(outcome)) if outcome.size else math.nan,
        "length_coefficient": b1,
        "mean_length_difference": float(np.mean(difference)) if difference.size else math.nan,
        "pairs": int(outcome.size),
        "model": MODEL,
    }
