"""The shard stage's manifest: sources, tokenizer, counts that add up, balance, lengths."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

from components.core import fileio
from components.core.data.input_pipeline import MANIFEST, SCHEMA_VERSION
from components.shard.beam_pipeline import REJECTED_FILE, shard_path
from components.shard.config import ShardConfig

# The reader (core.data.input_pipeline) owns the contract; the writer uses its constants.
MANIFEST_FILE = MANIFEST
PERCENTILES = (50, 90, 99)


def percentiles(histogram: Counter) -> dict[str, int]:
    """p50/p90/p99/max of a {length: count} histogram (nearest rank)."""
    total = sum(histogram.values())
    if total == 0:
        return {f"p{p}": 0 for p in PERCENTILES} | {"max": 0}
    out: dict[str, int] = {}
    ordered = sorted(histogram.items())
    for p in PERCENTILES:
        rank = max(1, -(-p * total // 100))  # ceil(p% of total), nearest-rank definition
        seen = 0
        for value, count in ordered:
            seen += count
            if seen >= rank:
                out[f"p{p}"] = value
                break
    out["max"] = ordered[-1][0]
    return out


def _split_summary(shards: list[dict], output: str, num_shards: int) -> dict[str, Any]:
    shards = sorted(shards, key=lambda s: s["shard"])
    pairs = [s["pairs"] for s in shards]
    lengths: dict[str, Counter] = {"prompt": Counter(), "chosen": Counter(), "rejected": Counter()}
    for s in shards:
        for name, histogram in s["lengths"].items():
            lengths[name].update({int(k): v for k, v in histogram.items()})
    return {
        "pairs": sum(pairs),
        "unique_prompts": sum(s["unique_prompts"] for s in shards),
        "truncated": sum(s["truncated"] for s in shards),
        "shards": [
            {
                "file": shard_path("", s["split"], s["shard"], num_shards).lstrip("/"),
                "pairs": s["pairs"],
                "unique_prompts": s["unique_prompts"],
            }
            for s in shards
        ],
        "balance": {
            "min_pairs": min(pairs),
            "max_pairs": max(pairs),
            "min_max_ratio": round(min(pairs) / max(pairs), 4) if max(pairs) else 0.0,
        },
        "token_lengths": {name: percentiles(h) for name, h in lengths.items()},
    }


PREFERENCE_SHARDS = "preference_shards"
PROMPT_SHARDS = "prompt_shards"
COMPLETION_SHARDS = "completion_shards"


SPLITS = ("train", "eval", "heldout")  # in the manifest's order


def build_manifest(
    stats: list[dict],
    config: ShardConfig,
    tokenizer_info: dict,
    output: str,
    heldout_sources: list[str] = (),
) -> dict[str, Any]:
    """The manifest from the job's statistics records; ``heldout_sources``: the inputs whose
    pairs all went to the heldout split."""
    sources = sorted((s for s in stats if s["kind"] == "source"), key=lambda s: s["uri"])
    shards = [s for s in stats if s["kind"] == "shard"]
    by_reason = Counter()
    for s in stats:
        if s["kind"] == "rejected":
            by_reason.update(s["by_reason"])
    splits = {
        split: _split_summary([s for s in shards if s["split"] == split], output, config.num_shards)
        for split in SPLITS
        if any(s["split"] == split for s in shards)  # every split written has its shards'
    }
    gold = {g for s in shards for g in s["gold_rewards"]}
    prompt_only = sum(s.get("prompt_only", 0) for s in shards)
    completions = sum(s.get("completions", 0) for s in shards)
    kind = PREFERENCE_SHARDS
    if prompt_only or completions:
        kind = PROMPT_SHARDS if prompt_only else COMPLETION_SHARDS
    counts = {
        "input_records": sum(s["records"] for s in sources),
        "blank_lines": sum(s["blank_lines"] for s in sources),
        "train": splits["train"]["pairs"],
        "eval": splits["eval"]["pairs"],
        "rejected": sum(by_reason.values()),
        "duplicates": sum(s["duplicates"] for s in shards),
        **({"heldout": splits["heldout"]["pairs"]} if "heldout" in splits else {}),
        "truncated": sum(split["truncated"] for split in splits.values()),
        "prompt_only": prompt_only,
        "completions": completions,
    }
    return {
        "schema_version": SCHEMA_VERSION,
        # What the records are: preference pairs, prompts alone with their columns, or
        # prompts with one completion (a mix is refused by the stage: stage._check).
        "kind": kind,
        "sources": [
            {k: s[k] for k in ("uri", "bytes", "sha256", "records", "blank_lines", "format")}
            for s in sources
        ],
        "tokenizer": tokenizer_info,
        "num_shards": config.num_shards,
        "counts": counts,
        "rejected_by_reason": dict(sorted(by_reason.items())),
        "rejected_file": REJECTED_FILE,
        **({"heldout_sources": sorted(heldout_sources)} if heldout_sources else {}),
        "splits": splits,
        "gold_reward": gold.pop() if len(gold) == 1 and "" not in gold else None,
        "config": dataclasses.asdict(config),
    }


def conserved(counts: dict[str, int]) -> bool:
    """Input records = train + eval + rejected + duplicates."""
    out = counts["train"] + counts["eval"] + counts.get("heldout", 0)
    out += counts["rejected"] + counts["duplicates"]
    return counts["input_records"] == out


def write_manifest(output: str, manifest: dict[str, Any]) -> None:
    fileio.write_text(fileio.join(output, MANIFEST_FILE), json.dumps(manifest, indent=2) + "\n")
