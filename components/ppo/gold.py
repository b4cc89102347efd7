"""Mean gold reward of a policy's samples on held-out prompts (tasks that name a gold reward).

The built-in task knows the true reward of any response; the shard manifest
names it (``gold_reward``). Sampling the policy on the eval split's unique
prompts and scoring the decoded responses with it measures what PPO really
gained, free of the learned reward model's errors. Sampling and scoring are
core.data.gold's ``policy_gold_scores`` (the evaluate stage's sampler): every eval
prompt, split over every device of every host, each response with its own key,
so the figure depends on the seed and the policy only, not on the device or host
count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx

from components.core.data.gold import policy_gold_scores
from components.core.training import parallel

PyTree = Any


def mean_gold_reward(
    graphdef: nnx.GraphDef,
    params: PyTree,
    shards_dir: str,
    manifest: dict[str, Any],
    *,
    prompt_len: int,
    max_new_tokens: int,
    temperature: float,
    samples_per_prompt: int = 4,
    seed: int = 0,
    sharded: bool = False,
    prompt_set: dict[str, Any] | None = None,
) -> float:
    """Mean gold reward of ``samples_per_prompt`` samples per unique eval prompt
    (``prompt_set``: eval_sampling.split_prompts' choice of others instead, e.g. a
    validation hold-out)."""
    scores = policy_gold_scores(
        graphdef, parallel.place(params, sharded=sharded), shards_dir, manifest["gold_reward"],
        prompt_len=prompt_len, max_new_tokens=max_new_tokens, temperature=temperature,
        samples_per_prompt=samples_per_prompt, seed=seed, prompt_set=prompt_set,
    )  # fmt: skip
    return float(np.mean(scores))
