"""Reading preference files (local or any Beam filesystem) record by record: JSON Lines, JSON
arrays, Parquet, CSV and Arrow (IPC stream, as ``datasets.save_to_disk`` writes, or file), the
formats Hugging Face ``datasets`` reads from a folder (``hf_datasets.py``). The table formats
are read a record batch at a time, never whole into memory; their sha256 is a streamed pass.

Lines travel in bundles of ``(line, raw, obj, fmt)``: ``obj`` is the parsed
value where the file format already parsed it (Parquet rows), None (JSONL
text, parsed later, in parallel) or an ``Invalid`` for a line that cannot be
read as text; ``fmt`` is the file's record format as far
as it is known at that line (detected from the first recognisable object).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

from components.core.data import hf_datasets
from components.shard.formats import Invalid, detect_format
from components.shard.invalid import renamed

PARQUET_SUFFIXES = (".parquet", ".pq")
CSV_SUFFIXES = (".csv",)
ARROW_SUFFIXES = (".arrow",)
JSON_SUFFIXES = (".json",)  # JSON Lines, or one JSON array of records
CHUNK_BYTES = 1 << 20
BATCH_ROWS = 4096  # rows per record batch read from a table file
ARROW_FILE_MAGIC = b"ARROW1"  # the Arrow IPC file format; the stream format has none

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


def expand_patterns(patterns: list[str], name: str = "input") -> list[str]:
    """Every file matched by the given paths or globs, sorted; a folder is a Hugging Face
    dataset (its train split's files, ``hf_datasets``); an unmatched pattern is an error
    (naming the ``name`` flag: input, heldout_input)."""
    from apache_beam.io.filesystems import FileSystems

    if not patterns:
        raise InputError(f"{name}: no input files given; pass --input PATH_OR_GLOB")
    files: set[str] = set()
    for pattern in patterns:
        if hf_datasets.is_dataset_folder(pattern):
            try:
                files.update(hf_datasets.dataset_files(pattern))
            except hf_datasets.DatasetFolderError as error:
                raise InputError(f"{name}: {error}") from None
            continue
        matches = FileSystems.match([pattern])[0].metadata_list
        if not matches:
            raise InputError(f"{name}: {pattern!r} matches no file; check the path or glob")
        # A glob may match local folders too (object stores list objects only): their
        # files come only through a folder named as such, above.
        files.update(m.path for m in matches if "://" in m.path or not os.path.isdir(m.path))
    return sorted(files)


class _Detector:
    def __init__(self, forced: str, columns: dict[str, str]) -> None:
        self.format = None if forced == "auto" else forced
        self.columns = columns  # read as renamed (ShardConfig.columns)

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
                try:
                    self.format = detect_format(renamed(obj, self.columns))
                except Invalid:  # a column clash: the record goes to rejected/
                    return None
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


def _sha256(path: str, info: SourceInfo) -> str:
    """A table file's sha256 and size, read in chunks (its reader seeks: no hash on the way)."""
    from apache_beam.io.filesystems import FileSystems

    hasher = hashlib.sha256()
    with FileSystems.open(path) as handle:
        while chunk := handle.read(CHUNK_BYTES):
            hasher.update(chunk)
            info.bytes += len(chunk)
    return hasher.hexdigest()


def _batches(path: str, handle: Any) -> Iterator[Any]:
    """Record batches of a table file: Parquet, CSV or Arrow (IPC stream or file)."""
    import pyarrow as pa

    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        import pyarrow.parquet as pq

        # pre_buffer (pyarrow's default) reads every row group's column chunks up front:
        # the whole file, measured (tests/test_shard_datasets.py).
        parquet = pq.ParquetFile(handle, pre_buffer=False, buffer_size=CHUNK_BYTES)
        yield from parquet.iter_batches(batch_size=BATCH_ROWS)
    elif lower.endswith(CSV_SUFFIXES):
        import pyarrow.csv as pcsv

        yield from pcsv.open_csv(handle, read_options=pcsv.ReadOptions(block_size=CHUNK_BYTES))
    elif handle.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC:
        handle.seek(0)
        reader = pa.ipc.open_file(handle)
        yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        handle.seek(0)
        yield from pa.ipc.open_stream(handle)


def _table_rows(path: str, handle: Any) -> Iterator[tuple[int, str, Any]]:
    number = 0
    for batch in _batches(path, handle):
        for row in batch.to_pylist():
            number += 1
            yield number, json.dumps(row, ensure_ascii=False, default=str), row


def _json_array_rows(handle: Any, hasher: Any, info: SourceInfo) -> Iterator[tuple[int, str, Any]]:
    """A ``.json`` file holding one array of records (read whole, as ``datasets`` reads it)."""
    data = handle.read()
    hasher.update(data)
    info.bytes = len(data)
    try:
        records = json.loads(data.decode("utf-8").removeprefix("\ufeff"))
    except (ValueError, RecursionError) as error:
        records = [Invalid("not_json", f"the file is not one JSON array: {error}")]
    for number, record in enumerate(records, 1):
        raw = (
            record.detail if isinstance(record, Invalid) else json.dumps(record, ensure_ascii=False)
        )
        yield number, raw, record


def _starts_with_array(path: str) -> bool:
    """Whether a ``.json`` file holds one JSON array (else it is read as JSON Lines)."""
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path) as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def read_source(
    path: str, forced_format: str, lines_per_bundle: int, columns: dict[str, str] | None = None
) -> Iterator[list[Item] | SourceInfo]:
    """Bundles of items of one file, then its SourceInfo as the last value; the format is
    detected from the first record with its ``columns`` renamed (old name to new)."""
    from apache_beam.io.filesystems import FileSystems

    info = SourceInfo(uri=path)
    hasher = hashlib.sha256()
    detector = _Detector(forced_format, columns or {})
    bundle: list[Item] = []
    table = path.lower().endswith(PARQUET_SUFFIXES + CSV_SUFFIXES + ARROW_SUFFIXES)
    digest = _sha256(path, info) if table else None
    array = path.lower().endswith(JSON_SUFFIXES) and _starts_with_array(path)
    with FileSystems.open(path) as handle:
        if table:
            rows = _table_rows(path, handle)
        elif array:
            rows = _json_array_rows(handle, hasher, info)
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
    info.sha256 = digest or hasher.hexdigest()
    info.format = detector.format
    yield info
