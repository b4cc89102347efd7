"""Score normalisation on the starting policy's own samples of train prompts.

PPO's scores are (raw − mean) / std, so that ``kl_coef`` weighs the KL in units of one score
standard deviation, ``reward_clip`` clips in those units and the critic's head starts at the
scale of its targets. lm-human-preferences (Ziegler et al. 2019) and "The N Implementation
Details of RLHF with PPO" (Huang et al. 2023) take mean and std over responses the initial
policy samples, the distribution PPO starts from. The reward stage's ``reward_stats.json``
holds them over the data's chosen and rejected responses instead, a distribution the policy
never samples (``score_norm = data`` keeps it).

The samples are the first ``score_norm_samples`` unique train prompts, one response each at
the rollouts' temperature, with keys from the run's seed. Every checkpoint holds the figures, and a
resumed run reads them back instead of sampling again (``saved_score_stats``): the same
figures, bit for bit, and no sampling pass before the resume.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flax import nnx

from components.core.model import eval_sampling
from components.core.training import parallel
from components.core.training.checkpoint import TrainCheckpointer

log = logging.getLogger(__name__)
# The checkpoints' JSON entry of the statistics a run normalized with.
SCORE_NORM_KEY = "score_norm"

# Sampling keys of the normalisation: the run's seed folded with this, apart from the
# rollouts' and the gold measure's.
_SEED_OFFSET = 7_919


def policy_score_stats(
    policy: nnx.Module,
    reward: nnx.Module,
    shards_dir: str,
    ids: Any,
    *,
    prompt_len: int,
    max_new_tokens: int,
    temperature: float,
    samples: int,
    seed: int,
    sharded: bool = False,
    holdout: float = 0.0,
) -> dict[str, float]:
    """Mean and std of ``reward``'s raw scores of ``policy``'s responses to train prompts
    (without the ``holdout`` fraction of them: the validation prompts)."""
    prompts = eval_sampling.split_prompts(
        shards_dir, "train", prompt_len=prompt_len, max_prompts=samples, holdout=holdout
    )
    settings = eval_sampling.SamplingSettings(
        max_new_tokens, ids.eos_id, ids.pad_id, temperature, ids.vocab_size
    )
    policy_graph, policy_params = nnx.split(policy, nnx.Param)
    reward_graph, reward_params = nnx.split(reward, nnx.Param)
    rows = len(prompts.tokens)
    responses = eval_sampling.sample_responses(
        policy_graph, parallel.place(policy_params, sharded=sharded), prompts,
        settings=settings, samples_per_prompt=1, seed=seed + _SEED_OFFSET, batch_size=rows,
    )  # fmt: skip
    scores = eval_sampling.response_scores(
        reward_graph, parallel.place(reward_params, sharded=sharded), prompts, responses,
        batch_size=rows,
    )  # fmt: skip
    if not np.all(np.isfinite(scores)):
        raise FloatingPointError(
            "the reward model scored the starting policy's samples with non-finite values; "
            "check the reward model artifact (or pass --score-norm data)"
        )
    return {
        "mean": float(np.mean(scores)), "std": float(np.std(scores)), "samples": rows,
        "quantiles": sorted(float(score) for score in np.reshape(scores, -1)),
    }  # fmt: skip


def saved_score_stats(checkpointer: TrainCheckpointer, source: str) -> dict[str, float] | None:
    """The score statistics ``source`` (``score_norm``) gave the run whose latest checkpoint
    ``checkpointer`` holds, so a resume normalizes exactly as the first attempt did; None to
    compute them: no checkpoint, one written before checkpoints held them, or another source."""
    extra = checkpointer.latest_extra_json()
    if extra is None:
        return None
    saved = extra.get(SCORE_NORM_KEY)
    if source == "quantile" and saved is not None and not saved.get("quantiles"):
        saved = None  # a quantile run needs the scores themselves
    if saved is None or saved.get("source") != source:
        log.warning(
            "ppo: the checkpoint in %s holds no score statistics of score_norm %s (%s); "
            "computing them again, so the resumed run may differ from an uninterrupted one",
            checkpointer.directory, source,
            "written before checkpoints held them" if saved is None else f"its: {saved['source']}",
        )  # fmt: skip
        return None
    return {
        "mean": float(saved["mean"]), "std": float(saved["std"]),
        "quantiles": [float(score) for score in saved.get("quantiles", [])],
    }  # fmt: skip
