"""Validation without writing: what ``alignpipe data validate`` reports per reason."""

from __future__ import annotations

import dataclasses
from collections import Counter

from components.core.tokenizers import load_tokenizer
from components.shard.config import ShardConfig
from components.shard.records import Rejection, process_item
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

    @property
    def rejected(self) -> int:
        return sum(self.by_reason.values())

    @property
    def rejected_fraction(self) -> float:
        return self.rejected / self.records if self.records else 1.0

    def passes(self, max_invalid_fraction: float) -> bool:
        return self.valid > 0 and self.rejected_fraction <= max_invalid_fraction

    def render(self, max_invalid_fraction: float) -> str:
        lines = [f"{s.uri}: {s.records} records, format {s.format}" for s in self.sources]
        lines.append(
            f"records {self.records}  valid {self.valid}  duplicates {self.duplicates}  "
            f"rejected {self.rejected} ({self.rejected_fraction:.2%}; "
            f"limit {max_invalid_fraction:.2%})"
        )
        for reason, count in self.by_reason.most_common():
            lines.append(f"  {reason:<22} {count:>8}   e.g. {', '.join(self.examples[reason])}")
        if self.passes(max_invalid_fraction):
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
        for value in read_source(path, config.format, config.lines_per_bundle):
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
    return report
