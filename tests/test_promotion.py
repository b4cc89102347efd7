"""Promotion history: numbered versions, an atomic CURRENT, rollback, races and crashes."""

from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path

import pytest

from components.core import fileio
from pipelines import stage_io
from pipelines.cli.main import main
from pipelines.releases import atomic, policies, promotion


def _policy(folder: Path, weights: str) -> str:
    """A fake policy folder: what check_policy and promote look at (config.json + params/)."""
    (folder / "params").mkdir(parents=True)
    (folder / "params" / "weights").write_text(weights)
    (folder / "config.json").write_text(json.dumps({"weights": weights}))
    return str(folder)


def _record(run: str, win_rate: float, kl: float, gold: float) -> dict:
    """What the promote component passes: run id, data fingerprint and eval.json."""
    summary = {
        "win_rate": {"value": win_rate, "low": win_rate - 0.05, "high": win_rate + 0.05},
        "kl": {"per_token": kl},
        "gold": {"difference": {"value": gold}},
        "anchor": {"kl": {"per_token": 2 * kl}, "win_rate": {"value": win_rate + 0.1}},
    }
    reasons = [f"win rate lower bound {win_rate - 0.05:.2f} >= 0.5: pass"]
    return {"run_id": run, "data_fingerprint": f"sha-{run}", "blessed": True, "summary": summary,
            "reasons": reasons}  # fmt: skip


def _weights(reference: str) -> str:
    """The fake weights of the policy a check_policy reference points to."""
    return json.loads(Path(stage_io.reference_uri(reference), "config.json").read_text())["weights"]


def _history_lines(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / promotion.HISTORY).read_text().splitlines()]


def _promote_three(tmp_path: Path) -> Path:
    root = tmp_path / "promoted"
    figures = [(0.64, 0.012, 0.21), (0.61, 0.025, 0.15), (0.58, 0.041, -0.02)]
    for number, (win, kl, gold) in enumerate(figures, start=1):
        policy = _policy(tmp_path / f"ppo-{number}", f"v{number}")
        record = _record(f"run-{number}", win, kl, gold)
        version = policies.promote(policy, str(tmp_path / f"artifact-{number}"), str(root),
                                   record=record)  # fmt: skip
        assert version == number
    return root


def test_three_promotions_make_versions_and_history_rows(tmp_path):
    root = _promote_three(tmp_path)
    assert promotion.complete_versions(str(root)) == [1, 2, 3]
    assert promotion.current_version(str(root)) == 3
    reference = policies.check_policy(str(root))
    assert stage_io.reference_uri(reference) == str(root / "versions" / "000003")
    assert _weights(reference) == "v3"
    assert (tmp_path / "artifact-2" / "params" / "weights").read_text() == "v2"

    lines = _history_lines(root)
    assert [line["version"] for line in lines] == [1, 2, 3]
    assert [line["run_id"] for line in lines] == ["run-1", "run-2", "run-3"]
    assert lines[0]["event"] == "promotion" and lines[0]["data_fingerprint"] == "sha-run-1"
    assert lines[0]["figures"]["win_rate/value"] == 0.64
    assert lines[0]["reasons"] and lines[0]["source"] == str(tmp_path / "ppo-1")
    assert promotion.read_history(str(root)) == lines


def test_rollback_makes_an_earlier_version_current_and_is_recorded(tmp_path, capsys):
    root = _promote_three(tmp_path)
    assert main(["rollback", str(root), "--to", "2", "--reason", "gold fell"]) == 0
    assert "version 2 is current" in capsys.readouterr().out
    assert promotion.current_version(str(root)) == 2
    assert _weights(policies.check_policy(str(root))) == "v2"
    last = _history_lines(root)[-1]
    assert (last["event"], last["from"], last["to"], last["reason"]) == (
        "rollback",
        3,
        2,
        "gold fell",
    )

    assert main(["rollback", str(root), "--to", "000002"]) == 0
    assert "already current" in capsys.readouterr().out
    assert len(_history_lines(root)) == 4

    # A promotion after a rollback takes the next number and becomes current.
    policy = _policy(tmp_path / "ppo-4", "v4")
    assert policies.promote(policy, str(tmp_path / "artifact-4"), str(root)) == 4
    assert _weights(policies.check_policy(str(root))) == "v4"


def test_history_prints_a_table_with_the_current_version_and_rollbacks(tmp_path, capsys):
    root = _promote_three(tmp_path)
    promotion.rollback(str(root), 2, "gold fell")
    capsys.readouterr()
    assert main(["history", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["version", "event", "time", "(UTC)", "run", "win", "rate",
                              "KL/token", "anchor", "KL", "gold", "gain", "note"]  # fmt: skip
    first, second, third, moved = out[1:5]
    assert first.split()[-4:] == ["0.640", "0.0120", "0.0240", "+0.210"]
    assert first.split()[:2] == ["1", "promotion"] and "run-1" in first
    assert second.startswith("*") and second.split()[1] == "2" and "run-2" in second
    assert third.split()[-1] == "-0.020"
    assert moved.split()[:3] == ["3", "->", "2"]
    assert out[4].split()[3] == "rollback" and out[4].endswith("gold fell")
    assert out[5] == f"* current: version 2 ({root / 'versions' / '000002'})"

    assert main(["history", str(root), "--json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [e["event"] for e in events] == ["promotion"] * 3 + ["rollback"]


def test_history_and_rollback_refuse_what_they_cannot_use(tmp_path, capsys):
    root = _promote_three(tmp_path)
    assert main(["rollback", str(root), "--to", "7"]) == 1
    err = capsys.readouterr().err
    assert "version 7" in err and "does not exist; complete versions: 1, 2, 3" in err
    assert main(["history", ""]) == 1
    assert "URI is empty" in capsys.readouterr().err
    assert main(["history", str(tmp_path / "nowhere")]) == 1
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["history", str(tmp_path / "empty")]) == 1
    assert "holds no promoted versions" in capsys.readouterr().err
    assert main(["rollback", str(tmp_path / "empty"), "--to", "1"]) == 1
    assert "no promoted versions to roll back to" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --to is required
        main(["rollback", str(root)])


def test_promote_refuses_a_reward_model_a_plain_model_a_file_and_its_own_folder(tmp_path, capsys):
    policy = _policy(tmp_path / "policy", "p")
    reward = _policy(tmp_path / "reward", "r")
    (tmp_path / "reward" / "config.json").write_text(json.dumps({"scalar_head": True}))
    (tmp_path / "file").write_text("x")
    refusals = {
        (reward, tmp_path / "root"): "is a reward model",
        (policy, tmp_path / "reward"): "holds a model that was never promoted",  # swapped
        (policy, tmp_path / "file"): "is a file; pass a folder",
        (policy, tmp_path / "policy" / "promoted"): "or inside it; pass a root outside",
    }
    for (source, root), message in refusals.items():
        assert main(["promote", str(source), "--to", str(root)]) == 1
        assert message in capsys.readouterr().err, message
    # Nothing was written: no root, the swapped policy and the source as they were.
    assert not (tmp_path / "root").exists() and not (tmp_path / "policy" / "promoted").exists()
    assert sorted(p.name for p in (tmp_path / "reward").iterdir()) == ["config.json", "params"]
    # A plain policy is no promotion root: history says so, not "promoted before versions".
    assert main(["history", policy]) == 1


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_a_damaged_record_is_named_and_nothing_changes_until_it_is_mended(tmp_path, capsys):
    root = _promote_three(tmp_path)
    policy = _policy(tmp_path / "ppo-4", "v4")
    marker = root / "versions" / "000001" / promotion.COMPLETE
    good = marker.read_text()
    damages = {
        "": "is not valid JSON",
        '{"event": "promotion", "version": 1}': "its time is None, not an ISO time",
        '{"event": "promotion", "version": "1", "time": "2026-12-01T00:00:00+00:00"}':
            "its 'version' is '1', not a version number",
        "[]": "it holds [], not an object",
    }  # fmt: skip
    for text, problem in damages.items():
        marker.write_text(text)
        before = _snapshot(root)
        for command in (["rollback", str(root), "--to", "1"], ["history", str(root)],
                        ["promote", policy, "--to", str(root)]):  # fmt: skip
            assert main(command) == 1, (text, command)
            err = capsys.readouterr().err
            assert f"{marker} is not" in err and problem in err and "fix it or remove it" in err
        assert _snapshot(root) == before, text  # CURRENT, the records, no new version
    marker.write_text(good)

    # A damaged CURRENT: history and a run's policy name it; a rollback mends it.
    current = root / promotion.CURRENT
    for text in ("{bad", "[]", '{"version": 0}'):
        current.write_text(text)
        assert main(["history", str(root)]) == 1
        assert f"{current}" in capsys.readouterr().err
        with pytest.raises(promotion.PromotionRecordError, match="alignpipe rollback"):
            policies.check_policy(str(root))
    assert main(["rollback", str(root), "--to", "2"]) == 0
    assert "(was none: CURRENT was unreadable or missing)" in capsys.readouterr().out
    assert _weights(policies.check_policy(str(root))) == "v2"
    assert _history_lines(root)[-1]["from"] is None

    # CURRENT naming a version that is not complete, or none: history says runs will fail.
    current.write_text(json.dumps({"version": 9}))
    assert main(["history", str(root)]) == 1
    assert "names version 9, which is not a complete version" in capsys.readouterr().err
    current.unlink()
    assert main(["history", str(root)]) == 1
    assert "has no CURRENT; runs that read it fail until" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match=r"complete versions \(1, 2, 3\) but no CURRENT"):
        promotion.resolve_policy(str(root))


def test_odd_files_under_a_root_are_named_and_a_failed_rollback_changes_nothing(tmp_path, capsys):
    root = _promote_three(tmp_path)
    (root / "versions" / "\u00b2").mkdir()  # not a version number: ignored
    marker = root / "versions" / "000002" / promotion.COMPLETE
    good = marker.read_text()
    marker.write_text(json.dumps({**json.loads(good), "version": 7}))
    assert main(["history", str(root)]) == 1
    assert "its version 7 is not its folder's" in capsys.readouterr().err
    marker.unlink()
    marker.mkdir()  # a folder where the record should be
    assert main(["history", str(root)]) == 1
    assert f"{marker} cannot be read" in capsys.readouterr().err
    marker.rmdir()
    marker.write_text(good)

    # A rollback that cannot write its record does not switch CURRENT.
    (root / "rollbacks").mkdir(exist_ok=True)
    (root / "rollbacks").rmdir()
    (root / "rollbacks").write_text("a file")
    assert main(["rollback", str(root), "--to", "1"]) == 1
    assert "error:" in capsys.readouterr().err
    assert promotion.current_version(str(root)) == 3
    (root / "rollbacks").unlink()

    # history.jsonl is derived: when it cannot be rewritten the event stands, with a warning.
    (root / promotion.HISTORY).unlink()
    (root / promotion.HISTORY).mkdir()
    assert main(["rollback", str(root), "--to", "1"]) == 0
    assert promotion.current_version(str(root)) == 1
    assert [e["event"] for e in promotion.read_history(str(root))][-1] == "rollback"

    # Optional fields of any type show in the table instead of failing it.
    record = json.loads(good)
    record.update(note=5, run_id=None, registry="x", figures={"win_rate/value": "high"})
    marker.write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["history", str(root)]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.split()[:2] == ["2", "promotion"] and "high" in row and row.endswith("5")


def test_a_crash_mid_copy_is_never_current_and_the_next_promotion_moves_on(tmp_path, monkeypatch):
    root = _promote_three(tmp_path)
    copy_tree = fileio.copy_tree

    def copy_then_crash(source: str, destination: str) -> int:
        copy_tree(source, destination)
        raise OSError("the task was preempted")

    monkeypatch.setattr(fileio, "copy_tree", copy_then_crash)
    with pytest.raises(OSError, match="preempted"):
        promotion.promote(str(root), _policy(tmp_path / "ppo-4", "v4"))
    monkeypatch.undo()

    assert (root / "versions" / "000004" / "params" / "weights").exists()  # half written
    assert promotion.complete_versions(str(root)) == [1, 2, 3]
    assert promotion.current_version(str(root)) == 3
    assert _weights(policies.check_policy(str(root))) == "v3"
    assert [e["version"] for e in promotion.read_history(str(root))] == [1, 2, 3]
    with pytest.raises(ValueError, match="version 4 .* never finished copying"):
        promotion.rollback(str(root), 4)

    assert promotion.promote(str(root), _policy(tmp_path / "ppo-5", "v5")) == 5
    assert promotion.complete_versions(str(root)) == [1, 2, 3, 5]
    assert _weights(policies.check_policy(str(root))) == "v5"


def test_racing_promotions_get_their_own_versions_and_a_complete_current(tmp_path):
    root = str(tmp_path / "promoted")
    policies = [_policy(tmp_path / f"ppo-{i}", f"v{i}") for i in range(4)]
    start = threading.Barrier(len(policies))
    versions: list[int] = []

    def promote(policy: str) -> None:
        start.wait()
        versions.append(promotion.promote(root, policy, {"run_id": Path(policy).name}))

    threads = [threading.Thread(target=promote, args=(p,)) for p in policies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(versions) == [1, 2, 3, 4]
    assert promotion.complete_versions(root) == [1, 2, 3, 4]
    assert promotion.current_version(root) in versions
    copies = {Path(promotion.version_folder(root, v), "params", "weights").read_text()
              for v in versions}  # fmt: skip
    assert copies == {"v0", "v1", "v2", "v3"}  # each version holds one whole policy
    assert sorted(line["version"] for line in _history_lines(Path(root))) == [1, 2, 3, 4]


def test_a_claim_by_listing_has_one_owner(tmp_path):
    # The gs:// claim (write an own object, then list), run on a local folder.
    folder = str(tmp_path / "versions" / "000001")
    assert atomic.claim_by_listing(folder)
    assert not atomic.claim_by_listing(folder)

    racing = str(tmp_path / "versions" / "000002")
    start = threading.Barrier(6)
    won: list[bool] = []

    def claim() -> None:
        start.wait()
        won.append(atomic.claim_by_listing(racing))

    threads = [threading.Thread(target=claim) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(won) == 6 and sum(won) <= 1


def test_a_gcs_claim_is_a_create_if_absent_precondition(monkeypatch):
    """gs://: one claim object created with if_generation_match=0 (Cloud Storage's atomic
    create-if-absent); the storage client is the SDK's, autospecced (no bucket here)."""
    from unittest import mock

    from google.api_core.exceptions import PreconditionFailed
    from google.cloud import storage

    created: set[str] = set()

    def upload(blob_name, data, **kwargs):
        assert kwargs == {"if_generation_match": 0}
        if blob_name in created:
            raise PreconditionFailed(
                "At least one of the pre-conditions you specified did not hold."
            )
        created.add(blob_name)

    client = mock.create_autospec(storage.Client, instance=True)
    blobs: dict[str, mock.Mock] = {}

    def blob(name):
        handle = blobs.setdefault(name, mock.create_autospec(storage.Blob, instance=True))
        handle.upload_from_string.side_effect = lambda data, **kw: upload(name, data, **kw)
        return handle

    client.bucket.return_value.blob.side_effect = blob
    monkeypatch.setattr(storage, "Client", mock.Mock(return_value=client))
    monkeypatch.setattr(atomic, "listdir", lambda folder: [])
    folder = "gs://bucket/promoted/versions/000003"
    assert atomic.claim_folder(folder)
    assert not atomic.claim_folder(folder)  # 412: another claimant has it
    client.bucket.assert_called_with("bucket")
    assert set(blobs) == {"promoted/versions/000003/CLAIM-owner"}
    # A folder claimed by listing (an earlier alignpipe) is taken: nothing is created.
    monkeypatch.setattr(atomic, "listdir", lambda folder: ["CLAIM-3f2a"])
    assert not atomic.claim_folder("gs://bucket/promoted/versions/000004")
    assert set(blobs) == {"promoted/versions/000003/CLAIM-owner"}


def test_the_layout_before_versions_still_reads_and_becomes_version_one(tmp_path, capsys):
    root = tmp_path / "promoted"
    _policy(root, "legacy")
    promoted_at = "2025-01-06T03:00:00+00:00"
    (root / "PROMOTED.json").write_text(
        json.dumps({"source": "/old/ppo", "promoted_at": promoted_at})
    )
    assert stage_io.reference_uri(policies.check_policy(str(root))) == str(root)
    assert main(["history", str(root)]) == 0
    assert "before versions were kept" in capsys.readouterr().out

    assert promotion.promote(str(root), _policy(tmp_path / "ppo", "new")) == 2
    first, second = promotion.read_history(str(root))
    assert (first["version"], first["time"], first["source"]) == (1, promoted_at, "/old/ppo")
    assert "adopted" in first["note"] and second["version"] == 2
    adopted = Path(promotion.version_folder(str(root), 1))
    assert (adopted / "params" / "weights").read_text() == "legacy"
    assert not (adopted / "versions").exists()  # the root's own entries stay out of the copy
    assert _weights(policies.check_policy(str(root))) == "new"
    promotion.rollback(str(root), 1)
    assert _weights(policies.check_policy(str(root))) == "legacy"


def test_a_damaged_legacy_marker_claims_nothing_and_a_naive_time_is_replaced(tmp_path, capsys):
    root = tmp_path / "promoted"
    _policy(root, "legacy")
    (root / "PROMOTED.json").write_text("{oops")
    policy = _policy(tmp_path / "ppo", "new")
    assert main(["promote", policy, "--to", str(root)]) == 1
    assert f"{root / 'PROMOTED.json'} is not valid JSON" in capsys.readouterr().err
    assert not (root / "versions").exists()  # nothing claimed: version 1 is still the legacy's
    (root / "PROMOTED.json").write_text(json.dumps({"promoted_at": "2025-01-06T03:00:00"}))
    assert main(["promote", policy, "--to", str(root)]) == 0
    first, second = promotion.read_history(str(root))  # the naive time is not written back
    assert first["version"] == 1 and datetime.fromisoformat(first["time"]).tzinfo is not None


def test_check_policy_on_plain_folders_and_roots_without_a_current_version(tmp_path):
    policy = tmp_path / "policy"
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        policies.check_policy(str(policy))
    _policy(policy, "plain")
    assert stage_io.reference_uri(policies.check_policy(str(policy))) == str(policy)

    root = tmp_path / "promoted"
    (root / "versions" / "000001" / "params").mkdir(parents=True)  # the first copy crashed
    with pytest.raises(FileNotFoundError, match="no CURRENT: no promotion there finished"):
        policies.check_policy(str(root))
    with pytest.raises(FileNotFoundError, match="it has no config.json"):
        promotion.promote(str(root), str(tmp_path / "nothing"))


def test_promote_by_hand_seeds_a_root_with_the_original_policy(tmp_path, capsys, monkeypatch):
    root = tmp_path / "promoted"
    sft = _policy(tmp_path / "sft", "original")
    assert main(["promote", sft, "--to", str(root), "--note", "the sft policy"]) == 0
    assert "version 1 is current" in capsys.readouterr().out
    assert _weights(policies.check_policy(str(root))) == "original"
    assert promotion.read_history(str(root))[0]["note"] == "the sft policy"
    monkeypatch.chdir(tmp_path)  # a relative POLICY is recorded as the folder it names
    assert main(["promote", "sft", "--to", str(root)]) == 0
    assert promotion.read_history(str(root))[1]["source"] == sft
    assert main(["promote", str(tmp_path / "none"), "--to", str(root)]) == 1
    assert "has no config.json" in capsys.readouterr().err
