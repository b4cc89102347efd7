"""Generation and scoring on the eval prompts, data-parallel with ``jax.pmap``.

Rows are (prompt, sample) pairs: row ``r`` is sample ``r % S`` of prompt ``r // S``. Rows are
cut into global batches of a multiple of the local device count; the last batch is padded
with copies of the last row, which are computed and dropped, so no prompt is ever left out.

Sample ``s`` of prompt ``p`` draws with its own key, ``fold_in(fold_in(PRNGKey(seed), p), s)``:
a response depends only on the seed, its prompt, its sample index and the policy, never on
the batch size, the device count, the padding or how many samples are drawn. Both policies
use the same keys (common random numbers), so identical policies give identical responses
and the head-to-head comparison carries less sampling noise; the reference's first samples
of a best-of-n draw are the very samples the win rate compares.

Every pmapped function takes the model's ``graphdef`` as a static argument: equal
architectures share one compilation across policies and runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from components.core import parallel
from components.core.input_pipeline import preference_dataset, prompt_dataset
from components.core.model import ModelConfig, Transformer
from components.core.sampler import generate
from components.core.scoring import pair_rewards, response_logprobs, sequence_scores


class LoadedModel(NamedTuple):
    """A model split for pmap: its graph, its parameters replicated on every local device."""

    graphdef: nnx.GraphDef
    params: Any  # nnx.State placed on the devices (replicated or sharded)
    config: ModelConfig


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
    eos_id: int
    pad_id: int
    temperature: float  # 0 = greedy


def prepare(model: Transformer, *, sharded: bool = False) -> LoadedModel:
    """Split ``model`` and place its parameters: replicated, or in chunks (fsdp.py)."""
    graphdef, params = nnx.split(model, nnx.Param)
    return LoadedModel(graphdef, parallel.place(params, sharded=sharded), model.config)


def load_prompts(shards_dir: str, *, max_prompts: int, prompt_len: int) -> Prompts:
    """The first ``max_prompts`` unique prompts of the eval split, in shard order."""
    # Every host reads every eval shard: evaluation is small, and each host then computes
    # the same figures, so whichever host writes the report needs nothing from the others.
    batches = prompt_dataset(
        shards_dir, "eval", batch_size=1, prompt_len=prompt_len, seed=0,
        host_index=0, host_count=1, shuffle=False, repeat=False,
    )  # fmt: skip
    rows = [batch for _, batch in zip(range(max_prompts), batches, strict=False)]
    return Prompts(
        tokens=np.concatenate([row["prompt_tokens"] for row in rows]),
        mask=np.concatenate([row["prompt_mask"] for row in rows]),
    )


def global_batch(rows: int, batch_size: int) -> int:
    """Rows per step: ``batch_size`` rounded up to the devices, no larger than ``rows`` needs."""
    devices = parallel.local_device_count()
    per_device = min(-(-batch_size // devices), -(-rows // devices))
    return max(per_device, 1) * devices


def map_batches(
    step: Callable[[dict[str, np.ndarray]], Sequence[jax.Array]],
    arrays: dict[str, np.ndarray],
    batch_size: int,
) -> list[np.ndarray]:
    """``step`` over every row of ``arrays`` in device-sharded batches, outputs row-aligned.

    The last batch is padded with copies of the last row; their outputs are dropped.
    """
    rows = len(next(iter(arrays.values())))
    size = global_batch(rows, batch_size)
    padded_rows = -(-rows // size) * size
    take = np.minimum(np.arange(padded_rows), rows - 1)
    outputs: list[list[np.ndarray]] = []
    for start in range(0, padded_rows, size):
        batch = {name: array[take[start : start + size]] for name, array in arrays.items()}
        results = step(parallel.shard_batch(batch))
        # [devices, per_device, ...] → [batch, ...] in row order.
        host = [np.asarray(r).reshape(size, *np.shape(r)[2:]) for r in results]
        outputs.append(host)
    return [np.concatenate(column)[:rows] for column in zip(*outputs, strict=True)]


@functools.partial(jax.pmap, axis_name="data", static_broadcasted_argnums=(0, 5))
def _sample(graphdef, params, prompt_tokens, prompt_mask, keys, settings: SamplingSettings):
    """One device's responses, each row sampled with its own key."""

    def one_row(tokens, mask, key):
        out = generate((graphdef, params), tokens[None], mask[None], key, **settings._asdict())
        return out.tokens[0], out.mask[0]

    return jax.vmap(one_row)(prompt_tokens, prompt_mask, keys)


def sample_responses(
    policy: LoadedModel,
    prompts: Prompts,
    *,
    settings: SamplingSettings,
    samples_per_prompt: int,
    seed: int,
    batch_size: int,
) -> Responses:
    """``samples_per_prompt`` responses to every prompt; keys as the module docstring says."""
    num_prompts, samples = len(prompts.tokens), samples_per_prompt
    arrays = {
        "prompt_tokens": np.repeat(prompts.tokens, samples, axis=0),
        "prompt_mask": np.repeat(prompts.mask, samples, axis=0),
        "keys": sample_keys(seed, num_prompts, samples),
    }

    def step(batch: dict[str, np.ndarray]) -> Sequence[jax.Array]:
        return _sample(
            policy.graphdef, policy.params, batch["prompt_tokens"], batch["prompt_mask"],
            batch["keys"], settings,
        )  # fmt: skip

    tokens, mask = map_batches(step, arrays, batch_size)
    shape = (num_prompts, samples, settings.max_new_tokens)
    return Responses(tokens.reshape(shape), mask.reshape(shape))


def sample_keys(seed: int, num_prompts: int, samples_per_prompt: int) -> np.ndarray:
    """Key of sample s of prompt p at row p * S + s: ``fold_in(fold_in(PRNGKey(seed), p), s)``."""
    base = jax.random.PRNGKey(seed)
    prompt_keys = jax.vmap(lambda p: jax.random.fold_in(base, p))(jnp.arange(num_prompts))
    keys = jax.vmap(
        lambda key: jax.vmap(lambda s: jax.random.fold_in(key, s))(jnp.arange(samples_per_prompt))
    )(prompt_keys)
    return np.asarray(keys).reshape(num_prompts * samples_per_prompt, -1)


@functools.partial(jax.pmap, axis_name="data", static_broadcasted_argnums=(0, 3))
def _response_logprobs(graphdef, params, batch, temperature: float):
    """log p_T(response token | everything before it) [B, N] under one policy."""
    return (response_logprobs(graphdef, params, batch, temperature),)


@functools.partial(jax.pmap, axis_name="data", static_broadcasted_argnums=(0,))
def _response_rewards(graphdef, params, batch):
    """The reward model's score of each prompt + response [B] (at its last real token)."""
    return (sequence_scores(graphdef, params, batch),)


def _row_arrays(prompts: Prompts, responses: Responses) -> dict[str, np.ndarray]:
    """Flat rows of (prompt, response) in core.scoring's batch layout."""
    samples, length = responses.tokens.shape[1:]
    return {
        "prompt_tokens": np.repeat(prompts.tokens, samples, axis=0),
        "prompt_mask": np.repeat(prompts.mask, samples, axis=0),
        "response_tokens": responses.tokens.reshape(-1, length),
        "response_mask": responses.mask.reshape(-1, length),
    }


def policy_logprobs(
    policy: LoadedModel,
    prompts: Prompts,
    responses: Responses,
    *,
    temperature: float,
    batch_size: int,
) -> np.ndarray:
    """Log-probs [P, S, N] of the responses' tokens under ``policy`` at the sampling
    ``temperature`` (1 = untempered, as greedy decoding uses); garbage where masked."""

    def step(batch: dict[str, np.ndarray]) -> Sequence[jax.Array]:
        return _response_logprobs(policy.graphdef, policy.params, batch, temperature)

    values = map_batches(step, _row_arrays(prompts, responses), batch_size)[0]
    return values.reshape(responses.tokens.shape)


def response_rewards(
    reward_model: LoadedModel, prompts: Prompts, responses: Responses, *, batch_size: int
) -> np.ndarray:
    """Raw reward-model scores [P, S] of every prompt + response."""

    def step(batch: dict[str, np.ndarray]) -> Sequence[jax.Array]:
        return _response_rewards(reward_model.graphdef, reward_model.params, batch)

    values = map_batches(step, _row_arrays(prompts, responses), batch_size)[0]
    return values.reshape(responses.tokens.shape[:2])


@functools.partial(jax.pmap, axis_name="data", static_broadcasted_argnums=(0,))
def _pair_rewards(graphdef, params, batch):
    """Rewards of the chosen and rejected sequences of one device's pairs."""
    return pair_rewards(graphdef, params, batch)


def eval_pair_rewards(
    reward_model: LoadedModel, shards_dir: str, *, max_len: int, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Raw rewards of the chosen and rejected responses of every eval-split pair."""
    # Read one pair at a time so none is dropped as an incomplete batch; every host reads all.
    pairs = list(
        preference_dataset(
            shards_dir,
            "eval",
            batch_size=1,
            max_len=max_len,
            seed=0,
            host_index=0,
            host_count=1,
            shuffle=False,
            repeat=False,
        )  # fmt: skip
    )
    names = ("chosen_tokens", "chosen_mask", "rejected_tokens", "rejected_mask")
    arrays = {name: np.concatenate([pair[name] for pair in pairs]) for name in names}

    def step(batch: dict[str, np.ndarray]) -> Sequence[jax.Array]:
        return _pair_rewards(reward_model.graphdef, reward_model.params, batch)

    chosen, rejected = map_batches(step, arrays, batch_size)
    return chosen, rejected
