"""Scoring on the eval prompts, data-parallel with ``jax.pmap``; sampling: core.model.eval_sampling.

Rows are (prompt, sample) pairs: row ``r`` is sample ``r % S`` of prompt ``r // S``. Rows are
cut into batches of a multiple of the local device count; the last batch is padded with
copies of the last row, which are computed and dropped, so no prompt is ever left out.

Every pmapped function takes the model's ``graphdef`` as a static argument: equal
architectures share one compilation across policies and runs.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from components.core.data.pairs import read_pairs
from components.core.model.eval_sampling import (
    Prompts,
    Responses,
    map_local_batches,
    response_scores,
    row_arrays,
)
from components.core.model.scoring import pair_rewards, response_logprobs
from components.core.model.transformer import ModelConfig, Transformer
from components.core.training import parallel

log = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    """A model split for pmap: its graph, its parameters replicated on every local device."""

    graphdef: nnx.GraphDef
    params: Any  # nnx.State placed on the devices (replicated or sharded)
    config: ModelConfig


def prepare(model: Transformer, *, sharded: bool = False) -> LoadedModel:
    """Split ``model`` and place its parameters: replicated, or in chunks (fsdp.py)."""
    graphdef, params = nnx.split(model, nnx.Param)
    return LoadedModel(graphdef, parallel.place(params, sharded=sharded), model.config)


def prompt_length(
    max_new_tokens: int, manifest: dict[str, Any], models: dict[str, LoadedModel]
) -> int:
    """Prompt tokens kept for sampling: the longest eval prompt, within the room the models'
    ``max_seq_len`` leaves after ``max_new_tokens`` (longer prompts are cut from the left)."""
    limit = min(model.config.max_seq_len for model in models.values())
    room = limit - max_new_tokens
    if room < 1:
        raise ValueError(
            f"max_new_tokens: {max_new_tokens} leaves no room for a prompt within "
            f"the models' max_seq_len of {limit}; lower max_new_tokens"
        )
    lengths = manifest["splits"]["eval"].get("token_lengths", {})
    longest = int(lengths.get("prompt", {}).get("max", room))
    if longest > room:
        log.warning("eval prompts over %d tokens are cut from the left", room)
    return max(min(longest, room), 1)


@functools.partial(jax.pmap, axis_name="data", static_broadcasted_argnums=(0, 3))
def _response_logprobs(graphdef, params, batch, temperature: float):
    """log p_T(response token | everything before it) [B, N] under one policy."""
    return (response_logprobs(graphdef, params, batch, temperature),)


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

    values = map_local_batches(step, row_arrays(prompts, responses), batch_size)[0]
    return values.reshape(responses.tokens.shape)


def response_rewards(
    reward_model: LoadedModel, prompts: Prompts, responses: Responses, *, batch_size: int
) -> np.ndarray:
    """Raw reward-model scores [P, S] of every prompt + response."""
    return response_scores(
        reward_model.graphdef, reward_model.params, prompts, responses, batch_size=batch_size
    )


@functools.partial(jax.pmap, axis_name="data", static_broadcasted_argnums=(0,))
def _pair_rewards(graphdef, params, batch):
    """Rewards of the chosen and rejected sequences of one device's pairs."""
    return pair_rewards(graphdef, params, batch)


def eval_pair_rewards(
    reward_model: LoadedModel, shards_dir: str, *, max_len: int, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Raw rewards of the chosen and rejected responses of every eval-split pair."""
    # Every pair, none dropped as an incomplete batch; every host reads all.
    pairs = read_pairs(shards_dir, "eval", max_len=max_len)
    names = ("chosen_tokens", "chosen_mask", "rejected_tokens", "rejected_mask")
    arrays = {name: pairs[name] for name in names}

    def step(batch: dict[str, np.ndarray]) -> Sequence[jax.Array]:
        return _pair_rewards(reward_model.graphdef, reward_model.params, batch)

    chosen, rejected = map_local_batches(step, arrays, batch_size)
    return chosen, rejected
