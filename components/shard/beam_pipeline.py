"""The Beam job: read bundles of lines, validate and tokenize, group by shard, write.

    files ─► ReadBundles ─► Reshuffle ─► ProcessBundle ─┬─► GroupByKey(split, shard) ─► WriteShard
               │ (source stats)                         └─► GroupByKey(all) ─► WriteRejected
               └──────────────── all stats ─► ToList ─► _stats.json (read back by the driver)

Lines travel in bundles so per-element costs are paid once per bundle, not per
line. All pairs of one prompt share a shard, so exact duplicates meet in
WriteShard and are removed there, without a shuffle of their own. Each shard
is sorted before writing: the output is identical for any runner and worker
count.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam

from components.core import fileio
from components.shard import bigquery
from components.shard.config import ShardConfig
from components.shard.eval_split import lowest_prompts
from components.shard.records import (
    Rejection,
    TokenPair,
    encode_example,
    process_item,
    split_position,
)
from components.shard.sources import read_source
from components.shard.tfrecord import write_tfrecords

STATS_FILE = "_stats.json"
HELDOUT = "heldout"
REJECTED_FILE = "rejected/rejected.jsonl"


PROGRESS_SECONDS = 10.0


def shard_path(output: str, split: str, shard: int, num_shards: int) -> str:
    """Where shard ``shard`` of ``split`` is written (names as in ARCHITECTURE.md)."""
    return fileio.join(output, split, f"shard-{shard:05d}-of-{num_shards:05d}.tfrecord")


class ReadBundles(beam.DoFn):
    """A file path to bundles of (line, raw, obj, fmt); its SourceInfo to the 'sources' tag.

    Prints a progress line (``[shard] step FILES/TOTAL N records, R records/s``, what a local
    run's terminal shows) after each file and every PROGRESS_SECONDS within one: this
    worker's files and records."""

    def __init__(self, config: ShardConfig, total_files: int = 0) -> None:
        self._config = config
        self._total = total_files

    def setup(self) -> None:
        self._files = self._records = 0
        self._started = self._shown = time.monotonic()

    def process(self, path: str) -> Iterator[Any]:
        for value in read_source(
            path, self._config.format, self._config.lines_per_bundle, self._config.column_map()
        ):
            if isinstance(value, list):
                self._records += len(value)
                if time.monotonic() - self._shown >= PROGRESS_SECONDS:
                    self._progress()
                yield path, value
            else:
                self._files += 1
                self._progress()
                yield beam.pvalue.TaggedOutput(
                    "stats", {"kind": "source", **dataclasses.asdict(value)}
                )

    def _progress(self) -> None:
        self._shown = time.monotonic()
        print(progress_line(self._files, self._total, self._records, self._shown - self._started))


def progress_line(files: int, total: int, records: int, seconds: float) -> str:
    """The shard stage's progress line: files read of all, records, records per second."""
    rate = records / seconds if seconds > 0 else 0.0
    return f"[shard] step {files}/{total} {records} records, {rate:.0f} records/s"


def _entry(pair: TokenPair) -> tuple:
    """What a shard writer needs of a pair: sort key, dedupe key, record and statistics."""
    lengths = (len(pair.prompt_ids), len(pair.chosen_ids), len(pair.rejected_ids))
    return (
        pair.prompt_hash,
        pair.dedupe_key,
        pair.source,
        pair.line,
        encode_example(pair),
        lengths,
        pair.truncated,
        pair.text.gold_reward,
        pair.text.kind,
    )


class ProcessBundle(beam.DoFn):
    """Validate, tokenize and place a bundle; pairs go out grouped by (split, shard). Every
    pair of a held-out source (its file or table uri in ``heldout``) goes to the heldout
    split, whatever its prompt's hash; its shard is still the hash's."""

    def __init__(
        self, config: ShardConfig, tokenizer_dir: str, heldout: frozenset[str] = frozenset()
    ) -> None:
        self._config = config
        self._tokenizer_dir = tokenizer_dir
        self._heldout = heldout
        self._tokenizer = None

    def setup(self) -> None:
        from components.core.data.tokenizers import load_tokenizer

        self._tokenizer = load_tokenizer(self._tokenizer_dir)

    def process(self, element: tuple[str, list]) -> Iterator[Any]:
        source, items = element
        held_out = source in self._heldout
        by_shard: dict[tuple[str, int], list] = {}
        rejected: list[tuple] = []
        for item in items:
            result = process_item(item, source, self._tokenizer, self._config)
            if isinstance(result, Rejection):
                rejected.append(dataclasses.astuple(result))
            else:
                split = HELDOUT if held_out else result.split
                by_shard.setdefault((split, result.shard), []).append(_entry(result))
        yield from by_shard.items()
        if rejected:
            yield beam.pvalue.TaggedOutput("rejected", (0, rejected))


def _length_counts(values: Iterable[int]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items())}


class WriteShard(beam.DoFn):
    """Deduplicate, sort and write one shard's TFRecord file; emit its statistics.

    A train shard also reports its lowest-placed prompts (eval_split.lowest_prompts), from
    which the driver names the eval_fraction that would fill a too-small eval split.
    """

    def __init__(self, output: str, num_shards: int, min_eval_pairs: int = 0) -> None:
        self._output = output
        self._num_shards = num_shards
        self._min_eval_pairs = min_eval_pairs

    def process(self, element: tuple[tuple[str, int], Iterable[list]]) -> Iterator[dict]:
        (split, shard), groups = element
        entries = sorted(entry for group in groups for entry in group)
        kept, seen = [], set()
        for entry in entries:
            if entry[1] not in seen:
                seen.add(entry[1])
                kept.append(entry)
        path = shard_path(self._output, split, shard, self._num_shards)
        fileio.makedirs(fileio.join(self._output, split))
        write_tfrecords(path, (entry[4] for entry in kept))
        candidates = []
        if split == "train" and self._min_eval_pairs:
            per_prompt = Counter(split_position(entry[0]) for entry in kept)
            candidates = lowest_prompts(per_prompt.items(), self._min_eval_pairs)
        yield {
            "kind": "shard",
            "split": split,
            "shard": shard,
            "pairs": len(kept),
            "unique_prompts": len({entry[0] for entry in kept}),
            "duplicates": len(entries) - len(kept),
            "truncated": sum(1 for entry in kept if entry[6]),
            "prompt_only": sum(1 for entry in kept if entry[8] == "prompt"),
            "completions": sum(1 for entry in kept if entry[8] == "completion"),
            "gold_rewards": sorted({entry[7] or "" for entry in kept}),
            "eval_candidates": candidates,
            "lengths": {
                name: _length_counts(entry[5][i] for entry in kept)
                for i, name in enumerate(("prompt", "chosen", "rejected"))
            },
        }


class WriteRejected(beam.DoFn):
    """Write every rejected record, sorted by source and line; emit counts by reason."""

    def __init__(self, output: str) -> None:
        self._output = output

    def process(self, element: tuple[int, Iterable[list]]) -> Iterator[dict]:
        rows = sorted(row for group in element[1] for row in group)
        lines = [Rejection(*row).to_json() for row in rows]
        text = "\n".join(lines) + ("\n" if lines else "")
        fileio.write_text(fileio.join(self._output, REJECTED_FILE), text)
        yield {"kind": "rejected", "by_reason": dict(Counter(row[2] for row in rows))}


def _write_stats(stats: list[dict], output: str) -> None:
    fileio.write_text(fileio.join(output, STATS_FILE), json.dumps(stats))


def build(
    pipeline: beam.Pipeline,
    files: list[str],
    config: ShardConfig,
    output: str,
    tables: list[str] = (),
    read_table: Any = bigquery.read_bigquery,
    heldout: frozenset[str] = frozenset(),
) -> None:
    """Add the shard job's transforms to ``pipeline``: the files', and the BigQuery tables'
    (``read_table(uri)``: Beam's BigQuery source). ``heldout``: the uris among them whose
    pairs all go to the heldout split (ProcessBundle)."""
    tokenizer_dir = fileio.join(output, "tokenizer")
    read = (
        pipeline
        | "Files" >> beam.Create(files)
        | "ReadBundles"
        >> beam.ParDo(ReadBundles(config, len(files))).with_outputs("stats", main="bundles")
    )
    table_bundles, table_stats = bigquery.build_reads(
        pipeline, list(tables), config.lines_per_bundle, read_table, config.column_map(),
        config.format,
    )  # fmt: skip
    processed = (
        (read.bundles, *table_bundles)
        | "AllBundles" >> beam.Flatten()
        | "Spread" >> beam.Reshuffle()
        | "Process"
        >> beam.ParDo(ProcessBundle(config, tokenizer_dir, heldout)).with_outputs(
            "rejected", main="pairs"
        )
    )
    splits = config.splits + ((HELDOUT,) if heldout and HELDOUT not in config.splits else ())
    every_shard = [((s, i), []) for s in splits for i in range(config.num_shards)]
    shard_stats = (
        (processed.pairs, pipeline | "EveryShard" >> beam.Create(every_shard))
        | "AllPairs" >> beam.Flatten()
        | "ByShard" >> beam.GroupByKey()
        | "WriteShard" >> beam.ParDo(WriteShard(output, config.num_shards, config.min_eval_pairs))
    )
    rejected_stats = (
        (processed.rejected, pipeline | "NoRejects" >> beam.Create([(0, [])]))
        | "AllRejected" >> beam.Flatten()
        | "Together" >> beam.GroupByKey()
        | "WriteRejected" >> beam.ParDo(WriteRejected(output))
    )
    _ = (
        (read.stats, *table_stats, shard_stats, rejected_stats)
        | "AllStats" >> beam.Flatten()
        | "StatsList" >> beam.combiners.ToList()
        | "WriteStats" >> beam.Map(_write_stats, output)
    )
