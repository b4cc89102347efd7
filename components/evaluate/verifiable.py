"""The evaluation of a verifiable task, where a reward function checks each answer (math):
what share of prompts the policy solves, with intervals over prompts.

- ``accuracy``: the share of prompts whose greedy response is correct.
- ``pass_at_k``: the chance that at least one of k samples drawn for a prompt is correct,
  averaged over prompts; estimated from n ≥ k samples per prompt with Chen et al.'s unbiased
  estimator 1 − C(n−c, k)/C(n, k), c of the n correct (Chen et al. 2021, "Evaluating Large
  Language Models Trained on Code", section 2.1). Reporting the share of k-subsets that
  hold a correct sample, rather than drawing only k, cuts the estimate's variance.
- ``mean_response_length`` and ``ended_fraction``: the greedy responses' length in tokens,
  and the share that ended with a stop token rather than at the length limit: a gain in
  accuracy that comes with truncated or ballooning answers is suspect.
- ``accuracy_gain``: the policy's accuracy less the reference's on the same prompts, its
  interval a paired bootstrap (both policies' rows of a prompt drawn together).

Every interval is the percentile bootstrap over prompts (:mod:`.bootstrap`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from components.evaluate.bootstrap import bootstrap_interval


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` of ``n`` samples correct: 1 − C(n−c, k)/C(n, k).

    Computed as Chen et al.'s product form, which never builds the binomials (they overflow
    a float for n in the hundreds).
    """
    if k < 1:
        raise ValueError(f"k: {k} must be at least 1")
    if k > n:
        raise ValueError(f"k: {k} exceeds n: {n} samples per prompt; draw at least k samples")
    if not 0 <= c <= n:
        raise ValueError(f"c: {c} correct samples must lie in [0, n] = [0, {n}]")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _pass_at_k_per_prompt(correct: ArrayLike, k: int) -> np.ndarray:
    """pass@k of each row of a bool [prompts, n] array, looked up from its count correct."""
    correct = np.asarray(correct, bool)
    if correct.ndim != 2 or correct.size == 0:
        raise ValueError(
            f"correct: shape {correct.shape} must be a non-empty [prompts, n] array, "
            "one row of samples per prompt"
        )
    n = correct.shape[1]
    by_count = np.array([pass_at_k(n, c, k) for c in range(n + 1)])
    return by_count[correct.sum(axis=1)]


def pass_at_k_mean(correct: ArrayLike, k: int) -> float:
    """Mean over prompts of pass@k, ``correct`` a bool [prompts, n] array of checked samples."""
    return float(np.mean(_pass_at_k_per_prompt(correct, k)))


def _policy_arrays(
    greedy_correct: ArrayLike,
    sampled_correct: ArrayLike | None,
    lengths: ArrayLike,
    ended: ArrayLike,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
    """The four arrays as numpy, checked to hold one row per prompt."""
    greedy = np.asarray(greedy_correct, np.float64)
    sampled = None if sampled_correct is None else np.asarray(sampled_correct, bool)
    length = np.asarray(lengths, np.float64)
    stopped = np.asarray(ended, bool)
    if greedy.ndim != 1 or len(greedy) == 0:
        raise ValueError(f"greedy_correct: shape {greedy.shape} must be [prompts], non-empty")
    prompts = len(greedy)
    for name, array in (("lengths", length), ("ended", stopped)):
        if array.shape != (prompts,):
            raise ValueError(f"{name}: shape {array.shape} must be [prompts] = ({prompts},)")
    if sampled is not None and (sampled.ndim != 2 or len(sampled) != prompts):
        raise ValueError(
            f"sampled_correct: shape {sampled.shape} must be [prompts, n] with {prompts} "
            "prompts; pass None when no samples were drawn"
        )
    return greedy, sampled, length, stopped


def verifiable_summary(
    greedy_correct: ArrayLike,
    sampled_correct: ArrayLike | None,
    lengths: ArrayLike,
    ended: ArrayLike,
    *,
    ks: Iterable[int],
    n_resamples: int,
    confidence: float,
    seed: int,
    reference: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Accuracy, pass@k for each k in ``ks`` up to n, and length figures, with intervals.

    ``reference`` holds the same four arrays (keys as the arguments) for the reference
    policy on the same prompts; with it the summary adds the reference's own summary and
    ``accuracy_gain``. A k above the n samples drawn is left out, not estimated.
    """
    greedy, sampled, length, stopped = _policy_arrays(
        greedy_correct, sampled_correct, lengths, ended
    )
    ks = sorted(set(ks))  # read twice when there is a reference: no one-shot iterators
    boot = {"n_resamples": n_resamples, "confidence": confidence, "seed": seed}
    n = 0 if sampled is None else sampled.shape[1]
    pass_at = {}
    for k in ks:
        if k > n:
            continue
        # The mean of resampled rows' pass@k is pass_at_k_mean of the resampled rows.
        per_prompt = _pass_at_k_per_prompt(sampled, k)
        pass_at[str(k)] = {
            "value": float(np.mean(per_prompt)),
            "interval": list(bootstrap_interval(np.mean, per_prompt, **boot)),
        }
    summary: dict[str, Any] = {
        "accuracy": float(np.mean(greedy)),
        "accuracy_interval": list(bootstrap_interval(np.mean, greedy, **boot)),
        "pass_at_k": pass_at,
        "mean_response_length": float(np.mean(length)),
        "ended_fraction": float(np.mean(stopped)),
        "prompts": len(greedy),
        "samples_per_prompt": n,
    }
    if reference is None:
        return summary
    ref_summary = verifiable_summary(
        reference["greedy_correct"],
        reference["sampled_correct"],
        reference["lengths"],
        reference["ended"],
        ks=ks,
        **boot,
    )
    if ref_summary["prompts"] != summary["prompts"]:
        raise ValueError(
            f"reference: {ref_summary['prompts']} prompts against the policy's "
            f"{summary['prompts']}; evaluate both policies on the same prompts"
        )
    ref_greedy = np.asarray(reference["greedy_correct"], np.float64)
    summary["reference"] = ref_summary
    summary["accuracy_gain"] = {
        "value": summary["accuracy"] - ref_summary["accuracy"],
        "interval": list(
            bootstrap_interval(lambda a, r: np.mean(a) - np.mean(r), greedy, ref_greedy, **boot)
        ),
    }
    return summary
