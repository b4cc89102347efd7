"""Evaluation measures on arrays of rewards, log-probs and masks (NumPy, pure functions).

Conventions shared by every function here:

- "aligned" is the policy under evaluation (PPO's output) and "reference" the one it started
  from; paired arrays are indexed by prompt: element i of both belongs to prompt i. Paired
  [P, S] arrays hold S samples per prompt, sample s of one policy paired with sample s of the
  other (drawn with the same key).
- Masks are [..., T], non-zero on response tokens (EOS included, as the sampler emits them);
  values at masked positions are never read, so padding may hold garbage.
- Intervals are percentile bootstraps over prompts, the independent unit: each resample draws
  prompt indices with replacement and applies them jointly to every paired array.
- Dict results are JSON-ready (plain floats and ints), so ``summarize`` composes them into
  the one dict that both the report and ``eval.json`` show.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from components.core.data.gold import GoldReward, resolve_gold_reward
from components.evaluate.config import EvalConfig

SCHEMA_VERSION = 1
HISTOGRAM_BINS = 20
# Who scores the responses (win rate, rewards, best-of-n selection): the learned reward
# model, or, when none is given, the gold reward itself.
JUDGE_REWARD_MODEL = "reward_model"
JUDGE_GOLD = "gold"
JUDGES = (JUDGE_REWARD_MODEL, JUDGE_GOLD)


def _paired(aligned: ArrayLike, reference: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Both arrays as float64, checked to be [P] or [P, S], non-empty and of one shape."""
    a = np.asarray(aligned, np.float64)
    r = np.asarray(reference, np.float64)
    if a.ndim not in (1, 2) or a.shape != r.shape:
        raise ValueError(
            f"paired values must be arrays of one shape, [prompts] or [prompts, samples]; "
            f"got shapes {a.shape} and {r.shape}"
        )
    if a.size == 0:
        raise ValueError("paired values are empty: evaluate at least one prompt")
    return a, r


def win_rate(aligned_rewards: ArrayLike, reference_rewards: ArrayLike) -> float:
    """Share of paired comparisons aligned wins, a tie counting half: (wins + ties/2) / pairs.

    [P] arrays compare prompt by prompt; [P, S] arrays compare sample s with sample s, so
    every prompt weighs the same and more samples narrow the interval of the same quantity.
    """
    a, r = _paired(aligned_rewards, reference_rewards)
    if np.isnan(a).any() or np.isnan(r).any():
        # A NaN compares as neither win nor tie; counting it as a loss would hide a broken reward.
        return math.nan
    return float((np.sum(a > r) + 0.5 * np.sum(a == r)) / a.size)


def reward_model_accuracy(chosen_rewards: ArrayLike, rejected_rewards: ArrayLike) -> float:
    """Share of preference pairs the reward model orders as the labels do, a tie counting half."""
    return win_rate(chosen_rewards, rejected_rewards)


def bootstrap_interval(
    statistic_fn: Callable[..., float],
    *arrays: ArrayLike,
    n_resamples: int,
    confidence: float,
    seed: int,
) -> tuple[float, float]:
    """Percentile-bootstrap (low, high) of ``statistic_fn(*arrays)``, resampling indices jointly."""
    columns = [np.asarray(array) for array in arrays]
    if not columns or len(columns[0]) == 0:
        raise ValueError("bootstrap_interval needs at least one non-empty array")
    n = len(columns[0])
    if any(len(column) != n for column in columns):
        raise ValueError(
            f"paired arrays differ in length: {[len(c) for c in columns]}; pass one row per prompt"
        )
    if n_resamples < 1:
        raise ValueError(f"n_resamples: {n_resamples} must be at least 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: {confidence} must be in (0, 1), e.g. 0.95")
    rng = np.random.default_rng(seed)
    stats = np.empty(n_resamples, np.float64)
    for i in range(n_resamples):  # one index draw at a time keeps memory O(n)
        rows = rng.integers(0, n, size=n)
        stats[i] = statistic_fn(*(column[rows] for column in columns))
    if np.isnan(stats).any():
        return math.nan, math.nan
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return float(low), float(high)


def win_rate_with_interval(
    aligned_rewards: ArrayLike,
    reference_rewards: ArrayLike,
    *,
    n_resamples: int,
    confidence: float,
    seed: int,
) -> dict[str, float | int]:
    """The win rate, its bootstrap interval (over prompts) and the win/tie/loss counts."""
    a, r = _paired(aligned_rewards, reference_rewards)
    low, high = bootstrap_interval(
        win_rate, a, r, n_resamples=n_resamples, confidence=confidence, seed=seed
    )
    return {
        "value": win_rate(a, r),
        "low": low,
        "high": high,
        "wins": int(np.sum(a > r)),
        "ties": int(np.sum(a == r)),
        "losses": int(np.sum(a < r)),
    }


def location(values: ArrayLike) -> dict[str, float]:
    """Mean and median of ``values``."""
    array = np.asarray(values, np.float64).reshape(-1)
    if array.size == 0:
        return {"mean": math.nan, "median": math.nan}
    return {"mean": float(np.mean(array)), "median": float(np.median(array))}


def _mean_difference(a: np.ndarray, r: np.ndarray) -> float:
    return float(np.mean(a - r))


def paired_difference(
    aligned: ArrayLike,
    reference: ArrayLike,
    *,
    n_resamples: int,
    confidence: float,
    seed: int,
) -> dict[str, dict[str, float]]:
    """Each policy's mean and median, and the mean of aligned − reference with its interval."""
    a, r = _paired(aligned, reference)
    low, high = bootstrap_interval(
        _mean_difference, a, r, n_resamples=n_resamples, confidence=confidence, seed=seed
    )
    return {
        "aligned": location(a),
        "reference": location(r),
        "difference": {"value": _mean_difference(a, r), "low": low, "high": high},
    }


def log_ratio_sums(
    aligned_logprobs: ArrayLike, reference_logprobs: ArrayLike, mask: ArrayLike
) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence (the leading dims of [..., T]): Σ_t (log p_aligned − log p_ref) over its
    response tokens, and how many there are: each sample's k1 KL, and its weight per token."""
    logp = np.asarray(aligned_logprobs, np.float64)
    ref_logp = np.asarray(reference_logprobs, np.float64)
    real = np.asarray(mask) != 0
    if not logp.shape == ref_logp.shape == real.shape or logp.ndim < 1:
        raise ValueError(
            f"log-probs and mask must share one [..., T] shape; got {logp.shape}, "
            f"{ref_logp.shape} and {real.shape}"
        )
    # `where=` skips padding entirely, so garbage such as inf − inf never becomes a NaN.
    log_ratio = np.subtract(logp, ref_logp, out=np.zeros_like(logp), where=real)
    return log_ratio.sum(axis=-1), real.sum(axis=-1)


def sequence_kl(
    aligned_logprobs: ArrayLike, reference_logprobs: ArrayLike, mask: ArrayLike
) -> dict[str, float]:
    """KL(aligned ‖ reference) in nats, estimated on aligned samples: per sequence and per token.

    ``aligned_logprobs`` and ``reference_logprobs`` are [..., T] log-probs of the tokens the
    aligned policy sampled, under each policy. ``per_sequence`` is the mean over sequences of
    Σ_t (log p_aligned − log p_ref) over response tokens; ``per_token`` is the sum over every
    response token divided by their count. This k1 estimator is unbiased but noisy (a small
    sample can give a negative value); identical policies give exactly 0.
    """
    per_sequence, tokens = log_ratio_sums(aligned_logprobs, reference_logprobs, mask)
    num_tokens = int(tokens.sum())
    if num_tokens == 0:
        raise ValueError("mask has no response tokens: the KL needs at least one sampled token")
    return {
        "per_sequence": float(np.mean(per_sequence)),
        "per_token": float(per_sequence.sum() / num_tokens),
    }


def response_lengths(mask: ArrayLike) -> np.ndarray:
    """Response tokens (EOS included) of each response of a [..., T] mask, flattened to [N]."""
    real = np.asarray(mask) != 0
    return real.reshape(-1, real.shape[-1]).sum(axis=-1)


def ends_with_eos(tokens: ArrayLike, mask: ArrayLike, eos_id: int) -> np.ndarray:
    """Whether each response's last real token (of a prefix mask) is EOS, flattened to [N]."""
    tokens = np.asarray(tokens)
    real = np.asarray(mask) != 0
    tokens = tokens.reshape(-1, tokens.shape[-1])
    real = real.reshape(-1, real.shape[-1])
    last = np.maximum(real.sum(axis=-1) - 1, 0)
    has_token = real.any(axis=-1)
    return has_token & (tokens[np.arange(len(tokens)), last] == eos_id)


def eos_rate(ended_with_eos: ArrayLike) -> float:
    """Share of responses that stopped at EOS."""
    flags = np.asarray(ended_with_eos, bool).reshape(-1)
    return float(flags.mean()) if flags.size else math.nan


def gold_scores(
    reward: str | GoldReward, prompts: Sequence[str], responses: Sequence[str]
) -> np.ndarray:
    """The gold reward (a spec for core.data.gold, or its function) of each pair, as float64 [N]."""
    if len(prompts) != len(responses):
        raise ValueError(
            f"{len(prompts)} prompts but {len(responses)} responses: pass one prompt per "
            "response (repeat a prompt for each of its samples)"
        )
    reward_fn = resolve_gold_reward(reward) if isinstance(reward, str) else reward
    return np.array([reward_fn(p, r) for p, r in zip(prompts, responses, strict=True)], np.float64)


def gold_win_rate(
    reward: str | GoldReward,
    prompts: Sequence[str],
    aligned: Sequence[str],
    reference: Sequence[str],
) -> float:
    """Win rate of the aligned responses over the reference ones under the gold reward."""
    return win_rate(gold_scores(reward, prompts, aligned), gold_scores(reward, prompts, reference))


def reward_histogram(
    aligned: ArrayLike, reference: ArrayLike, bins: int = HISTOGRAM_BINS
) -> dict[str, list[float] | list[int]]:
    """Counts of both policies' finite rewards over shared bin edges."""
    a = np.asarray(aligned, np.float64).reshape(-1)
    r = np.asarray(reference, np.float64).reshape(-1)
    a, r = a[np.isfinite(a)], r[np.isfinite(r)]
    both = np.concatenate([a, r])
    if both.size == 0:
        return {"bin_edges": [], "aligned": [], "reference": []}
    edges = np.histogram_bin_edges(both, bins=bins)
    return {
        "bin_edges": [float(e) for e in edges],
        "aligned": [int(c) for c in np.histogram(a, edges)[0]],
        "reference": [int(c) for c in np.histogram(r, edges)[0]],
    }


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


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyOutputs:
    """What one policy produced on the eval prompts, as arrays."""

    rewards: ArrayLike  # [P] or [P, S]: the judge's score of each response
    response_mask: ArrayLike  # [..., T]: non-zero on response tokens, EOS included
    ended_with_eos: ArrayLike  # [...]: whether each response stopped at EOS
    gold_rewards: ArrayLike | None = None  # like rewards, when a gold reward is known


def per_prompt(rewards: ArrayLike) -> np.ndarray:
    """[P] rewards as they are, or [P, S] samples averaged per prompt."""
    array = np.asarray(rewards, np.float64)
    if array.ndim == 2:
        return array.mean(axis=1)
    if array.ndim != 1:
        raise ValueError(f"rewards must be [prompts] or [prompts, samples]; got {array.shape}")
    return array


def summarize(
    aligned: PolicyOutputs,
    reference: PolicyOutputs,
    *,
    aligned_logprobs: ArrayLike,
    reference_logprobs: ArrayLike,
    config: EvalConfig,
    chosen_rewards: ArrayLike | None = None,
    rejected_rewards: ArrayLike | None = None,
    gold_name: str = "",
    best_of_n_draws: BestOfNDraws | None = None,
    judge: str = JUDGE_REWARD_MODEL,
) -> dict[str, Any]:
    """Every measure in one JSON-ready dict: what eval.json holds and the report shows.

    Win rates pair sample s of each policy per prompt; reward differences compare per-prompt
    means; the bootstrap resamples prompts. ``aligned_logprobs``/``reference_logprobs`` score
    the aligned samples' tokens (masked by ``aligned.response_mask``); chosen/rejected
    rewards are the reward model's scores of held-out preference pairs; ``best_of_n_draws``
    are the reference's samples for the best-of-n baseline (``config.best_of_n_sizes()``).
    ``judge`` says whose scores ``rewards`` are: the reward model's, or the gold reward's
    (``JUDGE_GOLD``, when no reward model was given). Optional parts are None when not given.
    """
    if judge not in JUDGES:
        raise ValueError(f"judge: {judge!r} must be one of {', '.join(JUDGES)}")
    bootstrap = {
        "n_resamples": config.bootstrap_samples,
        "confidence": config.confidence,
        "seed": config.seed,
    }
    a_rewards, r_rewards = per_prompt(aligned.rewards), per_prompt(reference.rewards)
    rm_accuracy = None
    if chosen_rewards is not None and rejected_rewards is not None:
        chosen, rejected = _paired(chosen_rewards, rejected_rewards)
        rm_accuracy = {
            "value": reward_model_accuracy(chosen, rejected),
            "num_pairs": int(chosen.size),
        }
    gold = None
    if aligned.gold_rewards is not None and reference.gold_rewards is not None:
        a_gold, r_gold = per_prompt(aligned.gold_rewards), per_prompt(reference.gold_rewards)
        gold = {
            "name": gold_name,
            **paired_difference(a_gold, r_gold, **bootstrap),
            "win_rate": win_rate_with_interval(
                aligned.gold_rewards, reference.gold_rewards, **bootstrap
            ),
        }
    kl = sequence_kl(aligned_logprobs, reference_logprobs, aligned.response_mask)
    return {
        "schema_version": SCHEMA_VERSION,
        "judge": judge,
        "num_prompts": int(a_rewards.size),
        "samples_per_prompt": config.samples_per_prompt,
        "confidence": config.confidence,
        "bootstrap_samples": config.bootstrap_samples,
        "win_rate": win_rate_with_interval(aligned.rewards, reference.rewards, **bootstrap),
        "reward": paired_difference(a_rewards, r_rewards, **bootstrap),
        "reward_histogram": reward_histogram(a_rewards, r_rewards),
        "kl": kl,
        "response_length": {
            "aligned": location(response_lengths(aligned.response_mask)),
            "reference": location(response_lengths(reference.response_mask)),
        },
        "eos_rate": {
            "aligned": eos_rate(aligned.ended_with_eos),
            "reference": eos_rate(reference.ended_with_eos),
        },
        "reward_model_accuracy": rm_accuracy,
        "gold": gold,
        **_best_of_n_part(best_of_n_draws, config.best_of_n_sizes(), gold, kl["per_sequence"]),
    }


def _best_of_n_part(
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
