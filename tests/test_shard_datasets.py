"""Preference data as Hugging Face datasets hold it: save_to_disk folders (Dataset and
DatasetDict) and data folders load_dataset reads (Parquet, CSV, JSON Lines, a JSON array),
read as the library itself reads them (tests/fixtures/hf_datasets/expected.json, written by
`datasets` 5.2: tests/make_dataset_fixtures.py); table files a record batch at a time."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from components.core.data import hf_datasets
from components.shard import ShardConfig, run
from components.shard import sources as sources_module
from components.shard.sources import InputError, expand_patterns, read_source
from pipelines import stage_io

FIXTURES = Path(__file__).parent / "fixtures" / "hf_datasets"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


def _records(path: str) -> tuple[list, sources_module.SourceInfo]:
    """The records read_source yields for one file (parsed as the shard stage parses them)."""
    rows, info = [], None
    for value in read_source(path, "auto", 100):
        if isinstance(value, list):
            rows += [json.loads(raw) if obj is None else obj for _, raw, obj, _ in value]
        else:
            info = value
    return rows, info


@pytest.mark.parametrize("name", ["saved", "saved_dict", "repo", "csv_repo", "json_repo"])
def test_a_dataset_folder_reads_as_the_library_reads_its_train_split(name):
    files = expand_patterns([str(FIXTURES / name)])
    rows = [row for path in files for row in _records(path)[0]]
    assert rows == EXPECTED[name]
    # The pipeline's find-data lists the same files, each with its fingerprint.
    found = stage_io.find_sources(str(FIXTURES / name))
    assert [s["uri"] for s in found] == files and all(s["fingerprint"] for s in found)


def test_which_files_make_the_train_split():
    rel = (
        lambda name: [  # noqa: E731
            p[len(str(FIXTURES / name)) + 1 :]
            for p in hf_datasets.dataset_files(str(FIXTURES / name))
        ]
    )
    assert rel("saved") == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert rel("saved_dict") == ["train/data-00000-of-00001.arrow"]
    assert rel("repo") == ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]
    assert rel("csv_repo") == ["train.csv"] and rel("json_repo") == ["train.jsonl"]
    # The library's rules on names it has to tell apart: a keyword set off, in a folder or a
    # file name; "trainer" or "pretraining" name no split.
    splits = hf_datasets._splits(["a/train/x.csv", "a/valid-2/y.csv", "a/my_test/z.csv"])
    assert splits == {"train": ["a/train/x.csv"], "validation": ["a/valid-2/y.csv"],
                      "test": ["a/my_test/z.csv"]}  # fmt: skip
    assert hf_datasets._splits(["trainer.jsonl", "pretraining.jsonl"]) == {
        "train": ["trainer.jsonl", "pretraining.jsonl"]  # no split named: all are train
    }
    assert hf_datasets._splits(["my-train-1.jsonl", "dev.jsonl"]) == {
        "train": ["my-train-1.jsonl"], "validation": ["dev.jsonl"],
    }  # fmt: skip


def test_a_folder_without_a_train_split_is_refused_naming_its_splits(tmp_path):
    with pytest.raises(InputError, match=r"without a train split \(splits: test\); pass one"):
        saved = tmp_path / "dict"
        saved.mkdir()
        (saved / "dataset_dict.json").write_text('{"splits": ["test"]}')
        expand_patterns([str(saved)])
    only_test = tmp_path / "only_test"
    only_test.mkdir()
    (only_test / "test.jsonl").write_text("{}\n")
    (only_test / ".hidden.jsonl").write_text("{}\n")
    with pytest.raises(InputError, match=r"has no train split .*\(splits: test\)"):
        expand_patterns([str(only_test)])


def test_the_shard_stage_takes_a_saved_dataset_with_rejected_records(tmp_path, capsys):
    """save_to_disk's folder through the whole Beam job, beside a Parquet file with a bad
    record: counts conserved, the bad record in rejected.jsonl with its reason."""
    bad = pa.table({"prompt": ["p1", "p2"], "chosen": ["c1", "c2"], "rejected": ["r1", None]})
    pq.write_table(bad, tmp_path / "extra.parquet")
    out = tmp_path / "out"
    config = ShardConfig(num_shards=2, min_eval_pairs=0, max_invalid_fraction=0.2)
    manifest = run(config, [str(FIXTURES / "saved"), str(tmp_path / "extra.parquet")], str(out))
    counts = manifest["counts"]
    assert counts["input_records"] == 12 + 2
    assert counts["rejected"] == 1 and counts["train"] + counts["eval"] == 13
    by_uri = {os.path.basename(s["uri"]): s for s in manifest["sources"]}
    assert set(by_uri) == {
        "data-00000-of-00002.arrow",
        "data-00001-of-00002.arrow",
        "extra.parquet",
    }
    assert {s["format"] for s in by_uri.values()} == {"explicit"}
    (rejected,) = [json.loads(line) for line in open(out / "rejected" / "rejected.jsonl")]
    assert rejected["reason"] == "wrong_type" and '"rejected": null' in rejected["raw"]
    # Its progress: each file read, then the job's records per second.
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[shard]")]
    assert re.fullmatch(r"\[shard\] step 3/3 14 records, \d+ records/s", lines[-1]), lines
    assert any(re.match(r"\[shard\] step 1/3 \d+ records", line) for line in lines), lines


def _spy_reads(monkeypatch) -> list[int]:
    """The sizes of every read the shard stage's readers make of an opened file."""
    from apache_beam.io.filesystems import FileSystems

    sizes: list[int] = []
    opened = FileSystems.open

    class Spy:
        def __init__(self, handle):
            self._handle = handle

        def read(self, size=-1):
            data = self._handle.read(size)
            sizes.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self._handle, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._handle.close()

    monkeypatch.setattr(FileSystems, "open", staticmethod(lambda path, *a, **k: Spy(opened(path))))
    return sizes


@pytest.mark.parametrize("kind", ["parquet", "arrow_file", "arrow_stream", "csv"])
def test_table_files_are_read_a_record_batch_at_a_time(tmp_path, monkeypatch, kind):
    """No read of the whole file: Parquet row groups, Arrow record batches, CSV blocks."""
    count = 6000
    table = pa.table({
        # hex digests: text that compresses little, so each row group is a fraction of the file
        "prompt": [f"question {i} " + hashlib.sha256(str(i).encode()).hexdigest() * 3
                   for i in range(count)],
        "chosen": [f"good {i}" for i in range(count)], "rejected": ["bad"] * count,
    })  # fmt: skip
    path = tmp_path / f"pairs.{kind.split('_')[0]}"
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=1000)
    elif kind == "arrow_file":
        feather.write_feather(table, path, chunksize=1000)  # the IPC file format (ARROW1)
    elif kind == "arrow_stream":  # what datasets.save_to_disk writes
        with pa.ipc.new_stream(path, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=1000):
                writer.write_batch(batch)
    else:
        pcsv.write_csv(table, path)
    size = path.stat().st_size
    monkeypatch.setattr(sources_module, "CHUNK_BYTES", 1 << 16)
    sizes = _spy_reads(monkeypatch)
    rows, info = _records(str(path))
    assert len(rows) == count and rows[-1]["chosen"] == f"good {count - 1}"
    assert info.bytes == size and info.records == count
    assert sizes and max(sizes) < size / 3, (max(sizes), size)  # never the whole file at once


def test_a_json_array_file_and_a_broken_one(tmp_path):
    rows, info = _records(str(FIXTURES / "json_repo" / "validation.json"))
    assert rows == EXPECTED["json_array"] and info.format == "explicit"
    (tmp_path / "broken.json").write_text('[{"prompt": "p", ')
    (broken,), _ = _records(str(tmp_path / "broken.json"))
    assert broken.reason == "not_json" and "not one JSON array" in broken.detail


def test_bigquery_table_uris():
    from components.shard import bigquery

    assert bigquery.table_spec("bq://my-proj.prefs.pairs_2026") == "my-proj:prefs.pairs_2026"
    assert bigquery.table_spec("bq://example.com:proj.d.t") == "example.com:proj:d.t"
    for bad in ("bq://prefs.pairs", "bq://p.d.t/x", "bq://"):
        with pytest.raises(InputError, match=r"name one as bq://PROJECT\.DATASET\.TABLE"):
            bigquery.table_parts(bad)
    source = bigquery.read_bigquery("bq://my-proj.prefs.pairs_2026")
    # Beam's own source, the Storage Read API (no export to Cloud Storage).
    import apache_beam as beam

    assert isinstance(source, beam.io.ReadFromBigQuery)
    assert source.method == beam.io.ReadFromBigQuery.Method.DIRECT_READ
    assert source._kwargs == {"table": "my-proj:prefs.pairs_2026"}


def test_bigquery_rows_go_through_the_same_shard_job(tmp_path):
    """A table's rows (as Beam's BigQuery source yields them: dicts, REPEATED RECORD columns
    as lists of dicts, NULL as None, TIMESTAMP as datetime) beside a file; BigQuery cannot
    run here, so the rows come from beam.Create in its place."""
    import datetime

    import apache_beam as beam

    when = datetime.datetime(2026, 12, 5, tzinfo=datetime.UTC)
    rows = [
        {"prompt": f"question {i}", "chosen": f"good {i}", "rejected": "bad", "at": when}
        for i in range(20)
    ] + [{"prompt": "q", "chosen": "c", "rejected": None, "at": when}]
    conversational = [
        {"prompt": [{"role": "user", "content": f"hi {i}"}],
         "chosen": [{"role": "assistant", "content": "hello"}],
         "rejected": [{"role": "assistant", "content": "go away"}]}
        for i in range(5)
    ]  # fmt: skip
    tables = {"bq://p.prefs.explicit": rows, "bq://p.prefs.chat": conversational}
    (tmp_path / "more.jsonl").write_text(
        json.dumps(rows[0] | {"prompt": "from a file"}, default=str)
    )
    config = ShardConfig(num_shards=2, min_eval_pairs=0, max_invalid_fraction=0.1)
    out = tmp_path / "out"
    manifest = run(
        config, [*tables, str(tmp_path / "more.jsonl")], str(out),
        read_table=lambda uri: beam.Create(tables[uri]),
    )  # fmt: skip
    counts = manifest["counts"]
    assert counts["input_records"] == 21 + 5 + 1
    assert counts["rejected"] == 1 and counts["train"] + counts["eval"] == 26
    by_uri = {s["uri"]: s for s in manifest["sources"]}
    assert by_uri["bq://p.prefs.explicit"]["records"] == 21
    assert by_uri["bq://p.prefs.explicit"]["format"] == "explicit"
    assert by_uri["bq://p.prefs.chat"]["format"] == "conversational"
    (rejected,) = [json.loads(line) for line in open(out / "rejected" / "rejected.jsonl")]
    assert rejected["source"] == "bq://p.prefs.explicit" and rejected["reason"] == "wrong_type"
    assert '"at": "2026-12-05 00:00:00+00:00"' in rejected["raw"]


def test_a_bigquery_tables_columns_are_renamed_as_a_files(tmp_path):
    """A table whose columns are named its own way ({"instruction", "good", "bad"}) is read
    with the columns option, as files are: the format detected on the renamed rows."""
    import apache_beam as beam

    rows = [{"instruction": f"q {i}", "good": f"yes {i}", "bad": "no"} for i in range(12)]
    mapping = '{"instruction": "prompt", "good": "chosen", "bad": "rejected"}'
    config = ShardConfig(num_shards=1, min_eval_pairs=0, columns=mapping)
    manifest = run(
        config, ["bq://p.prefs.own"], str(tmp_path / "out"),
        read_table=lambda uri: beam.Create(rows),
    )  # fmt: skip
    assert manifest["sources"][0]["format"] == "explicit"
    assert manifest["counts"]["train"] + manifest["counts"]["eval"] == 12
    # A forced format is every row's, as a file's (auto would read these as Anthropic HH).
    hh = [{"chosen": f"Human: q {i} Assistant: yes", "rejected": "no"} for i in range(4)]
    hh.append({"prompt": "p", "chosen": "yes", "rejected": "no"})  # one the job can keep
    forced = ShardConfig(num_shards=1, min_eval_pairs=0, format="explicit",
                         max_invalid_fraction=1.0)  # fmt: skip
    manifest = run(
        forced, ["bq://p.prefs.hh"], str(tmp_path / "forced"),
        read_table=lambda uri: beam.Create(hh),
    )  # fmt: skip
    assert manifest["rejected_by_reason"] == {"missing_field": 4}


def test_a_bigquery_tables_fingerprint_is_its_modification_and_rows(monkeypatch):
    import datetime
    from unittest import mock

    from google.cloud import bigquery as bq

    client = mock.create_autospec(bq.Client, instance=True)
    client.get_table.return_value = mock.Mock(
        modified=datetime.datetime(2026, 12, 5, 8, tzinfo=datetime.UTC), num_rows=1200
    )
    monkeypatch.setattr(bq, "Client", mock.Mock(return_value=client))
    found = stage_io.find_sources(f"bq://my-proj.prefs.pairs, {FIXTURES / 'csv_repo'}")
    assert found[0] == {
        "uri": "bq://my-proj.prefs.pairs", "fingerprint": "bq:2026-12-05T08:00:00+00:00@1200",
    }  # fmt: skip
    client.get_table.assert_called_once_with("my-proj.prefs.pairs")
    assert [os.path.basename(s["uri"]) for s in found[1:]] == ["train.csv"]
