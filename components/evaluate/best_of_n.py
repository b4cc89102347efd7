"""The best-of-n baseline: n reference samples, the judge keeps the best (NumPy, pure).

Its KL to the reference is exact for the judge's score levels (Beirami et al. 2024), with
the familiar log n − (n − 1)/n (Gao et al. 2022) beside it as the bound it is; the aligned
policy's gold gain is compared with best-of-n's at the same KL (``ppo_vs_best_of_n``).
Arrays are [prompts, samples], as in measures.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike


def best_of_n_kl_bound(n: int) -> float:
    """log n − (n − 1)/n nats per sequence (Gao et al. 2022): best-of-n's KL when the judge's
    scores never tie, and an upper bound of it otherwise (Beirami et al. 2024, Theorem 1)."""
    if n < 1:
        raise ValueError(f"best-of-n: n = {n} must be at least 1")
    return math.log(n) - (n - 1) / n


def best_of_n_kl(scores: ArrayLike, n: int) -> float:
    """KL(best-of-n ‖ reference) in nats per sequence, mean over prompts, from [P, N] draws.

    Best-of-n keeps the sample of highest score, the first of tied ones, so within one score
    level it draws as the reference does, and only the levels' probabilities change: a level
    of probability q_k under the reference, with F_k the probability of a score ≤ its own,
    wins with p_k = F_k^n − F_{k−1}^n, and the KL is Σ_k p_k log(p_k / q_k) (Beirami et al.,
    "Theoretical guarantees on the best-of-n alignment policy", 2024, Lemma 1). Each prompt's
    q is the empirical distribution of its N draws' scores (the plug-in estimator; identical
    responses, and any judge that takes few values, make levels). It never exceeds the bound
    ``best_of_n_kl_bound``; with N distinct scores it lies just below it (at n = N = 16,
    1.794 against 1.835 nats), and with few levels near the true value, 0.693 nats for two
    equally likely levels at n = 16.
    """
    draws = np.asarray(scores, np.float64)
    if draws.ndim != 2 or draws.shape[1] == 0:
        raise ValueError(f"best-of-n KL needs [prompts, samples] scores; got {draws.shape}")
    if n < 1:
        raise ValueError(f"best-of-n: n = {n} must be at least 1")
    kls = []
    for row in draws:
        _, counts = np.unique(row, return_counts=True)  # levels in ascending order of score
        q = counts / row.size
        cdf = np.minimum(np.cumsum(q), 1.0)
        p = np.diff(cdf**n, prepend=0.0)
        won = p > 0
        kls.append(float(np.sum(p[won] * np.log(p[won] / q[won]))))
    return float(np.mean(kls))


def best_of_n_choice(rewards: ArrayLike, n: int) -> np.ndarray:
    """Per prompt, the index of the highest reward among its first ``n`` samples (first on ties)."""
    scores = np.asarray(rewards, np.float64)
    if scores.ndim != 2 or not 1 <= n <= scores.shape[1]:
        raise ValueError(
            f"best-of-{n} needs [prompts, samples] rewards with at least {n} samples per "
            f"prompt; got shape {scores.shape}"
        )
    return np.argmax(scores[:, :n], axis=1)


def best_of_n(
    rewards: ArrayLike, gold: ArrayLike | None, sizes: Sequence[int]
) -> list[dict[str, Any]]:
    """Per n: KL per sequence (exact, and the bound) and the mean judge's and gold score of
    the picks [P, N].

    ``rewards`` (the judge's: the reward model's, or the gold reward's when it is the judge,
    which makes this the oracle baseline) pick, for each prompt, the best of the prompt's
    first n samples of the reference; ``gold`` (like ``rewards``, or None) is read at the
    same picks. The KL reads all N draws of a prompt: they estimate the reference's
    distribution of scores, whatever n.
    """
    scores = np.asarray(rewards, np.float64)
    gold_scores_ = None if gold is None else np.asarray(gold, np.float64)
    if gold_scores_ is not None and gold_scores_.shape != scores.shape:
        raise ValueError(
            f"best-of-n gold scores {gold_scores_.shape} differ from rewards {scores.shape}; "
            "score the same samples"
        )
    rows = np.arange(len(scores))
    frontier = []
    for n in sorted(sizes):
        pick = best_of_n_choice(scores, n)
        frontier.append(
            {
                "n": int(n),
                "kl_per_sequence": best_of_n_kl(scores, n),
                "kl_bound": best_of_n_kl_bound(n),
                "reward": float(np.mean(scores[rows, pick])),
                "gold": None if gold_scores_ is None else float(np.mean(gold_scores_[rows, pick])),
            }
        )
    return frontier


def gain_at_kl(kls: ArrayLike, gains: ArrayLike, kl: float) -> tuple[float, bool]:
    """``gains`` linearly interpolated in KL at ``kl``, and whether ``kl`` lay beyond the last.

    KLs must not decrease. Points of equal KL (best-of-n's when every draw of every prompt
    ties: all KLs 0) count as one, at the highest of their gains, which favours the baseline.
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


def ppo_vs_best_of_n(
    frontier: Sequence[dict[str, Any]],
    *,
    aligned_gain: float | None,
    aligned_kl: float,
    kl_key: str = "kl_per_sequence",
) -> dict[str, Any]:
    """The aligned policy's gold gain over best-of-n's gold gain at the aligned policy's KL.

    Best-of-n's gains are over best-of-1 (the reference's own samples); ``aligned_kl`` is in
    nats per sequence, and best-of-n's points sit at their ``kl_key`` (the exact KL; the
    bound ``kl_bound`` places them further right, which flatters the aligned policy).
    ``ratio`` is None without a gold reward or where best-of-n gains nothing (≤ 0) at that
    KL; ``capped`` says the KL exceeded the largest n's.
    """
    golds = [point["gold"] for point in frontier]
    if aligned_gain is None or not frontier or any(gold is None for gold in golds):
        return {"ratio": None, "capped": None, "aligned_gain": aligned_gain, "best_of_n_gain": None}
    if frontier[0]["n"] != 1:
        raise ValueError("the best-of-n frontier must start at n = 1, the baseline of every gain")
    kls = [point[kl_key] for point in frontier]
    gain, capped = gain_at_kl(kls, np.asarray(golds) - golds[0], aligned_kl)
    ratio = aligned_gain / gain if gain > 0 else None
    return {"ratio": ratio, "capped": capped, "aligned_gain": aligned_gain, "best_of_n_gain": gain}


@dataclasses.dataclass(frozen=True, slots=True)
class BestOfNDraws:
    """The reference's samples drawn for the best-of-n baseline, scored."""

    rewards: ArrayLike  # [P, N]: the judge's score of each sample (reward model or gold)
    gold_rewards: ArrayLike | None = None  # [P, N], when a gold reward is known


def summary_part(
    draws: BestOfNDraws | None,
    sizes: Sequence[int],
    gold: dict[str, Any] | None,
    aligned_kl: float,
) -> dict[str, Any]:
    """The summary's best_of_n frontier and ppo_vs_best_of_n (ratio, capped, both gains), and
    the ratio on the bound's KLs."""
    if draws is None or not sizes:
        return {
            "best_of_n": None,
            "ppo_vs_best_of_n": None,
            "ppo_vs_best_of_n_capped": None,
            "ppo_vs_best_of_n_gains": None,
            "ppo_vs_best_of_n_bound": None,
        }
    frontier = best_of_n(draws.rewards, draws.gold_rewards, sizes)
    aligned_gain = None if gold is None else gold["difference"]["value"]
    versus = ppo_vs_best_of_n(frontier, aligned_gain=aligned_gain, aligned_kl=aligned_kl)
    by_bound = ppo_vs_best_of_n(
        frontier, aligned_gain=aligned_gain, aligned_kl=aligned_kl, kl_key="kl_bound"
    )
    gains = None
    if versus["best_of_n_gain"] is not None:
        gains = {"aligned": versus["aligned_gain"], "best_of_n": versus["best_of_n_gain"]}
    return {
        "best_of_n": frontier,
        "ppo_vs_best_of_n": versus["ratio"],
        "ppo_vs_best_of_n_capped": versus["capped"],
        "ppo_vs_best_of_n_gains": gains,
        # The ratio with best-of-n placed at the bound: how much the bound would flatter.
        "ppo_vs_best_of_n_bound": by_bound["ratio"],
    }
