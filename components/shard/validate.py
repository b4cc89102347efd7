"""Validation without writing: what ``alignpipe data validate`` reports per reason."""

from __future__ import annotations

import dataclasses
from collections import Counter

from components.core.data.tokenizers import load_tokenizer
from components.shard.config import ShardConfig
from components.shard.eval_split import eval_split_error, least_eval_fraction
from components.shard.records import Rejection, process_item, split_position
from components.shard.sources import SourceInfo, expand_patterns, read_source

EXAMPLES_PER_REASON = 3


@dataclasses.dataclass(slots=True)
class ValidationReport:
    """Counts of a dry run over the input files."""

    records: int = 0
    valid: int = 0
    duplicates: int = 0
    by_reason: Counter = dataclasses.field(default_factory=Counter)
    examples: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    sources: list[SourceInfo] = dataclasses.field(default_factory=list)
    eval_pairs: int = 0
    prompts: set[int] = dataclasses.field(default_factory=set)  # prompt hashes
    train_prompts: Counter = dataclasses.field(default_factory=Counter)  # position → pairs

    @property
    def rejected(self) -> int:
        return sum(self.by_reason.values())

    @property
    def rejected_fraction(self) -> float:
        return self.rejected / self.records if self.records else 1.0

    def eval_problem(self, config: ShardConfig) -> str | None:
        """Why the shard stage would refuse the eval split, or None (eval_split.py)."""
        least = least_eval_fraction(
            self.eval_pairs, self.train_prompts.items(), config.min_eval_pairs
        )
        return eval_split_error(self.eval_pairs, len(self.prompts), config, least)

    def passes(self, config: ShardConfig) -> bool:
        return (
            self.valid > 0
            and self.rejected_fraction <= config.max_invalid_fraction
            and self.eval_problem(config) is None
        )

    def render(self, config: ShardConfig) -> str:
        limit = config.max_invalid_fraction
        lines = [f"{s.uri}: {s.records} records, format {s.format}" for s in self.sources]
        lines.append(
            f"records {self.records}  valid {self.valid}  duplicates {self.duplicates}  "
            f"rejected {self.rejected} ({self.rejected_fraction:.2%}; limit {limit:.2%})"
        )
        for reason, count in self.by_reason.most_common():
            lines.append(f"  {reason:<22} {count:>8}   e.g. {', '.join(self.examples[reason])}")
        lines.append(
            f"eval split {self.eval_pairs} pairs of {len(self.prompts)} unique prompts "
            f"(min_eval_pairs {config.min_eval_pairs})"
        )
        problem = self.eval_problem(config) if self.valid else None
        if problem:
            lines.append(f"  {problem}")
        if self.passes(config):
            lines.append("PASS: the shard stage would accept this data")
        else:
            lines.append("FAIL: the shard stage would refuse this data")
        return "\n".join(lines)


def validate_files(patterns: list[str], config: ShardConfig) -> ValidationReport:
    """Parse, validate and tokenize every record of the files; write nothing."""
    tokenizer = load_tokenizer(config.tokenizer)
    report = ValidationReport()
    seen: set[bytes] = set()
    for path in expand_patterns(patterns):
        for value in read_source(path, config.format, config.lines_per_bundle, config.column_map()):
            if isinstance(value, SourceInfo):
                report.sources.append(value)
                report.records += value.records
                continue
            for item in value:
                result = process_item(item, path, tokenizer, config)
                if isinstance(result, Rejection):
                    report.by_reason[result.reason] += 1
                    examples = report.examples.setdefault(result.reason, [])
                    if len(examples) < EXAMPLES_PER_REASON:
                        examples.append(f"{path}:{result.line}")
                elif result.dedupe_key in seen:
                    report.duplicates += 1
                else:
                    seen.add(result.dedupe_key)
                    report.valid += 1
                    report.prompts.add(result.prompt_hash)
                    if result.split == "eval":
                        report.eval_pairs += 1
                    else:
                        report.train_prompts[split_position(result.prompt_hash)] += 1
    return report
