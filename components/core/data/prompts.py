"""Unique-prompt batches for sampling (PPO rollouts, evaluation), read without TensorFlow.

A prompt reader needs one plain pass over its shards, not tf.data's pipeline: core's
TFRecord reader (:mod:`components.core.data.tfrecord`) does it, so a PPO stage never
imports TensorFlow (3-4 s of a stage's start on 2 cores). Hosts, positions and epochs
work as for the pair readers (:mod:`components.core.data.input_pipeline`).
"""

from __future__ import annotations

import hashlib

import numpy as np

from components.core.data.input_pipeline import (
    DataError,
    PositionedBatches,
    epoch_seed,
    host_reader,
)
from components.core.data.pairs import cut_prompt, shard_examples

_NO_TOKENS = np.zeros(0, np.int64)
_PROMPT_FEATURES = frozenset({"prompt_ids", "prompt_hash"})
# What reward functions read beside the tokens: the prompt's text and its record's other
# fields (JSON; "{}" for a pair's prompt). Batches carry them as object arrays, on the host.
TEXT_KEYS = ("prompt_text", "columns")


def holdout_position(prompt_hash: int) -> float:
    """A prompt's place in [0, 1) for a hold-out of ``fraction``: held out when below it.

    A sha256 of the prompt hash, so the hold-out shares no bits with the eval split's or the
    shard's choice (shard.records.place): any fraction of the train prompts is a uniform draw.
    """
    digest = hashlib.sha256(b"holdout:" + int(prompt_hash).to_bytes(8, "big", signed=True))
    return int.from_bytes(digest.digest()[:8], "big") / 2.0**64


def _text(example: dict, name: str, default: str) -> str:
    values = example.get(name) or [default.encode()]
    return values[0].decode("utf-8")


def unique_prompts(
    files: list[str], holdout: float = 0.0, held_out: bool = False, texts: list | None = None
) -> list[np.ndarray]:
    """The distinct prompts of ``files`` (by ``prompt_hash``), in file order: with ``holdout``
    > 0 only those outside that fraction (:func:`holdout_position`), or with ``held_out``
    only those in it. ``texts``, when given, receives each kept prompt's (text, columns)."""
    seen: set[int] = set()
    prompts = []
    features = _PROMPT_FEATURES | ({"prompt", "columns"} if texts is not None else set())
    for example in shard_examples(files, features):
        hashes = example.get("prompt_hash", ())
        prompt_hash = int(hashes[0]) if len(hashes) else 0
        if prompt_hash in seen:
            continue
        seen.add(prompt_hash)
        if holdout > 0 and (holdout_position(prompt_hash) < holdout) != held_out:
            continue
        prompts.append(example.get("prompt_ids", _NO_TOKENS).astype(np.int32))
        if texts is not None:
            texts.append((_text(example, "prompt", ""), _text(example, "columns", "{}")))
    return prompts


def left_pad(prompt: np.ndarray, prompt_len: int, pad_id: int, bos_id: int | None):
    """``prompt`` cut to its last ``prompt_len`` tokens (keeping bos), padded on the left."""
    prompt = cut_prompt(prompt, prompt_len, bos_id)
    tokens = np.full(prompt_len, pad_id, np.int32)
    mask = np.zeros(prompt_len, bool)
    if len(prompt):
        tokens[-len(prompt) :], mask[-len(prompt) :] = prompt, True
    return tokens, mask


class PromptBatches(PositionedBatches):
    """Left-padded batches of one host's unique prompts (for sampling), with a position."""

    def __init__(
        self,
        prompts: list[np.ndarray],
        *,
        batch_size: int,
        prompt_len: int,
        pad_id: int,
        bos_id: int | None,
        seed: int,
        host_index: int,
        shuffle: bool,
        repeat: bool,
        texts: list[tuple[str, str]] | None = None,
    ) -> None:
        """``texts``: each prompt's (text, columns JSON); batches then carry them too
        (``TEXT_KEYS``, object arrays)."""
        if len(prompts) < batch_size:
            raise DataError(
                f"this host has {len(prompts)} unique prompts, fewer than batch_size="
                f"{batch_size}; lower the batch size or use more data"
            )
        pairs = [left_pad(p, prompt_len, pad_id, bos_id) for p in prompts]
        self.tokens = np.stack([tokens for tokens, _ in pairs])
        self.masks = np.stack([mask for _, mask in pairs])
        self.texts = None
        if texts is not None:
            self.texts = np.empty((len(texts), 2), object)
            self.texts[:] = texts
        self.batch_size, self.seed, self.host_index = batch_size, seed, host_index
        self.shuffle, self.repeat = shuffle, repeat
        self._batches_per_epoch = len(prompts) // batch_size
        super().__init__()

    def batches_per_epoch(self) -> int:
        """Full batches of unique prompts in one pass."""
        return self._batches_per_epoch

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.tokens))
        rng = np.random.default_rng(epoch_seed(self.seed, self.epoch, self.host_index))
        return rng.permutation(len(self.tokens))

    def __next__(self) -> dict[str, np.ndarray]:
        if self.batches_in_epoch == self._batches_per_epoch:
            if not self.repeat:
                raise StopIteration
            self._next_epoch()
        start = self.batches_in_epoch * self.batch_size
        rows = self._order()[start : start + self.batch_size]
        self._advance()
        batch = {"prompt_tokens": self.tokens[rows], "prompt_mask": self.masks[rows]}
        if self.texts is not None:
            batch.update(zip(TEXT_KEYS, self.texts[rows].T, strict=True))
        return batch


def prompt_dataset(
    shards_dir: str,
    split: str,
    *,
    batch_size: int,
    prompt_len: int,
    seed: int,
    host_index: int | None = None,
    host_count: int | None = None,
    shuffle: bool = True,
    repeat: bool = True,
    holdout: float = 0.0,
    held_out: bool = False,
    with_text: bool = False,
) -> PromptBatches:
    """Batches of this host's unique prompts, left-padded to ``prompt_len`` (PPO rollouts);
    ``holdout``/``held_out``: without, or only, that fraction of them (:func:`unique_prompts`);
    ``with_text``: each batch also carries the prompts' texts and columns (``TEXT_KEYS``)."""
    if batch_size < 1 or prompt_len < 1:
        raise ValueError(f"need batch_size, prompt_len >= 1, got {batch_size}, {prompt_len}")
    files, common, _ = host_reader(shards_dir, split, host_index, host_count, seed)
    texts: list | None = [] if with_text else None
    prompts = unique_prompts(files, holdout, held_out, texts)
    if holdout > 0 and len(prompts) < batch_size:
        part = "held out" if held_out else "left after the hold-out"
        raise DataError(
            f"{shards_dir}: {len(prompts)} {split} prompts {part} of {holdout} on this host, "
            f"fewer than batch_size={batch_size}; change the fraction (PPO's "
            "validation_fraction) or use more data"
        )
    return PromptBatches(
        prompts,
        batch_size=batch_size,
        prompt_len=prompt_len,
        shuffle=shuffle,
        repeat=repeat,
        texts=texts,
        **common,
    )
