"""Every preference pair of a split in one plain pass, read without TensorFlow.

Scoring each eval pair with a reward model needs no shuffle, repeat or position: core's
TFRecord reader (:mod:`components.core.data.tfrecord`) gives the records, and
:func:`pair_arrays` builds from each what the training reader's ``to_pair``
(:func:`components.core.data.input_pipeline._pair_fn`) builds with tf.data, so an evaluate
stage never imports TensorFlow (3-4 s of a stage's start on 2 cores, and 0.3 s tracing the
reader's functions). tests/test_input_pipeline.py checks the two on cut prompts, with and
without a bos, and on responses longer than ``max_len``. The prompt reader cuts its prompts
with :func:`cut_prompt` too.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from components.core.data import tfrecord
from components.core.data.input_pipeline import DataError, host_reader

_PAIR_FEATURES = frozenset({"prompt_ids", "chosen_ids", "rejected_ids", "margin"})
_NO_TOKENS = np.zeros(0, np.int32)


def shard_examples(files: list[str], names: frozenset[str]) -> Iterator[dict[str, np.ndarray]]:
    """The decoded examples of ``files`` in order (``names`` only); damage is a DataError
    naming the file and byte."""
    try:
        yield from tfrecord.read_examples(files, names)
    except tfrecord.CorruptRecordError as error:
        raise DataError(str(error)) from error


def cut_prompt(prompt: np.ndarray, keep: int, bos_id: int | None) -> np.ndarray:
    """The last ``keep`` tokens of ``prompt``, keeping a leading bos when there is one."""
    drop = max(len(prompt) - keep, 0)
    if drop and bos_id is not None and prompt[0] == bos_id:
        return np.concatenate([prompt[:1], prompt[1 + drop :]])
    return prompt[drop:]


def pair_arrays(
    example: dict[str, np.ndarray], max_len: int, pad_id: int, bos_id: int | None
) -> dict[str, np.ndarray]:
    """One decoded record as a padded pair: prompt + chosen and prompt + rejected, each cut
    to ``max_len``, their attention masks, and the loss mask over the chosen response."""
    prompt, chosen, rejected = (
        np.asarray(example.get(name, _NO_TOKENS)).astype(np.int32)
        for name in ("prompt_ids", "chosen_ids", "rejected_ids")
    )
    # Keep the whole prompt when it fits, else cut it to max(room left, max_len // 2).
    keep = max(max_len - max(len(chosen), len(rejected)), min(len(prompt), max_len // 2))
    prompt = cut_prompt(prompt, keep, bos_id)
    positions = np.arange(max_len)

    def sequence(response: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.concatenate([prompt, response])[:max_len]
        padded = np.full(max_len, pad_id, np.int32)
        padded[: len(tokens)] = tokens
        return padded, positions < len(tokens)

    chosen_tokens, chosen_mask = sequence(chosen)
    rejected_tokens, rejected_mask = sequence(rejected)
    margin = np.asarray(example.get("margin", ()), np.float32)
    return {
        "chosen_tokens": chosen_tokens,
        "chosen_mask": chosen_mask,
        "loss_mask": chosen_mask & (positions >= len(prompt)),
        "rejected_tokens": rejected_tokens,
        "rejected_mask": rejected_mask,
        "margin": margin[0] if len(margin) else np.float32(0.0),
    }


def read_pairs(shards_dir: str, split: str, *, max_len: int) -> dict[str, np.ndarray]:
    """Every pair of ``split`` (all shards, in order) as stacked arrays ``[pairs, ...]``."""
    if max_len < 2:
        raise ValueError(f"need max_len >= 2, got {max_len}")
    files, common, listed = host_reader(shards_dir, split, 0, 1, seed=0)
    pairs = [
        pair_arrays(example, max_len, common["pad_id"], common["bos_id"])
        for example in shard_examples(files, _PAIR_FEATURES)
    ]
    if listed is not None and len(pairs) != listed:
        raise DataError(
            f"the {split} shards of {shards_dir} hold {len(pairs)} pairs where the manifest "
            f"lists {listed}; re-shard"
        )
    if not pairs:
        raise DataError(f"the {split} shards of {shards_dir} hold no pairs; use more data")
    return {name: np.stack([pair[name] for pair in pairs]) for name in pairs[0]}
