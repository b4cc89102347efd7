"""Mean gold reward of a policy's samples on held-out prompts (tasks that name a gold reward).

The built-in task knows the true reward of any response; the shard manifest
names it (``gold_reward``). Sampling the policy on the eval split's unique
prompts and scoring the decoded responses with it measures what PPO really
gained, free of the learned reward model's errors. Sampling is the evaluate
stage's (core.eval_sampling): every eval prompt, split over every device of
every host, each response with its own key, so the figure depends on the seed
and the policy only, not on the device or host count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flax import nnx

from components.core import eval_sampling, fileio, parallel
from components.core.gold import resolve_gold_reward
from components.core.tokenizers import load_tokenizer

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
) -> float:
    """Mean gold reward of ``samples_per_prompt`` samples per unique eval prompt."""
    gold = resolve_gold_reward(manifest["gold_reward"])
    tokenizer = load_tokenizer(fileio.join(shards_dir, "tokenizer"))
    prompts = eval_sampling.eval_prompts(shards_dir, prompt_len=prompt_len)
    settings = eval_sampling.SamplingSettings(
        max_new_tokens, tokenizer.eos_id, tokenizer.pad_id, temperature
    )
    rows = len(prompts.tokens) * samples_per_prompt
    responses = eval_sampling.sample_responses(
        graphdef, parallel.place(params, sharded=sharded), prompts, settings=settings,
        samples_per_prompt=samples_per_prompt, seed=seed, batch_size=rows,
    )  # fmt: skip
    scores = []
    for prompt, prompt_mask, samples, masks in zip(
        prompts.tokens, prompts.mask, responses.tokens, responses.mask, strict=True
    ):
        prompt_text = tokenizer.decode(prompt[prompt_mask])
        for response, response_mask in zip(samples, masks, strict=True):
            scores.append(gold(prompt_text, tokenizer.decode(response[response_mask.astype(bool)])))
    return float(np.mean(scores))
