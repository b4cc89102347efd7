"""Over-optimisation figures of the evaluation: what the reward artifact's other models say.

The judge (the proxy: the reward model the policy was trained against) rewards gaming it
as much as improving. The reward stage can train a held-out model on prompts no stage
trained on and ensemble members with other seeds (core/rewards/members.py); here each scores
the same aligned and reference samples, standardized by its own eval statistics
(z-scores, comparable across models), and the summary's ``overoptimisation`` part holds

- ``proxy_gain`` and ``heldout_gain``: the mean z-score gain of the aligned policy over
  its reference by the proxy and by the held-out model (per-prompt paired differences,
  bootstrap interval), and ``gap`` = proxy gain − held-out gain: what the proxy credits
  that an independent judge of the same data does not (Gao et al. 2022);
- ``disagreement``: the ensemble's (proxy and members) mean per-response std on each
  policy's samples and their ratio: a policy that leaves the data the models agree on
  raises it (Coste et al. 2023; Eisenstein et al. 2023);
- ``length_ratio``: the aligned policy's mean response length over the reference's
  (Singhal et al. 2023: much of a reward model's gain can be length); measured with any
  judge.

The gate (gate.py) checks each against its threshold.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from components.core.model.artifact import load_model
from components.core.rewards.members import Members, read_stats, standardize
from components.evaluate import generation
from components.evaluate.config import EvalConfig
from components.evaluate.measures import paired_difference, per_prompt, response_lengths


def member_scores(
    members: Members, prompts: Any, responses: list[Any], *, seed: int, batch_size: int,
    sharded: bool,
) -> list[list[np.ndarray]]:  # fmt: skip
    """Each member's z-scores [P, S] of each of ``responses``, held-out first; one member
    loaded at a time."""
    scores = []
    for folder in members.folders:
        model = generation.prepare(
            load_model(folder, scalar_head=True, seed=seed)[0], sharded=sharded
        )
        stats = read_stats(folder)
        scores.append(
            [
                standardize(
                    generation.response_rewards(model, prompts, r, batch_size=batch_size), stats
                )
                for r in responses
            ]
        )
        del model
    return scores


def overoptimisation_part(
    aligned_mask: np.ndarray,
    reference_mask: np.ndarray,
    *,
    proxy: tuple[np.ndarray, np.ndarray] | None,
    proxy_stats: dict[str, Any] | None,
    members: Members,
    member_z: list[list[np.ndarray]],
    bootstrap: dict[str, Any],
) -> dict[str, Any]:
    """The summary's ``overoptimisation`` part. ``proxy``: the judge's raw scores of the
    aligned and reference samples [P, S] (None when gold judged); ``member_z``:
    :func:`member_scores` of the same two."""
    a_len = float(np.mean(response_lengths(aligned_mask)))
    r_len = float(np.mean(response_lengths(reference_mask)))
    part: dict[str, Any] = {"length_ratio": a_len / r_len if r_len else None}
    if proxy is None or proxy_stats is None:
        return part
    proxy_z = [standardize(scores, proxy_stats) for scores in proxy]

    def gain(aligned: np.ndarray, reference: np.ndarray) -> dict[str, Any]:
        return paired_difference(per_prompt(aligned), per_prompt(reference), **bootstrap)

    part["proxy_gain"] = gain(*proxy_z)
    if members.heldout is not None:
        part["heldout_gain"] = gain(*member_z[0])
        gains = (part[name]["difference"]["value"] for name in ("proxy_gain", "heldout_gain"))
        part["gap"] = float(np.subtract(*gains))
    ensemble = member_z[int(members.heldout is not None) :]
    if ensemble:
        spread = [
            float(
                np.mean(np.std(np.stack([proxy_z[i], *(m[i] for m in ensemble)]), axis=0, ddof=1))
            )
            for i in (0, 1)
        ]
        part["disagreement"] = {
            "aligned": spread[0],
            "reference": spread[1],
            "ratio": spread[0] / spread[1] if spread[1] > 0 else None,
            "members": len(ensemble) + 1,
        }
    return part


def measure_overoptimisation(
    config: EvalConfig,
    models: dict[str, generation.LoadedModel],
    prompts: Any,
    policies: tuple[Any, Any],
    members: Members,
    proxy_stats: dict[str, Any] | None,
) -> dict[str, Any]:
    """The summary's ``overoptimisation`` part of the aligned and reference samples
    (``policies``: stage.PolicyResult each), the judge's when a reward model judged."""
    aligned, reference = policies
    judged = "reward" in models
    member_z = []
    if judged and members.any:
        member_z = member_scores(
            members, prompts, [aligned.responses, reference.responses], seed=config.seed,
            batch_size=config.batch_size, sharded=config.fsdp,
        )  # fmt: skip
    return overoptimisation_part(
        aligned.responses.mask, reference.responses.mask,
        proxy=(aligned.rewards, reference.rewards) if judged else None,
        proxy_stats=proxy_stats if judged else None, members=members, member_z=member_z,
        bootstrap={"n_resamples": config.bootstrap_samples, "confidence": config.confidence,
                   "seed": config.seed},
    )  # fmt: skip
