"""tf.data readers over the shard stage's TFRecords: preference pairs (prompts: prompts.py).

Host *h* of *H* reads shards *h*, *h+H*, …. Batches are per host (the global
batch split over hosts) and come out as numpy dicts ready for
:func:`components.core.training.parallel.shard_batch`.

Sequences are ``prompt_ids + response_ids``, right-padded with ``pad_id`` to
``max_len`` (masks mark real tokens). When a pair does not fit, the prompt is
cut from the LEFT first (its end, next to the response, matters most; a leading
bos is kept), down to ``max_len // 2`` tokens, and then the response is cut from
the right. Chosen and rejected share one prompt cut, so a pair differs only in
its responses. ``loss_mask`` marks the chosen response tokens (SFT targets).

Each iterator has a position (batches consumed in total, and the epoch and
batches consumed in it) that is saved in checkpoints: a resumed run rebuilds
that epoch's shuffled order (seeded by seed, epoch and host) and skips the
consumed batches, so it sees exactly the batches an uninterrupted run would.
Hosts step in lockstep, so the total is the same on every host while epochs
may not be (shards differ in size): restoring maps the total onto this host's
own epochs, and a checkpoint needs only process 0's position.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from components.core import fileio
from components.core.data.tensorflow_import import import_tensorflow

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
SHUFFLE_BUFFER = 16_384
# Epochs one tf.data pipeline plans ahead (each with its file order and seed); then the next.
EPOCHS_PER_PIPELINE = 64


class DataError(ValueError):
    """A dataset folder the user has to fix (missing, wrong version, too few shards)."""


def read_manifest(shards_dir: str) -> dict[str, Any]:
    """The shard stage's ``manifest.json``, checked for our schema version."""
    path = fileio.join(shards_dir, MANIFEST)
    if not fileio.exists(path):
        raise DataError(
            f"{path} not found: {shards_dir!r} is not a preference-shards folder; "
            "pass the output of the shard stage"
        )
    manifest = json.loads(fileio.read_text(path))
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise DataError(
            f"{path} has schema_version {version!r}; this version reads {SCHEMA_VERSION}. "
            "Re-run the shard stage with this release"
        )
    return manifest


def require_pairs(manifest: dict[str, Any], shards_dir: str, stage: str) -> None:
    """Refuse shards a stage cannot train on, naming the fix: prompts alone (TRL's
    prompt-only records) to every pair reader; prompt-completion records to any stage but
    sft (they have one response, not a chosen and a rejected one)."""
    kind = manifest.get("kind")
    if kind == "prompt_shards":
        raise DataError(
            f"{shards_dir} holds prompt-only records (no chosen or rejected response): the "
            f"{stage} stage trains on preference pairs. Shard preference data for it, or "
            "start the RL stage from a given policy (--base-policy) on these prompts"
        )
    if kind == "completion_shards" and stage != "sft":
        raise DataError(
            f"{shards_dir} holds prompt-completion records (one response each): the {stage} "
            "stage compares a chosen and a rejected response; they train the sft stage only"
        )


def longest_lengths(manifest: dict[str, Any]) -> tuple[int, int]:
    """The longest prompt and the longest response of the shards, in tokens (from the manifest).

    Stages size their sequences from these when a length is left at 0, so short data
    (like the built-in task's ~20 word tokens) is not padded to a long default. Prompt-only
    shards have no responses: their longest response is 0, which a stage sampling responses
    refuses (:func:`longest_response`).
    """

    def longest(name: str) -> int:
        return max(
            int(split.get("token_lengths", {}).get(name, {}).get("max", 0))
            for split in manifest.get("splits", {}).values()
        )

    prompt = longest("prompt")
    response = max(longest("chosen"), longest("rejected"))  # completions: chosen alone
    if prompt < 1 or (response < 1 and manifest.get("kind") != "prompt_shards"):
        raise DataError("the manifest records no token lengths; set the lengths explicitly")
    return prompt, response


def longest_response(manifest: dict[str, Any], shards_dir: str, stage: str) -> int:
    """The longest response in the shards, for a sampling stage's ``max_new_tokens`` 0; a
    DataError naming the flag when the shards hold prompts alone."""
    response = longest_lengths(manifest)[1]
    if response < 1:
        raise DataError(
            f"{stage}: max_new_tokens 0 takes the longest response in the data, but "
            f"{shards_dir} holds prompts alone (no responses); set --max-new-tokens"
        )
    return response


def check_vocab(manifest: dict[str, Any], model_vocab_size: int) -> None:
    """Refuse shards tokenized with a larger vocabulary than the model's embedding."""
    tokenizer = manifest.get("tokenizer", {})
    data_vocab = tokenizer.get("vocab_size")
    # Larger embeddings are fine: checkpoints pad their vocabulary (Qwen: 151936 rows for
    # 151665 tokens); ids past the embedding are not.
    if data_vocab is None or data_vocab > model_vocab_size:
        raise DataError(
            f"the shards were tokenized with vocab_size {data_vocab} "
            f"({tokenizer.get('kind', 'unknown')} tokenizer), but the model expects "
            f"{model_vocab_size}; build the model with the shards' tokenizer "
            "or re-shard with the model's tokenizer"
        )


def host_shard_files(
    shards_dir: str, split: str, manifest: dict[str, Any], host_index: int, host_count: int
) -> list[str]:
    """This host's shard files of ``split``: shards h, h+H, …, each checked to exist."""
    if split not in manifest.get("splits", {}):
        raise DataError(
            f"split {split!r} is not in {fileio.join(shards_dir, MANIFEST)} "
            f"(it has {sorted(manifest.get('splits', {}))})"
        )
    num_shards = int(manifest["splits"][split].get("num_shards", manifest["num_shards"]))
    if num_shards < host_count:
        raise DataError(
            f"split {split!r} has {num_shards} shard files but there are {host_count} hosts; "
            f"re-shard with num_shards >= {host_count} so every host has data"
        )
    files = []
    for index in range(host_index, num_shards, host_count):
        path = fileio.join(shards_dir, split, f"shard-{index:05d}-of-{num_shards:05d}.tfrecord")
        if not fileio.exists(path):
            raise DataError(
                f"{path} is listed by the manifest but missing; the shards folder is "
                "incomplete: copy it again or re-run the shard stage"
            )
        files.append(path)
    return files


def _host(host_index: int | None, host_count: int | None) -> tuple[int, int]:
    import jax

    index = jax.process_index() if host_index is None else host_index
    count = jax.process_count() if host_count is None else host_count
    if not 0 <= index < count:
        raise ValueError(f"host_index must be in [0, {count}), got {index}")
    return index, count


def epoch_seed(seed: int, epoch: int, host_index: int) -> int:
    # One independent, reproducible stream per (seed, epoch, host).
    return int(np.random.SeedSequence([seed, epoch, host_index]).generate_state(1)[0])


def _parse_fn():
    tf = import_tensorflow()

    features = {
        "prompt_ids": tf.io.RaggedFeature(tf.int64),
        "chosen_ids": tf.io.RaggedFeature(tf.int64),
        "rejected_ids": tf.io.RaggedFeature(tf.int64),
        "margin": tf.io.FixedLenFeature([], tf.float32, default_value=0.0),
        "prompt_hash": tf.io.FixedLenFeature([], tf.int64, default_value=0),
    }

    def parse(record):
        example = tf.io.parse_single_example(record, features)
        return {
            name: tf.cast(value, tf.int32) if name.endswith("_ids") else value
            for name, value in example.items()
        }

    return parse


def _cut_prompt(tf, prompt, keep, bos_id: int | None):
    """The last ``keep`` tokens of ``prompt``, keeping a leading bos when there is one."""
    length = tf.shape(prompt)[0]
    drop = tf.maximum(length - keep, 0)
    if bos_id is None:
        return prompt[drop:]
    starts_with_bos = tf.reduce_any(tf.equal(prompt[:1], bos_id))  # False when empty
    kept_bos = tf.concat([prompt[:1], prompt[1 + drop :]], 0)
    return tf.cond(
        tf.logical_and(drop > 0, starts_with_bos), lambda: kept_bos, lambda: prompt[drop:]
    )


def _pair_fn(max_len: int, pad_id: int, bos_id: int | None):
    tf = import_tensorflow()

    positions = tf.range(max_len)

    def sequence(prompt, response):
        tokens = tf.concat([prompt, response], 0)[:max_len]
        length = tf.shape(tokens)[0]
        padded = tf.pad(tokens, [[0, max_len - length]], constant_values=pad_id)
        mask = positions < length
        response_mask = tf.logical_and(mask, positions >= tf.shape(prompt)[0])
        return tf.ensure_shape(padded, [max_len]), mask, response_mask

    def to_pair(example):
        prompt = example["prompt_ids"]
        response_len = tf.maximum(tf.size(example["chosen_ids"]), tf.size(example["rejected_ids"]))
        # Keep the whole prompt when it fits, else cut it to max(room left, max_len // 2).
        keep = tf.maximum(max_len - response_len, tf.minimum(tf.size(prompt), max_len // 2))
        prompt = _cut_prompt(tf, prompt, keep, bos_id)
        chosen, chosen_mask, loss_mask = sequence(prompt, example["chosen_ids"])
        rejected, rejected_mask, _ = sequence(prompt, example["rejected_ids"])
        return {
            "chosen_tokens": chosen,
            "chosen_mask": chosen_mask,
            "loss_mask": loss_mask,
            "rejected_tokens": rejected,
            "rejected_mask": rejected_mask,
            "margin": example["margin"],
        }

    return to_pair


class PositionedBatches(Iterator[dict[str, np.ndarray]]):
    """Position bookkeeping shared by the readers: epoch, batches in it, batches in total."""

    repeat: bool

    def __init__(self) -> None:
        self.epoch, self.batches_in_epoch, self.batches_total = 0, 0, 0

    @abc.abstractmethod
    def batches_per_epoch(self) -> int:
        """Full batches in one pass over this host's data."""

    def _advance(self) -> None:
        self.batches_in_epoch += 1
        self.batches_total += 1

    def _next_epoch(self) -> None:
        self.epoch, self.batches_in_epoch = self.epoch + 1, 0

    def position(self) -> dict[str, int]:
        """Where the next batch comes from, as JSON for a checkpoint."""
        return {
            "batches_total": self.batches_total,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
        }

    def restore(self, position: dict[str, int]) -> None:
        """Continue from a :meth:`position` (of this host or, in lockstep, of process 0)."""
        self.batches_total = int(position["batches_total"])
        per_epoch = self.batches_per_epoch()
        epoch, in_epoch = divmod(self.batches_total, per_epoch)
        if not self.repeat and epoch:
            epoch, in_epoch = 0, per_epoch  # a single pass, already used up
        self.epoch, self.batches_in_epoch = epoch, in_epoch


class PreferenceBatches(PositionedBatches):
    """Padded preference-pair batches of one host, with a saveable position."""

    def __init__(
        self, files: list[str], *, batch_size: int, max_len: int, pad_id: int,
        bos_id: int | None, seed: int, host_index: int, shuffle: bool, repeat: bool,
        pairs: int | None = None,
    ) -> None:  # fmt: skip
        self.files, self.batch_size, self.max_len = files, batch_size, max_len
        self.pairs = pairs  # in ``files``, from the manifest; None: counted on first use
        self.pad_id, self.bos_id, self.seed = pad_id, bos_id, seed
        self.host_index, self.shuffle, self.repeat = host_index, shuffle, repeat
        self._iterator: Iterator | None = None
        self._batches_per_epoch: int | None = None
        super().__init__()

    def batches_per_epoch(self) -> int:
        """Full batches in one pass over this host's shard files (the manifest's count, or
        counted once by reading them)."""
        if self._batches_per_epoch is None:
            records = self.pairs
            if records is None:
                tf = import_tensorflow()

                records = tf.data.TFRecordDataset(self.files).reduce(0, lambda n, _: n + 1)
            self._batches_per_epoch = int(records) // self.batch_size
            if not self._batches_per_epoch:
                raise DataError(
                    f"{self.files} hold {int(records)} pairs, fewer than batch_size="
                    f"{self.batch_size}; lower the batch size or use more data"
                )
        return self._batches_per_epoch

    def _epoch_plan(self) -> tuple[np.ndarray, ...]:
        """The next EPOCHS_PER_PIPELINE epochs (or the one pass) from the current position: each
        one's number, file order, shuffle seed and batches to skip (only the first's may be > 0)."""
        epochs = np.arange(self.epoch, self.epoch + (EPOCHS_PER_PIPELINE if self.repeat else 1))
        seeds = np.array([epoch_seed(self.seed, int(e), self.host_index) for e in epochs])
        files = np.array([self.files] * len(epochs), dtype=object)
        if self.shuffle:
            for row, seed in zip(files, seeds, strict=True):
                row[:] = row[np.random.default_rng(int(seed)).permutation(len(row))]
        skips = np.zeros(len(epochs), np.int64)
        skips[0] = self.batches_in_epoch
        return epochs, files, seeds.astype(np.int64), skips

    def _dataset(self):
        """The planned epochs as one tf.data pipeline of (epoch, batch).

        Built (and its functions traced) once, not per epoch: the next epoch's files open and
        its shuffle buffer fills in the prefetch, while the steps of this one run.
        """
        tf = import_tensorflow()
        self.batches_per_epoch()  # refuses shards that cannot fill one batch
        parse, to_pair = _parse_fn(), _pair_fn(self.max_len, self.pad_id, self.bos_id)

        def epoch_batches(epoch, files, seed, skip):
            dataset = tf.data.TFRecordDataset(files).map(parse)
            if self.shuffle:
                dataset = dataset.shuffle(SHUFFLE_BUFFER, seed=seed, reshuffle_each_iteration=False)
            dataset = dataset.map(to_pair, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            # Fixed shapes: every pmap step sees the same batch size.
            dataset = dataset.batch(self.batch_size, drop_remainder=True).skip(skip)
            return dataset.map(lambda batch: (epoch, batch))

        plan = tf.data.Dataset.from_tensor_slices(self._epoch_plan())
        # No autotune: destroying a reader waits for its autotune thread (Model::OptimizeLoop)
        # to end its sleep, up to a minute in TF 2.21, inside whichever garbage collection frees
        # the reader (a demo sft stage stalled 39 s in one). Map parallelism stays at
        # min(16, cores), which read faster here than autotuned.
        options = tf.data.Options()
        options.autotune.enabled = False
        return plan.flat_map(epoch_batches).prefetch(2).with_options(options)

    def __next__(self) -> dict[str, np.ndarray]:
        for _ in range(2):
            if self._iterator is None:
                self._iterator = self._dataset().as_numpy_iterator()
            epoch, batch = next(self._iterator, (None, None))
            if batch is not None:
                if epoch != self.epoch:
                    self._next_epoch()
                self._advance()
                return batch
            if self.batches_in_epoch == 0:  # the manifest counted pairs the files lack
                raise DataError(f"{self.files} hold fewer pairs than the manifest lists; re-shard")
            if not self.repeat:
                raise StopIteration  # the one pass is used up
            self._iterator = None  # the planned epochs are: plan the next ones
            self._next_epoch()
        raise StopIteration

    def restore(self, position: dict[str, int]) -> None:
        """Continue from a :meth:`position`: the next batch is the one it named."""
        super().restore(position)
        self._iterator = None


def host_reader(
    shards_dir: str, split: str, host_index: int | None, host_count: int | None, seed: int
) -> tuple[list[str], dict[str, Any], int | None]:
    """This host's shard files, the reader arguments every dataset shares, and the pairs
    in those files as the manifest lists them (:func:`_listed_pairs`)."""
    host_index, host_count = _host(host_index, host_count)
    manifest = read_manifest(shards_dir)
    tokenizer = manifest.get("tokenizer", {})
    files = host_shard_files(shards_dir, split, manifest, host_index, host_count)
    common = {
        "pad_id": int(tokenizer["pad_id"]),
        "bos_id": tokenizer.get("bos_id"),
        "seed": seed,
        "host_index": host_index,
    }
    return files, common, _listed_pairs(manifest, split, files)


def preference_dataset(
    shards_dir: str,
    split: str,
    *,
    batch_size: int,
    max_len: int,
    seed: int,
    host_index: int | None = None,
    host_count: int | None = None,
    shuffle: bool = True,
    repeat: bool = True,
) -> PreferenceBatches:
    """Preference-pair batches of this host (``batch_size`` is the per-host batch)."""
    if batch_size < 1 or max_len < 2:
        raise ValueError(f"need batch_size >= 1 and max_len >= 2, got {batch_size}, {max_len}")
    manifest = read_manifest(shards_dir)
    if manifest.get("kind") == "prompt_shards":  # completions: sft's, checked by its stage
        require_pairs(manifest, shards_dir, "this")
    files, common, pairs = host_reader(shards_dir, split, host_index, host_count, seed)
    return PreferenceBatches(
        files, batch_size=batch_size, max_len=max_len, shuffle=shuffle, repeat=repeat,
        pairs=pairs, **common,
    )  # fmt: skip


def _listed_pairs(manifest: dict[str, Any], split: str, files: list[str]) -> int | None:
    """The pairs in ``files`` as the manifest lists them per shard (None: it does not).

    The shard stage writes each file's count, so a reader knows its epoch length without
    a pass over its shards (else read whole at every start, from a bucket in the cloud).
    """
    listed = {s.get("file"): s.get("pairs") for s in manifest["splits"][split].get("shards", [])}
    counts = [listed.get(f"{split}/{path.rsplit('/', 1)[-1]}") for path in files]
    return None if None in counts else sum(counts)
