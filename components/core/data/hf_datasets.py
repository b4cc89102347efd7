"""Hugging Face dataset folders as preference data: the files ``datasets`` would read.

Two layouts, as the `datasets` library writes and reads them (tests/make_dataset_fixtures.py
saves them with the library itself and records what it reads back):

- ``save_to_disk``: a ``Dataset`` folder (``state.json`` lists its Arrow stream files) or a
  ``DatasetDict`` folder (``dataset_dict.json`` lists its splits, a ``Dataset`` folder each);
- a folder ``load_dataset(folder)`` reads: data files (JSON Lines, JSON, Parquet, CSV, Arrow)
  whose paths name their split, by the library's rules in order: ``data/<split>-NNNNN-of-
  NNNNN.*`` shards, then a split keyword in a folder name, then in a file name (``train``,
  ``training``; ``validation``, ``valid``, ``dev``, ``val``; ``test``, ``testing``,
  ``eval``, ``evaluation``, set off by ``-._ `` or digits), else every file is ``train``.

The shard stage reads the ``train`` split (it makes its own eval split by prompt hash); a
folder without one is refused naming the splits it has, and the way to pick one
(``FOLDER/<split>`` for ``save_to_disk``, the files for a data folder). Hidden files and
folders (``.``, ``_`` prefixes) are skipped, as the library skips them.
"""

from __future__ import annotations

import json
import re

from components.core import fileio

# The data files read here, by suffix (the library's json, parquet, csv and arrow builders).
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".pq", ".csv", ".arrow")
TRAIN = "train"
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
_SEP = r"[-._ 0-9]"
SHARDED = re.compile(r"(?:^|/)data/(?P<split>\w+)-\d{5}-of-\d{5}[^/]*\.[^/]+$")


class DatasetFolderError(ValueError):
    """A dataset folder the shard stage cannot read as it stands; the message says the fix."""


def is_dataset_folder(path: str) -> bool:
    """Whether ``path`` is a folder (the shard stage reads it as a Hugging Face dataset)."""
    return fileio.isdir(path)


def dataset_files(folder: str) -> list[str]:
    """The data files of ``folder``'s train split, in the library's order."""
    folder = folder.rstrip("/")
    if fileio.exists(fileio.join(folder, "dataset_dict.json")):
        splits = json.loads(fileio.read_text(fileio.join(folder, "dataset_dict.json")))["splits"]
        if TRAIN not in splits:
            raise DatasetFolderError(
                f"{folder!r} is a saved DatasetDict without a train split (splits: "
                f"{', '.join(splits)}); pass one split's folder, e.g. {folder}/{splits[0]}"
            )
        return _saved_dataset(fileio.join(folder, TRAIN))
    if fileio.exists(fileio.join(folder, "state.json")):
        return _saved_dataset(folder)
    return _data_folder(folder)


def _saved_dataset(folder: str) -> list[str]:
    """A ``Dataset.save_to_disk`` folder's Arrow files, as its ``state.json`` lists them."""
    state = json.loads(fileio.read_text(fileio.join(folder, "state.json")))
    return [fileio.join(folder, entry["filename"]) for entry in state["_data_files"]]


def _data_folder(folder: str) -> list[str]:
    """The train split's data files of a folder ``load_dataset(folder)`` reads."""
    relative = {
        path[len(folder) + 1 :]: path
        for path in fileio.walk_files(folder)
        if path.lower().endswith(DATA_SUFFIXES)
    }
    relative = {r: p for r, p in relative.items() if not _hidden(r)}
    if not relative:
        raise DatasetFolderError(
            f"{folder!r} holds no data file ({', '.join(DATA_SUFFIXES)}) and is no saved "
            "dataset (no state.json or dataset_dict.json); pass the files, or the folder "
            "save_to_disk wrote"
        )
    splits = _splits(sorted(relative))
    if TRAIN not in splits:
        raise DatasetFolderError(
            f"{folder!r} has no train split by Hugging Face's file-name rules (splits: "
            f"{', '.join(sorted(splits))}); pass the files to read, e.g. "
            f"'{next(iter(splits.values()))[0]}'"
        )
    return [relative[r] for r in splits[TRAIN]]


def _hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in relative.split("/"))


def _splits(paths: list[str]) -> dict[str, list[str]]:
    """Files by split, by the library's rules in its order (module docstring)."""
    sharded: dict[str, list[str]] = {}
    for path in paths:
        if match := SHARDED.search(path):
            sharded.setdefault(match["split"], []).append(path)
    if sharded:
        return sharded
    for in_name in (_in_folder_name, _in_file_name):
        found: dict[str, list[str]] = {}
        for split, keywords in SPLIT_KEYWORDS.items():
            files = [p for p in paths if any(in_name(p, k) for k in keywords)]
            if files:
                found[split] = files
        if found:
            return found
    return {TRAIN: paths}


def _in_folder_name(path: str, keyword: str) -> bool:
    """``keyword`` as a folder name, or set off in one (``train/``, ``my-train-2/``)."""
    pattern = re.compile(rf"(?:^|.*{_SEP}){keyword}(?:{_SEP}.*)?$")
    return any(pattern.match(part) for part in path.split("/")[:-1])


def _in_file_name(path: str, keyword: str) -> bool:
    """``keyword`` set off in the file name (``train.csv``, ``my_train-0.jsonl``)."""
    name = path.rsplit("/", 1)[-1]
    return re.match(rf"(?:^|.*{_SEP}){keyword}{_SEP}.*$", name) is not None
