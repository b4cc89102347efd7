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
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

from components.core.data.gold import GoldReward, resolve_gold_reward
from components.evaluate.best_of_n import (  # noqa: F401 (re-exported: measures is the API)
    AlignedPoint,
    BestOfNDraws,
    best_of_n,
    best_of_n_kl,
    best_of_n_kl_bound,
    gain_at_kl,
)
from components.evaluate.best_of_n import summary_part as best_of_n_summary
from components.evaluate.bootstrap import bootstrap_interval  # noqa: F401 (measures' API)
from components.evaluate.config import EvalConfig
from components.evaluate.judges import (  # noqa: F401 (re-exported: measures is the API)
    JUDGE_GOLD,
    JUDGE_REWARD_MODEL,
    JUDGES,
)
from components.evaluate.kl import log_ratio_sums, sequence_kl  # noqa: F401 (measures' API)
from components.evaluate.length_control import length_controlled_win_rate

SCHEMA_VERSION = 1
HISTOGRAM_BINS = 20


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

    [P] arrays compare element by element (e.g. a reward model's scores of chosen and
    rejected responses); [P, S] arrays compare sample s with sample s. For two policies'
    samples that is the coupled pairing: see :func:`independent_win_rate` for the win rate
    of independent draws.
    """
    a, r = _paired(aligned_rewards, reference_rewards)
    if np.isnan(a).any() or np.isnan(r).any():
        # A NaN compares as neither win nor tie; counting it as a loss would hide a broken reward.
        return math.nan
    return float((np.sum(a > r) + 0.5 * np.sum(a == r)) / a.size)


def _samples_by_prompt(aligned: ArrayLike, reference: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Both as float64 [P, S] and [P, N]: the same prompts, any number of samples each."""
    a = np.asarray(aligned, np.float64)
    r = np.asarray(reference, np.float64)
    a, r = (x[:, None] if x.ndim == 1 else x for x in (a, r))
    if a.ndim != 2 or r.ndim != 2 or len(a) != len(r):
        raise ValueError(
            f"samples must be [prompts] or [prompts, samples] arrays of the same prompts; got "
            f"shapes {np.shape(aligned)} and {np.shape(reference)}"
        )
    if a.size == 0 or r.size == 0:
        raise ValueError("no samples to compare: evaluate at least one prompt")
    return a, r


def independent_pairs(samples: int, draws: int, *, shared_keys: bool) -> np.ndarray:
    """[S, N] mask of the (aligned sample i, reference sample j) pairs of independent draws:
    every pair, but i == j when ``shared_keys`` (sample s of both policies drawn with one
    key: common random numbers, which couple the two responses)."""
    pairs = np.ones((samples, draws), bool)
    if shared_keys:
        diagonal = np.arange(min(samples, draws))
        pairs[diagonal, diagonal] = False
    if not pairs.any():
        raise ValueError(
            "one sample per policy drawn with one key leaves no independent pair: draw at "
            "least 2 samples of one policy (samples_per_prompt or best_of_n)"
        )
    return pairs


def win_shares(
    aligned_rewards: ArrayLike, reference_rewards: ArrayLike, *, shared_keys: bool = True
) -> np.ndarray:
    """Per prompt, the share of its independent (aligned, reference) pairs aligned wins, a
    tie counting half: the two-sample U-statistic of P(y > y′) + ½ P(y = y′), [P]."""
    a, r = _samples_by_prompt(aligned_rewards, reference_rewards)
    return _shares(a, r, _outcomes(a, r, shared_keys))


class _Outcomes(NamedTuple):
    """Each prompt's [P, S, N] comparisons and the [S, N] mask of its independent pairs."""

    above: np.ndarray
    equal: np.ndarray
    pairs: np.ndarray


def _outcomes(a: np.ndarray, r: np.ndarray, shared_keys: bool) -> _Outcomes:
    above, equal = a[:, :, None] > r[:, None, :], a[:, :, None] == r[:, None, :]
    return _Outcomes(
        above, equal, independent_pairs(a.shape[1], r.shape[1], shared_keys=shared_keys)
    )


def _shares(a: np.ndarray, r: np.ndarray, outcomes: _Outcomes) -> np.ndarray:
    """Per prompt, wins + ties / 2 over its independent pairs; NaN where a score is NaN."""
    won = np.sum((outcomes.above + 0.5 * outcomes.equal) * outcomes.pairs, axis=(1, 2))
    shares = won / outcomes.pairs.sum()
    broken = np.isnan(a).any(axis=1) | np.isnan(r).any(axis=1)
    return np.where(broken, math.nan, shares)  # a NaN is neither win nor tie: never a loss


def independent_win_rate(
    aligned_rewards: ArrayLike, reference_rewards: ArrayLike, *, shared_keys: bool = True
) -> float:
    """P(judge(y) > judge(y′)) + ½ P(=), y an aligned sample and y′ an independent reference
    sample of the same prompt: every prompt weighs the same (:func:`win_shares`)."""
    return float(np.mean(win_shares(aligned_rewards, reference_rewards, shared_keys=shared_keys)))


def reward_model_accuracy(chosen_rewards: ArrayLike, rejected_rewards: ArrayLike) -> float:
    """Share of preference pairs the reward model orders as the labels do, a tie counting half."""
    return win_rate(chosen_rewards, rejected_rewards)


def win_rate_with_interval(
    aligned_rewards: ArrayLike,
    reference_rewards: ArrayLike,
    *,
    n_resamples: int,
    confidence: float,
    seed: int,
    shared_keys: bool = True,
) -> dict[str, Any]:
    """The independent-pairs win rate (:func:`independent_win_rate`) of [P, S] aligned and
    [P, N] reference samples, its bootstrap interval over prompts, and the win/tie/loss
    counts of the pairs it compares. ``coupled`` beside it: the same-key pairs' (sample s
    with sample s) win rate and ties, which ``shared_keys`` sampling makes identical
    wherever the policies agree: a diagnostic, not the estimand."""
    a, r = _samples_by_prompt(aligned_rewards, reference_rewards)
    outcomes = _outcomes(a, r, shared_keys)
    shares = _shares(a, r, outcomes)
    low, high = bootstrap_interval(
        np.mean, shares, n_resamples=n_resamples, confidence=confidence, seed=seed
    )
    pairs, below = outcomes.pairs, a[:, :, None] < r[:, None, :]
    result: dict[str, Any] = {
        "value": float(np.mean(shares)),
        "low": low,
        "high": high,
        "pairing": "independent",
        "pairs": int(pairs.sum()) * len(a),
        "wins": int(np.sum(outcomes.above & pairs)),
        "ties": int(np.sum(outcomes.equal & pairs)),
        "losses": int(np.sum(below & pairs)),
        "coupled": None,
    }
    same = min(a.shape[1], r.shape[1])
    if shared_keys:
        coupled_a, coupled_r = a[:, :same], r[:, :same]
        result["coupled"] = {
            "value": win_rate(coupled_a, coupled_r),
            "ties": int(np.sum(coupled_a == coupled_r)),
            "pairs": int(coupled_a.size),
        }
    return result


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


def kl_estimator(config: EvalConfig) -> str:
    """k3 on sampled responses; k1 (the mean log-ratio) on greedy ones, which are no sample
    of the policy, so that no estimator of its KL applies to them."""
    return "k1" if config.greedy else "k3"


def response_lengths(mask: ArrayLike) -> np.ndarray:
    """Response tokens (EOS included) of each response of a [..., T] mask, flattened to [N]."""
    real = np.asarray(mask) != 0
    return real.reshape(-1, real.shape[-1]).sum(axis=-1)


def ends_with_eos(tokens: ArrayLike, mask: ArrayLike, eos_id: int | tuple[int, ...]) -> np.ndarray:
    """Whether each response's last real token (of a prefix mask) is a stop id (EOS, or one
    of the tokenizer's ``stop_ids``), flattened to [N]."""
    tokens = np.asarray(tokens)
    real = np.asarray(mask) != 0
    tokens = tokens.reshape(-1, tokens.shape[-1])
    real = real.reshape(-1, real.shape[-1])
    last = np.maximum(real.sum(axis=-1) - 1, 0)
    has_token = real.any(axis=-1)
    return has_token & np.isin(tokens[np.arange(len(tokens)), last], np.asarray(eos_id))


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

    Win rates compare every aligned sample with every independent reference draw of its
    prompt (the reference's best-of-n draws when given, which include ``reference``'s
    samples); reward and gold gains are differences of per-prompt means over the paired
    samples, where the common keys only cut the noise; the bootstrap resamples prompts.
    ``aligned_logprobs``/``reference_logprobs`` score the aligned samples' tokens (masked by
    ``aligned.response_mask``); chosen/rejected rewards are the reward model's scores of
    held-out preference pairs; ``best_of_n_draws`` are the reference's samples for the
    best-of-n baseline (``config.best_of_n_sizes()``). ``judge`` says whose scores
    ``rewards`` are: the reward model's, or the gold reward's (``JUDGE_GOLD``, when no
    reward model was given); ``gate_judge`` whose win rate the gate reads: gold's whenever
    it is measured. Optional parts are None when not given.
    """
    if judge not in JUDGES:
        raise ValueError(f"judge: {judge!r} must be one of {', '.join(JUDGES)}")
    bootstrap = {
        "n_resamples": config.bootstrap_samples,
        "confidence": config.confidence,
        "seed": config.seed,
    }
    draws = best_of_n_draws or BestOfNDraws(reference.rewards, reference.gold_rewards)
    a_rewards, r_rewards = per_prompt(aligned.rewards), per_prompt(reference.rewards)
    gold = _gold_part(
        aligned, reference, draws, gold_name, bootstrap, shared_keys=not config.greedy
    )
    estimator = kl_estimator(config)
    kl = sequence_kl(aligned_logprobs, reference_logprobs, aligned.response_mask, estimator)
    kl_sums, _ = log_ratio_sums(
        aligned_logprobs, reference_logprobs, aligned.response_mask, estimator
    )
    point = None
    if gold is not None:
        point = AlignedPoint(
            per_prompt(aligned.gold_rewards) - per_prompt(reference.gold_rewards),
            per_prompt(kl_sums),
        )
    return {
        "schema_version": SCHEMA_VERSION,
        "judge": judge,
        "gate_judge": JUDGE_GOLD if gold is not None or judge == JUDGE_GOLD else judge,
        "kl_estimator": estimator,
        "num_prompts": int(a_rewards.size),
        "samples_per_prompt": config.samples_per_prompt,
        "confidence": config.confidence,
        "bootstrap_samples": config.bootstrap_samples,
        "win_rate": win_rate_with_interval(
            aligned.rewards, draws.rewards, shared_keys=not config.greedy, **bootstrap
        ),
        "lc_win_rate": lc_win_rate(
            aligned, reference, "rewards", shared_keys=not config.greedy, **bootstrap
        ),
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
        "reward_model_accuracy": _accuracy_part(chosen_rewards, rejected_rewards),
        "gold": gold,
        **best_of_n_summary(best_of_n_draws, config.best_of_n_sizes(), point, bootstrap),
    }


def _accuracy_part(
    chosen_rewards: ArrayLike | None, rejected_rewards: ArrayLike | None
) -> dict[str, Any] | None:
    """The reward model's accuracy on held-out pairs, or None without them."""
    if chosen_rewards is None or rejected_rewards is None:
        return None
    chosen, rejected = _paired(chosen_rewards, rejected_rewards)
    return {"value": reward_model_accuracy(chosen, rejected), "num_pairs": int(chosen.size)}


def _gold_part(
    aligned: PolicyOutputs,
    reference: PolicyOutputs,
    draws: BestOfNDraws,
    name: str,
    bootstrap: dict[str, Any],
    *,
    shared_keys: bool,
) -> dict[str, Any] | None:
    """Both policies' gold scores, their difference and the gold win rate (against every
    independent reference draw), or None without."""
    if aligned.gold_rewards is None or reference.gold_rewards is None:
        return None
    a_gold, r_gold = per_prompt(aligned.gold_rewards), per_prompt(reference.gold_rewards)
    reference_gold = reference.gold_rewards if draws.gold_rewards is None else draws.gold_rewards
    return {
        "name": name,
        **paired_difference(a_gold, r_gold, **bootstrap),
        "win_rate": win_rate_with_interval(
            aligned.gold_rewards, reference_gold, shared_keys=shared_keys, **bootstrap
        ),
        "lc_win_rate": lc_win_rate(
            aligned, reference, "gold_rewards", shared_keys=shared_keys, **bootstrap
        ),
    }


def lc_win_rate(
    aligned: PolicyOutputs,
    reference: PolicyOutputs,
    scores: str,
    *,
    shared_keys: bool,
    **bootstrap: Any,
) -> dict[str, Any] | None:
    """The length-controlled win rate (``length_control.py``) of the two policies' samples,
    judged by their ``scores`` (``rewards`` or ``gold_rewards``), over independent pairs;
    None where they have none (one sample each, drawn with one key: the win rate's
    independent pairs are then the reference's best-of-n draws, whose lengths are not kept)."""
    a, r = _samples_by_prompt(getattr(aligned, scores), getattr(reference, scores))
    if shared_keys and a.shape[1] == r.shape[1] == 1:
        return None
    pairs = independent_pairs(a.shape[1], r.shape[1], shared_keys=shared_keys)
    return length_controlled_win_rate(
        a, r, response_lengths(aligned.response_mask), response_lengths(reference.response_mask),
        pairs=pairs, **bootstrap,
    )  # fmt: skip
