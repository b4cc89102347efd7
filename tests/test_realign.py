"""Periodic realignment's decisions: new data or not, the anchor, past drift (no kfp.local)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelines import stage_io
from pipelines.releases import promotion, realign


def _policy(folder: Path, weights: str) -> str:
    (folder / "params").mkdir(parents=True)
    (folder / "params" / "weights").write_text(weights)
    (folder / "config.json").write_text(json.dumps({"weights": weights}))
    return str(folder)


def _data(folder: Path, *names: str) -> str:
    """find-data's sources for files ``names`` (created when missing) under ``folder``."""
    folder.mkdir(exist_ok=True)
    for name in names:
        if not (folder / name).exists():
            (folder / name).write_text(f"{name}\n")
    return json.dumps(stage_io.find_sources(f"{folder}/*.jsonl"))


def _promote(tmp_path: Path, root: Path, number: int, sources: str, anchor_kl: float) -> None:
    summary = {"kl": {"per_token": 0.01 * number}, "anchor": {"kl": {"per_token": anchor_kl}}}
    record = {"run_id": f"run-{number}", "data": json.loads(sources), "summary": summary,
              "data_fingerprint": stage_io.data_fingerprint(sources)}  # fmt: skip
    promotion.promote(str(root), _policy(tmp_path / f"p{number}", f"v{number}"), record)


def test_the_same_files_as_the_last_promotion_are_no_new_data(tmp_path):
    root, data = tmp_path / "promoted", tmp_path / "data"
    first = _data(data, "a.jsonl")
    glob = f"{data}/*.jsonl"
    assert realign.has_new_data(glob, first, str(root))  # nothing promoted yet
    _promote(tmp_path, root, 1, first, 0.0)
    assert not realign.has_new_data(glob, first, str(root))
    assert realign.has_new_data("", first, str(root))  # the built-in task: always new
    grown = _data(data, "a.jsonl", "b.jsonl")
    assert realign.has_new_data(glob, grown, str(root))
    _promote(tmp_path, root, 2, grown, 0.1)
    promotion.rollback(str(root), 1)  # the last promoted run's data was trained on all the same
    assert not realign.has_new_data(glob, grown, str(root))
    train, _ = realign.plan(glob, grown, True, "", str(root))
    assert train  # force_run
    result = json.loads(realign.no_new_data_result(grown, str(root)))
    assert result["status"] == realign.NO_NEW_DATA == "no new data"
    assert (result["matches_version"], result["matches_run"], result["files"]) == (2, "run-2", 2)
    assert result["current_version"] == 1


def test_a_changed_file_is_new_data(tmp_path):
    root, data = tmp_path / "promoted", tmp_path / "data"
    sources = _data(data, "a.jsonl")
    _promote(tmp_path, root, 1, sources, 0.0)
    (data / "a.jsonl").write_text("rewritten, longer than before\n")
    assert realign.has_new_data(f"{data}/*.jsonl", _data(data), str(root))


def test_the_anchor_is_the_first_promoted_version_unless_given(tmp_path):
    root = tmp_path / "promoted"
    assert realign.anchor_folder("", str(root)) == ""  # nothing promoted: the reference
    assert realign.anchor_folder("", "") == ""
    sources = _data(tmp_path / "data", "a.jsonl")
    for number in (1, 2, 3):
        _promote(tmp_path, root, number, sources, 0.05 * number)
    first = promotion.version_folder(str(root), 1)
    assert realign.anchor_folder("", str(root)) == first
    promotion.rollback(str(root), 2)
    assert realign.anchor_folder("", str(root)) == first
    given = _policy(tmp_path / "base", "base")
    assert realign.anchor_folder(given, str(root)) == given
    assert realign.anchor_folder(str(root), "") == first  # a root stands for its first version
    with pytest.raises(FileNotFoundError, match="anchor_policy .* has no config.json"):
        realign.anchor_folder(str(tmp_path / "missing"), str(root))

    _, anchor = realign.plan("", "[]", False, "", str(root))
    details = stage_io.reference_details(anchor)
    assert details["uri"] == first and details["fingerprint"]
    assert [row["label"] for row in details["past"]] == ["version 1", "version 2", "version 3"]
    assert [row["anchor_kl"] for row in details["past"]] == pytest.approx([0.05, 0.1, 0.15])
    assert details["past"][0]["anchor_win_rate"] is None  # not measured: None, not an error
