"""The best-of-n baseline: n reference samples, the judge keeps the best (NumPy, pure).

Every figure reads all N draws of a prompt as the reference's distribution (the plug-in
estimate): with the draws ordered by the judge's score, best-of-n picks a score level of
share q_k, and ≤-share F_k, with probability p_k = F_k^n − F_{k−1}^n, its draws alike
(ties shared). That holds for any real n ≥ 1, so best-of-n's expected score and gold and
its KL to the reference, Σ_k p_k log(p_k / q_k) (Beirami et al. 2024, Lemma 1), are exact
functions of n: no chord between measured n, whose straight line from n = 1 lies below
best-of-n's concave curve (gain grows roughly as √KL) and undercredits it where an aligned
policy's KL usually falls, between n = 1 and n = 2. n = 1 is the mean over all the draws,
the baseline of every gain (not the first draw: same expectation, less noise).

The aligned policy is compared at its own KL: the n whose KL equals it is solved for, and
``ppo_vs_best_of_n`` is the aligned gold gain over best-of-n's gold gain at that n, with a
percentile-bootstrap interval over prompts (aligned gain, aligned KL and draws resampled
together). The familiar log n − (n − 1)/n (Gao et al. 2022) stays beside it as the bound it
is, and the chord's ratio as what the old reading gave. Arrays are [prompts, samples], as
in measures.py. With replacement, best-of-n from N draws is the best of n from the
empirical distribution: for n well below N (aligned policies sit near n = 2 of N = 16) it
is close to the best of n fresh draws; at n = N it reads lower, for KL and gain alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

# The bootstrap reads each resample's curve on this many log-spaced n (the point estimate
# solves exactly); between grid points the curve's relative error is below 1e-5.
_CURVE_GRID = 512
_BISECTIONS = 60
# Points of the curve the summary keeps for the report's plot (log-spaced n from 1).
CURVE_POINTS = 25


def best_of_n_kl_bound(n: float) -> float:
    """log n − (n − 1)/n nats per sequence (Gao et al. 2022): best-of-n's KL when the judge's
    scores never tie, and an upper bound of it otherwise (Beirami et al. 2024, Theorem 1)."""
    if n < 1:
        raise ValueError(f"best-of-n: n = {n} must be at least 1")
    return math.log(n) - (n - 1) / n


class ScoreLevels(NamedTuple):
    """Each prompt's draws grouped by the judge's score, ascending, padded to N levels."""

    cdf: np.ndarray  # [P, N] F_k: share of draws scoring at most level k (1 on padding)
    share: np.ndarray  # [P, N] q_k: share of draws at level k (0 on padding)
    reward: np.ndarray  # [P, N] the level's score (0 on padding)
    gold: np.ndarray | None  # [P, N] the mean gold of the level's draws (0 on padding)


def score_levels(rewards: ArrayLike, gold: ArrayLike | None = None) -> ScoreLevels:
    """The score levels of [P, N] draws (and the mean ``gold`` [P, N] of each level)."""
    scores = np.asarray(rewards, np.float64)
    if scores.ndim != 2 or scores.shape[1] == 0:
        raise ValueError(f"best-of-n needs [prompts, samples] scores; got {scores.shape}")
    golds = None if gold is None else np.asarray(gold, np.float64)
    if golds is not None and golds.shape != scores.shape:
        raise ValueError(
            f"best-of-n gold scores {golds.shape} differ from rewards {scores.shape}; "
            "score the same samples"
        )
    prompts, draws = scores.shape
    counts = np.zeros((prompts, draws))
    level_scores = np.zeros((prompts, draws))
    level_gold = np.zeros((prompts, draws))
    for p, row in enumerate(scores):
        values, inverse, count = np.unique(row, return_inverse=True, return_counts=True)
        counts[p, : values.size], level_scores[p, : values.size] = count, values
        if golds is not None:
            level_gold[p, : values.size] = np.bincount(inverse, golds[p]) / count
    # Integer counts over N: the last level's cdf is exactly 1, so padding weighs exactly 0.
    return ScoreLevels(
        np.cumsum(counts, axis=1) / draws, counts / draws, level_scores,
        None if golds is None else level_gold,
    )  # fmt: skip


def level_weights(levels: ScoreLevels, n: ArrayLike) -> np.ndarray:
    """p_k = F_k^n − F_{k−1}^n, best-of-n's probability of each level: [*n.shape, P, N]."""
    power = np.asarray(n, np.float64)[..., None, None]
    previous = np.concatenate([np.zeros_like(levels.cdf[:, :1]), levels.cdf[:, :-1]], axis=1)
    return levels.cdf**power - previous**power


class Curve(NamedTuple):
    """Best-of-n per prompt at some n: KL per sequence, expected score and gold, [..., P]."""

    kl: np.ndarray
    reward: np.ndarray
    gold: np.ndarray | None


def curve(levels: ScoreLevels, n: ArrayLike) -> Curve:
    """Best-of-n's exact per-prompt KL, score and gold at every (real) n of ``n``."""
    p = level_weights(levels, n)
    q = np.where(levels.share > 0, levels.share, 1.0)
    terms = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0) / q), 0.0)
    gold = None if levels.gold is None else np.sum(p * levels.gold, axis=-1)
    return Curve(np.sum(terms, axis=-1), np.sum(p * levels.reward, axis=-1), gold)


def best_of_n_kl(scores: ArrayLike, n: float) -> float:
    """KL(best-of-n ‖ reference) in nats per sequence, mean over prompts, from [P, N] draws.

    Exact for the plug-in reference (each prompt's N draws; identical responses, and any
    judge that takes few values, make levels). It never exceeds ``best_of_n_kl_bound``; with
    N distinct scores it lies just below it (at n = N = 16, 1.794 against 1.835 nats), and
    with few levels near the true value, 0.693 nats for two equally likely levels at n = 16.
    """
    if n < 1:
        raise ValueError(f"best-of-n: n = {n} must be at least 1")
    return float(np.mean(curve(score_levels(scores), n).kl))


def best_of_n(
    rewards: ArrayLike, gold: ArrayLike | None, sizes: Sequence[int]
) -> list[dict[str, Any]]:
    """Per n of ``sizes``: KL per sequence (exact, and the bound) and best-of-n's expected
    judge's and gold score, means over prompts of [P, N] draws.

    ``rewards`` (the judge's: the reward model's, or the gold reward's when it is the judge,
    which makes this the oracle baseline) select; ``gold`` (like ``rewards``, or None) is
    read at the same selection.
    """
    levels = score_levels(rewards, gold)
    frontier = []
    for n in sorted(sizes):
        point = curve(levels, n)
        frontier.append(
            {
                "n": int(n),
                "kl_per_sequence": float(np.mean(point.kl)),
                "kl_bound": best_of_n_kl_bound(n),
                "reward": float(np.mean(point.reward)),
                "gold": None if point.gold is None else float(np.mean(point.gold)),
            }
        )
    return frontier


def dense_curve(levels: ScoreLevels, n_max: float) -> list[dict[str, Any]]:
    """Best-of-n at ``CURVE_POINTS`` log-spaced real n in [1, ``n_max``]: what the report
    draws as best-of-n's curve (its table's n are points on it)."""
    sizes = np.exp(np.linspace(0.0, math.log(n_max), CURVE_POINTS))
    points = curve(levels, sizes)
    gold = [None] * sizes.size if points.gold is None else np.mean(points.gold, axis=-1)
    return [
        {"n": float(n), "kl_per_sequence": float(kl), "reward": float(reward),
         "gold": None if g is None else float(g)}
        for n, kl, reward, g in zip(
            sizes, np.mean(points.kl, axis=-1), np.mean(points.reward, axis=-1), gold, strict=True
        )
    ]  # fmt: skip


def n_at_kl(levels: ScoreLevels, kl: float, n_max: float) -> tuple[float, bool]:
    """The n in [1, ``n_max``] where best-of-n's mean KL per sequence is ``kl`` (bisection on
    log n: the KL rises with n), and whether ``kl`` lay beyond ``n_max``'s (n is n_max then)."""
    if kl <= 0:
        return 1.0, False
    if float(np.mean(curve(levels, n_max).kl)) < kl:
        return float(n_max), True
    low, high = 0.0, math.log(n_max)
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if float(np.mean(curve(levels, math.exp(middle)).kl)) < kl:
            low = middle
        else:
            high = middle
    return math.exp(high), False


def n_at_bound(kl: float, n_max: float) -> float:
    """The n in [1, ``n_max``] where the bound log n − (n − 1)/n equals ``kl``."""
    low, high = 0.0, math.log(n_max)
    if kl <= 0:
        return 1.0
    if best_of_n_kl_bound(n_max) < kl:
        return float(n_max)
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if best_of_n_kl_bound(math.exp(middle)) < kl else (low, middle)
    return math.exp(high)


def gain_at_kl(kls: ArrayLike, gains: ArrayLike, kl: float) -> tuple[float, bool]:
    """``gains`` linearly interpolated in KL at ``kl`` (the chord), and whether ``kl`` lay
    beyond the last point. Kept to show what the chord between measured n would read.

    KLs must not decrease. Points of equal KL count as one, at the highest of their gains.
    Beyond the last point the last gain is used (capped); below the first, the first.
    """
    x, y = np.asarray(kls, np.float64), np.asarray(gains, np.float64)
    if x.ndim != 1 or x.shape != y.shape or x.size == 0 or np.any(np.diff(x) < 0):
        raise ValueError(
            f"gain_at_kl needs matching 1-D KLs and gains, KLs not decreasing; got {x}, {y}"
        )
    points: list[list[float]] = []
    for kl_i, gain_i in zip(x, y, strict=True):
        if points and kl_i == points[-1][0]:
            points[-1][1] = max(points[-1][1], gain_i)
        else:
            points.append([kl_i, gain_i])
    px, py = np.array(points).T
    return float(np.interp(kl, px, py)), bool(kl > px[-1])


@dataclasses.dataclass(frozen=True, slots=True)
class BestOfNDraws:
    """The reference's samples drawn for the best-of-n baseline, scored."""

    rewards: ArrayLike  # [P, N]: the judge's score of each sample (reward model or gold)
    gold_rewards: ArrayLike | None = None  # [P, N], when a gold reward is known


@dataclasses.dataclass(frozen=True, slots=True)
class AlignedPoint:
    """The aligned policy per prompt: its gold gain over the reference and its KL."""

    gold_gain: ArrayLike  # [P] mean gold of the aligned samples − of the reference's
    kl_per_sequence: ArrayLike  # [P] mean KL per sequence of the aligned samples


def _ratio(aligned_gain: float, best_of_n_gain: float) -> float | None:
    """aligned / best-of-n gain, or None where best-of-n gains nothing (≤ 0)."""
    return aligned_gain / best_of_n_gain if best_of_n_gain > 0 else None


def ratio_interval(
    levels: ScoreLevels,
    aligned: AlignedPoint,
    *,
    n_max: float,
    n_resamples: int,
    confidence: float,
    seed: int,
) -> dict[str, float | int] | None:
    """Percentile-bootstrap interval of ``ppo_vs_best_of_n`` over prompts: each resample's
    aligned gain, aligned KL and best-of-n curve (on a log grid of n) from the same prompts.
    Resamples where best-of-n gains nothing have no ratio and are counted, not used."""
    if levels.gold is None:
        return None
    grid = np.exp(np.linspace(0.0, math.log(n_max), _CURVE_GRID))
    points = curve(levels, grid)  # [G, P]
    gains = np.asarray(aligned.gold_gain, np.float64)
    kls = np.asarray(aligned.kl_per_sequence, np.float64)
    prompts = gains.size
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, prompts, size=(n_resamples, prompts))
    weights = np.stack([np.bincount(row, minlength=prompts) for row in rows]) / prompts
    kl_curves, gold_curves = weights @ points.kl.T, weights @ points.gold.T  # [B, G]
    ratios = []
    for kl_curve, gold_curve, aligned_gain, aligned_kl in zip(
        kl_curves, gold_curves, weights @ gains, weights @ kls, strict=True
    ):
        # np.interp holds the last value beyond the grid: the cap at n_max, as the point's.
        gain = np.interp(aligned_kl, kl_curve, gold_curve) - gold_curve[0]
        ratio = _ratio(float(aligned_gain), float(gain))
        if ratio is not None:
            ratios.append(ratio)
    if not ratios:
        return None
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(ratios, [tail, 1.0 - tail])
    return {"low": float(low), "high": float(high), "undefined": n_resamples - len(ratios)}


def versus_aligned(
    levels: ScoreLevels, aligned_gain: float, aligned_kl: float, n_max: float
) -> dict[str, Any]:
    """Best-of-n at the aligned policy's KL on the exact curve: n, its gold gain, the ratio."""
    n, capped = n_at_kl(levels, aligned_kl, n_max)
    gold = curve(levels, np.array([1.0, n])).gold
    gain = float(np.mean(gold[1]) - np.mean(gold[0]))
    return {"n": n, "capped": capped, "best_of_n_gain": gain, "ratio": _ratio(aligned_gain, gain)}


def _empty_part() -> dict[str, Any]:
    keys = ("best_of_n", "best_of_n_curve", "best_of_n_at_kl", "ppo_vs_best_of_n",
            "ppo_vs_best_of_n_capped", "ppo_vs_best_of_n_gains", "ppo_vs_best_of_n_interval",
            "ppo_vs_best_of_n_chord", "ppo_vs_best_of_n_bound")  # fmt: skip
    return dict.fromkeys(keys)


def summary_part(
    draws: BestOfNDraws | None,
    sizes: Sequence[int],
    aligned: AlignedPoint | None,
    bootstrap: dict[str, Any],
) -> dict[str, Any]:
    """The summary's best-of-n part: the frontier at ``sizes``; best-of-n at the aligned KL
    on the exact curve (``best_of_n_at_kl``), the ratio of gold gains there with its interval;
    beside it the ratio on the chord through the frontier and with best-of-n at the bound's
    KL. ``aligned`` is None without a gold reward (no ratios then)."""
    if draws is None or not sizes:
        return _empty_part()
    levels = score_levels(draws.rewards, draws.gold_rewards)
    frontier = best_of_n(draws.rewards, draws.gold_rewards, sizes)
    n_max = float(max(max(sizes), np.asarray(draws.rewards).shape[1]))
    part = {**_empty_part(), "best_of_n": frontier, "best_of_n_curve": dense_curve(levels, n_max)}
    if aligned is None or levels.gold is None:
        return part
    aligned_gain = float(np.mean(aligned.gold_gain))
    aligned_kl = float(np.mean(aligned.kl_per_sequence))
    at_kl = versus_aligned(levels, aligned_gain, aligned_kl, n_max)
    chord, _ = gain_at_kl(
        [point["kl_per_sequence"] for point in frontier],
        [point["gold"] - frontier[0]["gold"] for point in frontier],
        aligned_kl,
    )
    n_bound = n_at_bound(aligned_kl, n_max)
    bound_gold = curve(levels, np.array([1.0, n_bound])).gold
    part.update(
        best_of_n_at_kl={"n": at_kl["n"], "kl_per_sequence": aligned_kl,
                         "gold_gain": at_kl["best_of_n_gain"]},
        ppo_vs_best_of_n=at_kl["ratio"],
        ppo_vs_best_of_n_capped=at_kl["capped"],
        ppo_vs_best_of_n_gains={"aligned": aligned_gain, "best_of_n": at_kl["best_of_n_gain"]},
        ppo_vs_best_of_n_interval=ratio_interval(levels, aligned, n_max=n_max, **bootstrap),
        # What the chord between the frontier's n reads (it undercredits best-of-n).
        ppo_vs_best_of_n_chord=_ratio(aligned_gain, chord),
        # Best-of-n placed at the bound's KL: how much the bound would flatter.
        ppo_vs_best_of_n_bound=_ratio(
            aligned_gain, float(np.mean(bound_gold[1]) - np.mean(bound_gold[0]))
        ),
    )  # fmt: skip
    return part
