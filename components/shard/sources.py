"""Reading preference files (JSONL or Parquet, local or any Beam filesystem) line by line.

Lines travel in bundles of ``(line, raw, obj, fmt)``: ``obj`` is the parsed
value where the file format already parsed it (Parquet rows), None (JSONL
text, parsed later, in parallel) or an ``Invalid`` for a line that cannot be
read as text; ``fmt`` is the file's record format as far
as it is known at that line (detected from the first recognisable object).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from collections.abc import Iterator
from typing import Any

from components.shard.formats import Invalid, detect_format

PARQUET_SUFFIXES = (".parquet", ".pq")
CHUNK_BYTES = 1 << 20

Item = tuple[int, str, Any, str | None]


@dataclasses.dataclass(slots=True)
class SourceInfo:
    """What the manifest records of one input file."""

    uri: str
    bytes: int = 0
    sha256: str = ""
    records: int = 0
    blank_lines: int = 0
    format: str | None = None


class InputError(ValueError):
    """An input path or pattern the user can fix."""


def expand_patterns(patterns: list[str]) -> list[str]:
    """Every file matched by the given paths or globs, sorted; an unmatched pattern is an error."""
    from apache_beam.io.filesystems import FileSystems

    if not patterns:
        raise InputError("input: no input files given; pass --input PATH_OR_GLOB")
    files: set[str] = set()
    for pattern in patterns:
        matches = FileSystems.match([pattern])[0].metadata_list
        if not matches:
            raise InputError(f"input: {pattern!r} matches no file; check the path or glob")
        folders = [m.path for m in matches if "://" not in m.path and os.path.isdir(m.path)]
        if folders:
            raise InputError(
                f"input: {folders[0]!r} is a folder; pass its files, e.g. "
                f"--input '{folders[0].rstrip('/')}/*.jsonl'"
            )
        files.update(m.path for m in matches)
    return sorted(files)


class _Detector:
    def __init__(self, forced: str) -> None:
        self.format = None if forced == "auto" else forced

    def see(self, raw: str, obj: Any) -> str | None:
        if self.format is None:
            if isinstance(obj, Invalid):
                return None
            if obj is None:
                try:
                    obj = json.loads(raw)
                except (ValueError, RecursionError):
                    return None
            if isinstance(obj, dict):
                self.format = detect_format(obj)
        return self.format


def _jsonl_lines(handle: Any, hasher: Any, info: SourceInfo) -> Iterator[tuple[int, str]]:
    buffer = b""
    number = 0
    while chunk := handle.read(CHUNK_BYTES):
        hasher.update(chunk)
        info.bytes += len(chunk)
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for data in lines:
            number += 1
            yield number, data
    if buffer:
        yield number + 1, buffer


def _decode(number: int, data: bytes) -> tuple[str, Invalid | None]:
    """A JSONL line as text; undecodable bytes give an Invalid to reject it with."""
    invalid = None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        text = data.decode("utf-8", errors="replace")
        invalid = Invalid("not_json", f"line is not valid UTF-8: {error}")
    if number == 1:
        text = text.removeprefix("\ufeff")
    return text.rstrip("\r"), invalid


def _parquet_rows(handle: Any, hasher: Any, info: SourceInfo) -> Iterator[tuple[int, str, Any]]:
    import pyarrow.parquet as pq

    data = handle.read()
    hasher.update(data)
    info.bytes = len(data)
    number = 0
    for batch in pq.ParquetFile(io.BytesIO(data)).iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            number += 1
            yield number, json.dumps(row, ensure_ascii=False, default=str), row


def read_source(
    path: str, forced_format: str, lines_per_bundle: int
) -> Iterator[list[Item] | SourceInfo]:
    """Bundles of items of one file, then its SourceInfo as the last value."""
    from apache_beam.io.filesystems import FileSystems

    info = SourceInfo(uri=path)
    hasher = hashlib.sha256()
    detector = _Detector(forced_format)
    bundle: list[Item] = []
    with FileSystems.open(path) as handle:
        if path.lower().endswith(PARQUET_SUFFIXES):
            rows = _parquet_rows(handle, hasher, info)
        else:
            rows = ((n, data, None) for n, data in _jsonl_lines(handle, hasher, info))
        for number, raw, obj in rows:
            if isinstance(raw, bytes):
                if not raw.strip():
                    info.blank_lines += 1
                    continue
                raw, obj = _decode(number, raw)
            info.records += 1
            bundle.append((number, raw, obj, detector.see(raw, obj)))
            if len(bundle) >= lines_per_bundle:
                yield bundle
                bundle = []
    if bundle:
        yield bundle
    info.sha256 = hasher.hexdigest()
    info.format = detector.format
    yield info
