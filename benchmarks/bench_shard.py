"""Shard-stage throughput: Beam (DirectRunner, 1 and 2 workers) vs a plain-Python baseline.

The baseline does the same work in one process with the same functions: read
and parse, validate, tokenize, encode, deduplicate, sort and write TFRecord shards.
Prints pairs/s of each and the ratios. Target: Beam at 2 workers >= 0.5x.

    .venv/bin/python benchmarks/bench_shard.py [--pairs 200000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from components.core.data.builtin_task import write_jsonl  # noqa: E402
from components.core.data.tokenizers import load_tokenizer  # noqa: E402
from components.shard import ShardConfig, run  # noqa: E402
from components.shard.beam_pipeline import shard_path  # noqa: E402
from components.shard.records import Rejection, encode_example, process_item  # noqa: E402
from components.shard.sources import read_source  # noqa: E402
from components.shard.tfrecord import write_tfrecords  # noqa: E402


def plain_python_shard(path: str, config: ShardConfig, output: str) -> int:
    """The baseline: one process, same parse/validate/tokenize/dedupe/sort/write."""
    tokenizer = load_tokenizer(config.tokenizer)
    shards: dict[tuple[str, int], list] = {}
    for value in read_source(path, config.format, config.lines_per_bundle):
        if not isinstance(value, list):
            continue
        for item in value:
            pair = process_item(item, path, tokenizer, config)
            if not isinstance(pair, Rejection):
                entry = (pair.prompt_hash, pair.dedupe_key, encode_example(pair))
                shards.setdefault((pair.split, pair.shard), []).append(entry)
    written = 0
    for (split, shard), entries in shards.items():
        os.makedirs(os.path.join(output, split), exist_ok=True)
        seen = set()
        kept = []
        for _, key, data in sorted(entries):
            if key not in seen:
                seen.add(key)
                kept.append(data)
        write_tfrecords(shard_path(output, split, shard, config.num_shards), kept)
        written += len(kept)
    return written


def timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--num-shards", type=int, default=8)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench_shard_")
    try:
        data = os.path.join(work, "pairs.jsonl")
        write_jsonl(data, args.pairs, seed=0)
        config = ShardConfig(num_shards=args.num_shards)
        base_s, base_n = timed(plain_python_shard, data, config, os.path.join(work, "baseline"))
        results = {}
        for workers in (1, 2):
            cfg = ShardConfig(num_shards=args.num_shards, num_workers=workers)
            secs, manifest = timed(run, cfg, [data], os.path.join(work, f"beam{workers}"))
            kept = manifest["counts"]["train"] + manifest["counts"]["eval"]
            assert kept == base_n, f"Beam kept {kept} pairs, baseline {base_n}"
            results[workers] = secs
        print(f"pairs: {args.pairs} (kept: {base_n}); shards per split: {args.num_shards}")
        print(f"plain Python, 1 process : {args.pairs / base_s:10.0f} pairs/s  ({base_s:.1f} s)")
        for workers, secs in results.items():
            ratio = base_s / secs
            print(
                f"Beam DirectRunner, {workers} worker{'s' if workers > 1 else ' '}: "
                f"{args.pairs / secs:10.0f} pairs/s  ({secs:.1f} s)  ratio to baseline {ratio:.2f}x"
            )
        print(f"target: Beam at 2 workers >= 0.5x baseline -> {base_s / results[2]:.2f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
