"""BigQuery tables as preference data: ``bq://PROJECT.DATASET.TABLE`` beside files.

Beam's own source reads them (``ReadFromBigQuery``, the Storage Read API: no export to Cloud
Storage, no temp_location); each row is a record as a file's line is, in bundles of
``lines_per_bundle``, validated, deduplicated and sharded by the same transforms, its bad
rows in ``rejected.jsonl`` (line 0: a table's rows have no order). The manifest lists the
table as a source with its row count; its fingerprint for the pipeline's cache and realign
plan is the table's last modification time and row count (``table_fingerprint``).
Credentials are the task's (its service account); reading needs BigQuery Read Session User
and Data Viewer on the table's project.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from components.shard.sources import InputError

SCHEME = "bq://"
# project ids: letters, digits, dashes (and a domain prefix "example.com:"); dataset and
# table names: letters, digits, underscores (tables may hold dashes and spaces too).
TABLE = re.compile(r"^(?P<project>[\w.:-]+?)\.(?P<dataset>\w+)\.(?P<table>[\w$ -]+)$")


class TableError(InputError):
    """A table URI that does not name one table."""


def is_table(uri: str) -> bool:
    """Whether ``uri`` names a BigQuery table (``bq://PROJECT.DATASET.TABLE``)."""
    return uri.startswith(SCHEME)


def table_parts(uri: str) -> tuple[str, str, str]:
    """(project, dataset, table) of a ``bq://`` URI; TableError names the expected form."""
    match = TABLE.match(uri[len(SCHEME) :])
    if match is None:
        raise TableError(
            f"{uri!r} is not a BigQuery table; name one as bq://PROJECT.DATASET.TABLE "
            "(e.g. bq://my-project.prefs.pairs_2026_12)"
        )
    return match["project"], match["dataset"], match["table"]


def table_spec(uri: str) -> str:
    """Beam's ``PROJECT:DATASET.TABLE`` form of a ``bq://`` URI."""
    project, dataset, table = table_parts(uri)
    return f"{project}:{dataset}.{table}"


def read_bigquery(uri: str) -> Any:
    """Beam's BigQuery source of one table: rows as dicts (REPEATED RECORD columns, e.g.
    conversational messages, as lists of dicts)."""
    import apache_beam as beam

    method = beam.io.ReadFromBigQuery.Method.DIRECT_READ
    return beam.io.ReadFromBigQuery(table=table_spec(uri), method=method)


def table_fingerprint(uri: str) -> str:
    """The table's last modification time and row count (BigQuery's own metadata)."""
    from google.cloud import bigquery

    project, dataset, table = table_parts(uri)
    found = bigquery.Client(project=project).get_table(f"{project}.{dataset}.{table}")
    return f"bq:{found.modified.isoformat()}@{found.num_rows}"


def to_item(
    row: Any, columns: dict[str, str] | None = None, forced: str = "auto"
) -> tuple[int, str, Any, str | None]:
    """A row as the shard stage's (line, raw, obj, format) item: the ``forced`` format, or
    the one read with its ``columns`` renamed (old name to new; the processing renames them
    again)."""
    from components.shard.formats import detect_format
    from components.shard.invalid import Invalid, renamed

    if forced != "auto":
        return 0, json.dumps(row, ensure_ascii=False, default=str), row, forced
    try:
        fmt = detect_format(renamed(row, columns or {})) if isinstance(row, dict) else None
    except Invalid:  # a column clash: the processing sends the row to rejected/
        fmt = None
    return 0, json.dumps(row, ensure_ascii=False, default=str), row, fmt


def source_stats(uri: str, records: int, formats: Iterable[str | None]) -> dict[str, Any]:
    """The manifest's entry of a table, as a file's ``SourceInfo`` (no bytes or sha256)."""
    known = sorted({f for f in formats if f})
    return {
        "kind": "source", "uri": uri, "bytes": 0, "sha256": "", "records": records,
        "blank_lines": 0, "format": known[0] if len(known) == 1 else None,
    }  # fmt: skip


def build_reads(
    pipeline: Any,
    tables: list[str],
    lines_per_bundle: int,
    read: Any,
    columns: dict | None = None,
    forced: str = "auto",
) -> tuple:
    """For each table: its rows in bundles of (uri, items), and its manifest entry; returns
    the two PCollections (bundles, stats). ``read(uri)`` is the source transform."""
    import apache_beam as beam

    bundles, stats = [], []
    for i, uri in enumerate(tables):
        items = (
            pipeline
            | f"ReadTable{i}" >> read(uri)
            | f"TableItems{i}" >> beam.Map(to_item, columns, forced)
        )  # fmt: skip
        batched = items | f"TableBundles{i}" >> beam.BatchElements(
            min_batch_size=lines_per_bundle, max_batch_size=lines_per_bundle
        )
        bundles.append(batched | f"TableBundle{i}" >> beam.Map(lambda b, u=uri: (u, list(b))))
        # Rows per detected format, then one entry: a few counts travel, not the rows.
        counted = (
            items
            | f"TableFormats{i}" >> beam.Map(lambda item: item[3])
            | f"TableFormatCounts{i}" >> beam.combiners.Count.PerElement()
            | f"TableCounts{i}" >> beam.combiners.ToList()
            | f"TableEntry{i}" >> beam.Map(
                lambda counts, u=uri: source_stats(
                    u, sum(n for _, n in counts), [f for f, _ in counts]
                )
            )
        )  # fmt: skip
        stats.append(counted)
    return bundles, stats
