"""The shard stage's driver: check inputs, run the Beam job, write the manifest."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from components.core import fileio
from components.core.data.tokenizers import load_tokenizer
from components.shard import beam_pipeline, bigquery
from components.shard.config import ShardConfig
from components.shard.eval_split import eval_split_error, least_eval_fraction
from components.shard.manifest import MANIFEST_FILE, build_manifest, conserved, write_manifest
from components.shard.sources import InputError, expand_patterns

log = logging.getLogger(__name__)
SUMMARY_FILE = "rejected/summary.json"
# Beam's DirectRunner first tries Prism, a binary it downloads from GitHub (offline: a failed
# download, then a fallback); for a batch job like this one it falls back to the FnApiRunner,
# which we name directly.
LOCAL_RUNNER = "FnApiRunner"


class ShardError(RuntimeError):
    """The job ran, but its output must not be used: nothing valid, too much rejected, or a
    too small eval split."""


def pipeline_options(config: ShardConfig, beam_args: list[str]) -> Any:
    """Beam options: the given arguments, the local runner when they name none, and its
    worker processes when local."""
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions

    options = PipelineOptions(list(beam_args))
    standard = options.view_as(StandardOptions)
    if standard.runner is None:
        standard.runner = LOCAL_RUNNER
    if standard.runner in (LOCAL_RUNNER, "DirectRunner", "direct"):
        direct = options.view_as(DirectOptions)
        direct.direct_num_workers = config.num_workers
        direct.direct_running_mode = "multi_processing" if config.num_workers > 1 else "in_memory"
    return options


def _clear_output(output: str) -> None:
    """Remove what an earlier run left, so no stale shard or manifest survives."""
    for name in ("train", "eval", "heldout", "rejected", "tokenizer"):
        fileio.remove_tree(fileio.join(output, name))
    for name in (MANIFEST_FILE, beam_pipeline.STATS_FILE):
        path = fileio.join(output, name)
        if fileio.exists(path):
            _remove_file(path)


def _remove_file(path: str) -> None:
    from apache_beam.io.filesystems import FileSystems

    FileSystems.delete([path])


def _check_eval_split(manifest: dict[str, Any], stats: list[dict], config: ShardConfig) -> None:
    """Refuse an eval split smaller than one eval batch of sft and reward."""
    splits = manifest["splits"]
    candidates = [c for s in stats if s["kind"] == "shard" for c in s.get("eval_candidates", [])]
    eval_pairs = splits["eval"]["pairs"]
    least = least_eval_fraction(eval_pairs, candidates, config.min_eval_pairs)
    unique_prompts = splits["train"]["unique_prompts"] + splits["eval"]["unique_prompts"]
    error = eval_split_error(eval_pairs, unique_prompts, config, least)
    if error:
        raise ShardError(error)


def _check(manifest: dict[str, Any], config: ShardConfig, output: str) -> None:
    counts = manifest["counts"]
    if not conserved(counts):
        raise ShardError(f"record counts do not add up: {counts}")
    valid = counts["train"] + counts["eval"] + counts.get("heldout", 0)
    rejected_path = fileio.join(output, beam_pipeline.REJECTED_FILE)
    reasons = ", ".join(f"{k}: {v}" for k, v in manifest["rejected_by_reason"].items()) or "none"
    if counts["input_records"] == 0 or valid == 0:
        raise ShardError(
            f"no valid preference pair or prompt in {counts['input_records']} input records "
            f"(rejected by reason: {reasons}); see {rejected_path} for each record and why"
        )
    kinds = {
        "prompt-only records": counts.get("prompt_only", 0),
        "prompt-completion records": counts.get("completions", 0),
    }
    kinds["preference pairs"] = valid - sum(kinds.values())
    present = {name: n for name, n in kinds.items() if n}
    if len(present) > 1:
        mix = " and ".join(f"{n} {name}" for name, n in present.items())
        raise ShardError(
            f"the inputs mix {mix}; a shard folder holds one kind: shard each kind into its "
            "own output"
        )
    fraction = counts["rejected"] / counts["input_records"]
    if fraction > config.max_invalid_fraction:
        raise ShardError(
            f"{counts['rejected']} of {counts['input_records']} input records "
            f"({fraction:.1%}) were rejected, above max_invalid_fraction="
            f"{config.max_invalid_fraction} (by reason: {reasons}). Fix the data (each record "
            f"and its reason is in {rejected_path}) or raise --max-invalid-fraction"
        )


def _sources(uris: list[str], name: str) -> tuple[list[str], list[str]]:
    """The files and BigQuery tables of ``uris`` (the ``name`` flag's list); a malformed
    table is refused before anything runs."""
    tables = [uri for uri in uris if bigquery.is_table(uri)]
    for uri in tables:
        bigquery.table_parts(uri)
    patterns = [uri for uri in uris if not bigquery.is_table(uri)]
    return (expand_patterns(patterns, name) if patterns or not tables else []), tables


def run(
    config: ShardConfig,
    inputs: list[str],
    output: str,
    beam_args: list[str] = (),
    read_table: Any = bigquery.read_bigquery,
    heldout_inputs: list[str] = (),
) -> dict[str, Any]:
    """Shard the preference files and BigQuery tables ``inputs`` into ``output``; returns
    the manifest. ``read_table``: the tables' Beam source (``bigquery.read_bigquery``).
    ``heldout_inputs`` (files and tables as ``inputs``): pairs from other annotators, all
    put in the heldout split, on which the reward stage trains the held-out model."""
    import apache_beam as beam

    files, tables = _sources(inputs, "input")
    heldout_files, heldout_tables = (
        _sources(heldout_inputs, "heldout_input") if heldout_inputs else ([], [])
    )
    both = sorted(set(files) & set(heldout_files) | set(tables) & set(heldout_tables))
    if both:
        raise InputError(
            f"{both} are both the run's data and held-out data; give each file once "
            "(--input for the data every stage trains on, --heldout-input for the held-out "
            "reward model's alone)"
        )
    heldout = frozenset(heldout_files) | frozenset(heldout_tables)
    files, tables = files + heldout_files, tables + heldout_tables
    tokenizer = load_tokenizer(config.tokenizer)
    _clear_output(output)
    tokenizer.save(fileio.join(output, "tokenizer"))
    log.info("sharding %d file(s), %d table(s) into %s", len(files), len(tables), output)
    started = time.monotonic()
    with beam.Pipeline(options=pipeline_options(config, list(beam_args))) as pipeline:
        beam_pipeline.build(pipeline, files, config, output, tables, read_table, heldout)
    stats_path = fileio.join(output, beam_pipeline.STATS_FILE)
    stats = json.loads(fileio.read_text(stats_path))
    _remove_file(stats_path)
    manifest = build_manifest(stats, config, tokenizer.info(), output, sorted(heldout))
    # The whole job's rate: every source's records over the Beam job's wall time.
    total = len(files) + len(tables)
    records = manifest["counts"]["input_records"]
    print(beam_pipeline.progress_line(total, total, records, time.monotonic() - started))
    try:
        _check(manifest, config, output)
        _check_eval_split(manifest, stats, config)
    except ShardError:
        fileio.write_text(fileio.join(output, SUMMARY_FILE), json.dumps(manifest, indent=2))
        raise
    write_manifest(output, manifest)
    return manifest
