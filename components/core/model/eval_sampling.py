"""Sampling a policy on the eval split's unique prompts: PPO's gold measure and the evaluate stage.

Every host reads every unique eval prompt, in shard order. Rows are (prompt, sample) pairs:
row ``r`` is sample ``r % S`` of prompt ``r // S``, drawn with its own key
``fold_in(fold_in(PRNGKey(seed), prompt), sample)``. A response thus depends only on the
seed, its prompt, its sample index and the policy: never on the batch size, the device or
host count, the padding, or how many samples are drawn. Two policies sampled with one seed
share keys (common random numbers): identical policies give identical responses.

Rows go in global batches over every device of every host: each host samples the rows of
its own devices and the responses are gathered back, so every host ends with all of them.
The last batch is padded with copies of the last row, computed and dropped, so no prompt
is left out. The pmapped sampler takes the model's ``graphdef`` and the settings as static
arguments: equal architectures share one compilation across policies and runs.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from components.core.data.prompts import prompt_dataset
from components.core.model.sampler import generate
from components.core.model.scoring import sequence_scores
from components.core.training import fsdp, parallel

PyTree = Any


class Prompts(NamedTuple):
    """Left-padded eval prompts."""

    tokens: np.ndarray  # [P, L] int32
    mask: np.ndarray  # [P, L] bool


class Responses(NamedTuple):
    """Sampled responses of every prompt."""

    tokens: np.ndarray  # [P, S, N] int32; pad after EOS
    mask: np.ndarray  # [P, S, N] int32; 1 up to and including EOS


class SamplingSettings(NamedTuple):
    """The sampler's settings (hashable: a static argument of the pmapped sampler)."""

    max_new_tokens: int
    eos_id: int | tuple[int, ...]  # the tokenizer's stop_ids
    pad_id: int
    temperature: float  # 0 = greedy
    vocab_size: int = 0  # the tokenizer's: ids past it are never sampled (0 = no limit)


def eval_prompts(shards_dir: str, *, prompt_len: int, max_prompts: int | None = None) -> Prompts:
    """The first ``max_prompts`` (default: all) unique eval-split prompts, in shard order."""
    return split_prompts(shards_dir, "eval", prompt_len=prompt_len, max_prompts=max_prompts)


def split_prompts(
    shards_dir: str,
    split: str,
    *,
    prompt_len: int,
    max_prompts: int | None = None,
    holdout: float = 0.0,
    held_out: bool = False,
) -> Prompts:
    """The first ``max_prompts`` (default: all) unique prompts of ``split``, in shard order;
    ``holdout``/``held_out``: without, or only, that fraction of them (prompts.unique_prompts)."""
    # Every host reads every shard: the measures then need nothing from other hosts.
    everything = prompt_dataset(
        shards_dir, split, batch_size=1, prompt_len=prompt_len, seed=0,
        host_index=0, host_count=1, shuffle=False, repeat=False, holdout=holdout,
        held_out=held_out,
    )  # fmt: skip
    count = len(everything.tokens) if max_prompts is None else max_prompts
    return Prompts(tokens=everything.tokens[:count], mask=everything.masks[:count])


def sample_keys(seed: int, num_prompts: int, samples_per_prompt: int) -> np.ndarray:
    """Key of sample s of prompt p at row p * S + s: ``fold_in(fold_in(PRNGKey(seed), p), s)``."""
    base = jax.random.PRNGKey(seed)
    prompt_keys = jax.vmap(lambda p: jax.random.fold_in(base, p))(jnp.arange(num_prompts))
    keys = jax.vmap(
        lambda key: jax.vmap(lambda s: jax.random.fold_in(key, s))(jnp.arange(samples_per_prompt))
    )(prompt_keys)
    return np.asarray(keys).reshape(num_prompts * samples_per_prompt, -1)


def global_batch(rows: int, batch_size: int, devices: int) -> int:
    """Rows per step: ``batch_size`` rounded up to ``devices``, no larger than ``rows`` needs."""
    per_device = min(-(-batch_size // devices), -(-rows // devices))
    return max(per_device, 1) * devices


def _padded_batches(arrays: dict[str, np.ndarray], size: int):
    """Batches of ``size`` rows, the last padded with copies of the last row."""
    rows = len(next(iter(arrays.values())))
    take = np.minimum(np.arange(-(-rows // size) * size), rows - 1)
    for start in range(0, len(take), size):
        yield {name: array[take[start : start + size]] for name, array in arrays.items()}


def map_local_batches(
    step: Callable[[dict[str, np.ndarray]], Sequence[jax.Array]],
    arrays: dict[str, np.ndarray],
    batch_size: int,
) -> list[np.ndarray]:
    """``step`` over every row in batches split over this host's devices, outputs row-aligned."""
    rows = len(next(iter(arrays.values())))
    size = global_batch(rows, batch_size, parallel.local_device_count())
    outputs = []
    for batch in _padded_batches(arrays, size):
        results = step(parallel.shard_batch(batch))
        # [devices, per_device, ...] → [batch, ...] in row order.
        outputs.append([np.asarray(r).reshape(size, *np.shape(r)[2:]) for r in results])
    return [np.concatenate(column)[:rows] for column in zip(*outputs, strict=True)]


def _local_blocks(batch: dict[str, np.ndarray]) -> tuple[dict[str, jax.Array], np.ndarray]:
    """This host's part of a global batch: block *i* of ``[devices, rows / devices, ...]``
    on the local device whose pmap axis index is *i*; and those axis indices."""
    local = jax.local_devices()
    indices = np.asarray(fsdp.axis_indices(tuple(local)), np.int32)
    placed = {}
    for name, array in batch.items():
        blocks = array.reshape(jax.device_count(), -1, *array.shape[1:])
        placed[name] = fsdp.put_rows([blocks[i] for i in indices], local)
    return placed, indices


def _gather_blocks(local: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The global ``[rows, ...]`` from every host's ``[local devices, per device, ...]`` blocks."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        local = np.asarray(multihost_utils.process_allgather(local, tiled=True))
        indices = np.asarray(multihost_utils.process_allgather(indices, tiled=True))
    blocks = np.empty_like(local)
    blocks[indices] = local
    return blocks.reshape(-1, *blocks.shape[2:])


def map_global_batches(
    step: Callable[[dict[str, jax.Array]], Sequence[jax.Array]],
    arrays: dict[str, np.ndarray],
    batch_size: int,
    progress: tuple[str, str] | None = None,
) -> list[np.ndarray]:
    """``step`` over every row in batches split over every host's devices; every host gets all.

    ``batch_size`` counts the rows of one step on each host, as ``map_local_batches`` does.
    ``progress`` (stage, what): the first host prints ``[stage] step i/n what, rows/s`` after
    each batch, the progress line a local run's terminal shows.
    """
    rows = len(next(iter(arrays.values())))
    size = global_batch(rows, batch_size * jax.process_count(), jax.device_count())
    outputs = []
    total, started = -(-rows // size), time.perf_counter()
    for index, batch in enumerate(_padded_batches(arrays, size)):
        placed, indices = _local_blocks(batch)
        outputs.append([_gather_blocks(np.asarray(r), indices) for r in step(placed)])
        if progress is not None and jax.process_index() == 0:
            rate = (index + 1) * size / max(time.perf_counter() - started, 1e-9)
            print(
                f"[{progress[0]}] step {index + 1}/{total} {progress[1]}, {rate:.1f} rows/s",
                file=sys.stderr, flush=True,
            )  # fmt: skip
    return [np.concatenate(column)[:rows] for column in zip(*outputs, strict=True)]


@functools.partial(jax.pmap, axis_name="data", static_broadcasted_argnums=(0, 5))
def _sample(graphdef, params, prompt_tokens, prompt_mask, keys, settings: SamplingSettings):
    """One device's responses, each row sampled with its own key."""

    def one_row(tokens, mask, key):
        out = generate((graphdef, params), tokens[None], mask[None], key, **settings._asdict())
        return out.tokens[0], out.mask[0]

    return jax.vmap(one_row)(prompt_tokens, prompt_mask, keys)


def sample_responses(
    graphdef: nnx.GraphDef,
    params: PyTree,
    prompts: Prompts,
    *,
    settings: SamplingSettings,
    samples_per_prompt: int,
    seed: int,
    batch_size: int,
    stage: str = "",
) -> Responses:
    """``samples_per_prompt`` responses to every prompt by the policy of ``params`` (placed
    on the devices: ``parallel.place``), ``batch_size`` rows per step and host; keys and
    batching as the module docstring says. ``stage``: the stage whose progress lines name the
    batches (none without one)."""
    num_prompts, samples = len(prompts.tokens), samples_per_prompt
    arrays = {
        "prompt_tokens": np.repeat(prompts.tokens, samples, axis=0),
        "prompt_mask": np.repeat(prompts.mask, samples, axis=0),
        "keys": sample_keys(seed, num_prompts, samples),
    }

    def step(batch: dict[str, jax.Array]) -> Sequence[jax.Array]:
        return _sample(
            graphdef, params, batch["prompt_tokens"], batch["prompt_mask"], batch["keys"],
            settings,
        )  # fmt: skip

    progress = (stage, f"sampling {num_prompts} prompts x {samples}") if stage else None
    tokens, mask = map_global_batches(step, arrays, batch_size, progress)
    shape = (num_prompts, samples, settings.max_new_tokens)
    return Responses(tokens.reshape(shape), mask.reshape(shape))


def row_arrays(prompts: Prompts, responses: Responses) -> dict[str, np.ndarray]:
    """Flat rows of (prompt, response) in core.model.scoring's batch layout."""
    samples, length = responses.tokens.shape[1:]
    return {
        "prompt_tokens": np.repeat(prompts.tokens, samples, axis=0),
        "prompt_mask": np.repeat(prompts.mask, samples, axis=0),
        "response_tokens": responses.tokens.reshape(-1, length),
        "response_mask": responses.mask.reshape(-1, length),
    }


@functools.partial(jax.pmap, axis_name="data", static_broadcasted_argnums=(0, 3))
def _response_scores(graphdef, params, batch, member):
    """The reward model's score of each prompt + response [B] (at its last real token);
    ``member``: of models stacked on a leading axis, that one's (None: not stacked)."""
    if member is not None:
        params = jax.tree.map(lambda leaf: leaf[member], params)
    return (sequence_scores(graphdef, params, batch),)


def response_scores(
    graphdef: nnx.GraphDef,
    params: PyTree,
    prompts: Prompts,
    responses: Responses,
    *,
    batch_size: int,
    member: int | None = None,
) -> np.ndarray:
    """Raw scores [P, S] of every prompt + response by the reward model of ``params`` (placed
    on the devices: ``parallel.place``); ``member``: ``params`` stacks several models of one
    graph on a leading axis (ppo's monitors), and this one scores."""

    def step(batch: dict[str, np.ndarray]) -> Sequence[jax.Array]:
        return _response_scores(graphdef, params, batch, member)

    values = map_local_batches(step, row_arrays(prompts, responses), batch_size)[0]
    return values.reshape(responses.tokens.shape[:2])
