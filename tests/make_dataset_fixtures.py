"""Write tests/fixtures/hf_datasets (run by hand; needs the `datasets` library, which alignpipe
itself does not need)::

    pip install --target /tmp/ds datasets && PYTHONPATH=/tmp/ds .venv/bin/python \
        tests/make_dataset_fixtures.py

Preference data as Hugging Face `datasets` writes and reads it, saved by the library itself:

- ``saved/``: ``Dataset.save_to_disk`` (Arrow stream files, ``state.json``);
- ``saved_dict/``: ``DatasetDict.save_to_disk`` (``dataset_dict.json``, a folder per split);
- ``repo/``: a dataset folder as ``load_dataset(folder)`` reads it (data files whose names
  give their split: ``train-*.parquet``, ``test.csv``), in Parquet, CSV and JSON Lines.

``expected.json`` holds what the library itself reads back from each (the train split's
rows, in order): tests/test_shard_datasets.py checks the shard stage reads the same records.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import datasets

OUT = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf_datasets"


def _rows(split: str, count: int) -> list[dict]:
    """Standard preference rows (TRL's explicit format) with an extra column."""
    return [
        {
            "prompt": f"{split} question {i}: name a colour.",
            "chosen": f"Blue, like the sky ({i}).",
            "rejected": f"I do not know {i}.",
            "source": f"{split}-{i % 3}",
        }
        for i in range(count)
    ]


def _conversational(count: int) -> list[dict]:
    """TRL's conversational format: lists of messages (only Arrow and Parquet keep them)."""
    return [
        {
            "prompt": [{"role": "user", "content": f"Say hi {i}."}],
            "chosen": [{"role": "assistant", "content": f"Hi {i}!"}],
            "rejected": [{"role": "assistant", "content": "No."}],
        }
        for i in range(count)
    ]


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    expected = {}

    saved = datasets.Dataset.from_list(_rows("train", 12))
    saved.save_to_disk(str(OUT / "saved"), max_shard_size="1KB")  # several Arrow files
    expected["saved"] = datasets.load_from_disk(str(OUT / "saved")).to_list()

    both = datasets.DatasetDict(
        train=datasets.Dataset.from_list(_conversational(6)),
        test=datasets.Dataset.from_list(_conversational(3)),
    )
    both.save_to_disk(str(OUT / "saved_dict"))
    expected["saved_dict"] = datasets.load_from_disk(str(OUT / "saved_dict"))["train"].to_list()

    repo = OUT / "repo"
    (repo / "data").mkdir(parents=True)
    train = _rows("train", 10)
    for name, rows in (
        ("train-00000-of-00002", train[:6]),
        ("train-00001-of-00002", train[6:]),
        ("test-00000-of-00001", _rows("test", 4)),
    ):
        datasets.Dataset.from_list(rows).to_parquet(str(repo / "data" / f"{name}.parquet"))
    expected["repo"] = datasets.load_dataset(str(repo), split="train").to_list()

    csv = OUT / "csv_repo"
    csv.mkdir()
    datasets.Dataset.from_list(_rows("train", 5)).to_csv(str(csv / "train.csv"), index=False)
    datasets.Dataset.from_list(_rows("test", 2)).to_csv(str(csv / "test.csv"), index=False)
    expected["csv_repo"] = datasets.load_dataset(str(csv), split="train").to_list()

    jsonl = OUT / "json_repo"
    jsonl.mkdir()
    datasets.Dataset.from_list(_rows("train", 4)).to_json(str(jsonl / "train.jsonl"))
    # A JSON array (lines=False), which the library's json builder reads too.
    datasets.Dataset.from_list(_rows("validation", 2)).to_json(
        str(jsonl / "validation.json"), lines=False
    )
    expected["json_repo"] = datasets.load_dataset(str(jsonl), split="train").to_list()
    expected["json_array"] = datasets.load_dataset(
        "json", data_files=str(jsonl / "validation.json"), split="train"
    ).to_list()

    expected["datasets_version"] = datasets.__version__
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    for name in sorted(expected):
        print(name, expected[name] if isinstance(expected[name], str) else len(expected[name]))


if __name__ == "__main__":
    main()
