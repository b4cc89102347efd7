"""Mean gold reward of a policy's samples on held-out prompts (tasks that name a gold reward).

The built-in task knows the true reward of any response; the shard manifest
names it (``gold_reward``). Sampling the policy on the eval split's unique
prompts and scoring the decoded responses with it measures what PPO really
gained, free of the learned reward model's errors.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx

from components.core import fileio, fsdp, parallel
from components.core.gold import resolve_gold_reward
from components.core.input_pipeline import prompt_dataset
from components.core.sampler import generate
from components.core.tokenizers import load_tokenizer

PyTree = Any


def eval_prompts(shards_dir: str, prompt_len: int, seed: int) -> dict[str, np.ndarray]:
    """Every unique eval prompt (every host reads them all), as many as split over all devices.

    The measure must not depend on the number of hosts: each host samples the rows of its
    own devices (:func:`_local_rows`) and the responses are gathered back from every host.
    """
    devices = jax.device_count()
    everything = prompt_dataset(
        shards_dir, "eval", batch_size=1, prompt_len=prompt_len, seed=seed,
        host_index=0, host_count=1, shuffle=False,
    )  # fmt: skip
    count = len(everything.tokens) // devices * devices
    if count == 0:
        raise ValueError(
            f"{shards_dir}: the eval split has fewer unique prompts than the {devices} devices; "
            "raise eval_fraction in the shard stage"
        )
    return {"prompt_tokens": everything.tokens[:count], "prompt_mask": everything.masks[:count]}


def _local_rows(batch: dict[str, np.ndarray]) -> tuple[dict[str, jax.Array], np.ndarray]:
    """This host's part of a global batch: block *i* of ``[devices, rows / devices, ...]``
    on the local device whose pmap axis index is *i*; and those axis indices."""
    local = jax.local_devices()
    indices = np.asarray(fsdp.axis_indices(tuple(local)), np.int32)
    placed = {}
    for name, array in batch.items():
        blocks = array.reshape(jax.device_count(), -1, *array.shape[1:])
        placed[name] = fsdp.put_rows([blocks[i] for i in indices], local)
    return placed, indices


def _gather_rows(local: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The global ``[rows, ...]`` from every host's ``[local devices, per device, ...]`` blocks."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        local = np.asarray(multihost_utils.process_allgather(local, tiled=True))
        indices = np.asarray(multihost_utils.process_allgather(indices, tiled=True))
    blocks = np.empty_like(local)
    blocks[indices] = local
    return blocks.reshape(-1, *blocks.shape[2:])


@functools.lru_cache(maxsize=4)
def _sampler(
    graphdef: nnx.GraphDef, max_new_tokens: int, eos_id: int, pad_id: int, temperature: float
):
    """A pmapped sampler (cached: runs before and after PPO share one compilation)."""

    def sample(params: PyTree, batch: dict, rng: jax.Array):
        rng = jax.random.fold_in(rng, jax.lax.axis_index("data"))
        return generate(
            (graphdef, params), batch["prompt_tokens"], batch["prompt_mask"], rng,
            max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, temperature=temperature,
        )  # fmt: skip

    return jax.pmap(sample, axis_name="data", in_axes=(0, 0, None))


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
    prompts = eval_prompts(shards_dir, prompt_len, seed)
    prompts = {k: np.repeat(v, samples_per_prompt, axis=0) for k, v in prompts.items()}

    sample = _sampler(graphdef, max_new_tokens, tokenizer.eos_id, tokenizer.pad_id, temperature)
    local, indices = _local_rows(prompts)
    out = sample(parallel.place(params, sharded=sharded), local, jax.random.PRNGKey(seed))
    tokens = _gather_rows(np.asarray(out.tokens), indices)
    mask = _gather_rows(np.asarray(out.mask), indices)
    scores = []
    for prompt, prompt_mask, response, response_mask in zip(
        prompts["prompt_tokens"], prompts["prompt_mask"], tokens, mask, strict=True
    ):
        text = tokenizer.decode(response[response_mask.astype(bool)])
        scores.append(gold(tokenizer.decode(prompt[prompt_mask]), text))
    return float(np.mean(scores))
