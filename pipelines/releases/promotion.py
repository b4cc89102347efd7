"""Promotion history: numbered policy versions under one URI, an atomic CURRENT pointer.

A promotion root (the pipeline's ``promoted_policy_uri``, a local folder or gs://)::

    ROOT/
      CURRENT                       {"version": 3, ...}: the version readers use
      history.jsonl                 one JSON line per event, oldest first
      versions/000001/              a complete policy folder (config.json, params/, ...)
        PROMOTED.json               its promotion record, written last: the COMPLETE marker
      versions/000002/ ...
      rollbacks/<ns>-<id>.json      one record per rollback

A promotion claims the next number, copies the policy into its folder, writes PROMOTED.json,
then switches CURRENT, so CURRENT names only complete versions whatever crashes or races.
Version folders are never changed once complete: a task that resolved CURRENT keeps reading
the same files after a later promotion or a rollback.

Claiming a number: the version folder is claimed by one promotion only, locally by creating
it, on gs:// by a claim object and a listing (``atomic.py`` says why that holds).

Switching CURRENT: locally a temporary file and ``os.replace``; on gs:// one object write,
which GCS makes atomic (a reader gets the old object or the new one, never a part). Of two
racing promotions the one that finishes last is current; both stay in the history.

The history: GCS objects cannot be appended to, and a read-modify-write of one log loses an
event written meanwhile. So each event is a write-once record (a version's PROMOTED.json, a
rollback's file) and history.jsonl is rewritten whole from the records after every event,
again when a racing event landed during the rewrite. :func:`read_history` reads the records.

The layout before versions (a policy copied into ROOT itself, with PROMOTED.json) still reads
as a policy, and the first promotion after it keeps that policy as version 1.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from components.core import fileio
from components.core.model.heads import require_head
from pipelines import stage_io
from pipelines.releases import atomic

log = logging.getLogger(__name__)
CURRENT = "CURRENT"
HISTORY = "history.jsonl"
VERSIONS = "versions"
ROLLBACKS = "rollbacks"
COMPLETE = "PROMOTED.json"  # a version's record, written last; the legacy layout's marker too
POLICY_FILES = ("config.json", "params")
# Top-level names of a root that are not part of a legacy policy copied into it.
ROOT_ENTRIES = frozenset({CURRENT, HISTORY, VERSIONS, ROLLBACKS, COMPLETE})


class PromotionRecordError(ValueError):
    """A record under a promotion root (CURRENT, a PROMOTED.json, a rollback's file) that does
    not read as one; the message names the file and how to mend it."""


def version_folder(root: str, version: int) -> str:
    """The folder of a version: ``ROOT/versions/000042``."""
    return fileio.join(root, VERSIONS, f"{version:06d}")


def claimed_versions(root: str) -> list[int]:
    """Every version number claimed under ``root``, complete or not, ascending."""
    names = atomic.listdir(fileio.join(root, VERSIONS))
    return sorted(int(name) for name in names if re.fullmatch("[0-9]+", name))


def complete_versions(root: str) -> list[int]:
    """The versions whose copy finished (their PROMOTED.json exists), ascending."""
    return [v for v in claimed_versions(root) if _is_complete(root, v)]


def current_version(root: str) -> int | None:
    """The version CURRENT names, or None when ``root`` has no CURRENT."""
    path = fileio.join(root, CURRENT)
    if not root or not fileio.exists(path):
        return None
    mend = f"rewrite it with `alignpipe rollback {root} --to VERSION`"
    pointer = _load_json(path, mend)
    version = pointer.get("version") if isinstance(pointer, dict) else None
    if type(version) is not int or version < 1:
        raise PromotionRecordError(f"{path} names no version (it holds {_clip(pointer)}); {mend}")
    return version


def is_legacy(root: str) -> bool:
    """Whether ``root`` holds a policy promoted straight into it (the layout before versions:
    its files and PROMOTED.json); a plain policy folder is not one."""
    return bool(root) and all(
        fileio.exists(fileio.join(root, name)) for name in ("config.json", COMPLETE)
    )


def check_promotion(root: str, policy_dir: str) -> None:
    """Refuse what a promotion must not do: promote a reward model, write into a file, into
    a model folder that is no promotion root (it would turn into one and resolve to the new
    version), or into ``policy_dir`` itself (the copy would copy itself)."""
    for name in POLICY_FILES:
        if not fileio.exists(fileio.join(policy_dir, name)):
            raise FileNotFoundError(f"cannot promote {policy_dir!r}: it has no {name}")
    require_head(policy_dir, scalar=False, flag="the promoted policy")
    if fileio.exists(root) and not fileio.isdir(root):
        raise ValueError(f"{root!r} is a file; pass a folder for the promoted versions")
    if fileio.exists(fileio.join(root, "config.json")) and not is_legacy(root):
        raise ValueError(
            f"{root!r} holds a model that was never promoted (config.json, no {COMPLETE}); "
            "pass a new folder or a promoted_policy_uri as the root (were the two swapped?)"
        )
    if fileio.is_within(root, policy_dir):
        raise ValueError(f"{root!r} is {policy_dir!r} or inside it; pass a root outside the policy")


def resolve_policy(uri: str) -> str:
    """The policy folder ``uri`` stands for: its current version when it is a promotion root.

    A plain policy folder, or one promoted in the layout before versions, is itself.
    """
    version = current_version(uri)
    if version is not None:
        if not _is_complete(uri, version):
            raise FileNotFoundError(
                f"{uri}: CURRENT names version {version}, which has no {COMPLETE}; "
                f"choose a complete one with `alignpipe rollback {uri} --to VERSION`"
            )
        return version_folder(uri, version)
    if uri and not is_legacy(uri) and claimed_versions(uri):
        complete = complete_versions(uri)
        if complete:
            listed = ", ".join(str(v) for v in complete)
            raise FileNotFoundError(
                f"{uri} holds complete versions ({listed}) but no {CURRENT}; choose one with "
                f"`alignpipe rollback {uri} --to VERSION`"
            )
        raise FileNotFoundError(
            f"{uri} holds promotion versions but no {CURRENT}: no promotion there finished; "
            f"see `alignpipe history {uri}`, or pass a policy folder"
        )
    return uri


def promote(
    root: str,
    policy_dir: str,
    record: dict[str, Any] | None = None,
    register: Callable[[int, str], dict[str, Any]] | None = None,
) -> int:
    """Add ``policy_dir`` to ``root`` as a new version, make it current; returns its number.

    ``record`` adds to the history line: ``run_id``, ``data_fingerprint``, the evaluation's
    ``blessed`` and ``reasons``, and its ``summary`` (stored flat as ``figures``).
    ``register(version, folder)``, called once the copy is complete and before the version
    is marked complete, registers it elsewhere (model_registry.py); what it returns is the
    line's ``registry``. When it raises, the version stays incomplete and CURRENT unchanged.
    """
    check_promotion(root, policy_dir)
    read_history(root)  # a damaged record is refused before anything changes
    _adopt_legacy(root)
    version = _claim_next(root)
    _copy_policy(policy_dir, version_folder(root, version))
    source = policy_dir if "://" in policy_dir else os.path.abspath(policy_dir)  # as found later
    entry = _promotion_entry(version, source, record or {})
    if register is not None:
        entry["registry"] = register(version, version_folder(root, version))
    atomic.write_atomic(fileio.join(version_folder(root, version), COMPLETE), json.dumps(entry))
    _switch_current(root, version)
    _rebuild_history(root)
    return version


def rollback(root: str, to: int, reason: str = "") -> dict[str, Any] | None:
    """Make version ``to`` current again and record it; None when it already was."""
    complete = complete_versions(root) if root else []
    if not complete:
        raise FileNotFoundError(
            f"{root!r} holds no promoted versions to roll back to; pass the "
            "promoted_policy_uri of runs that promoted a policy"
        )
    if to not in complete:
        state = "never finished copying" if to in claimed_versions(root) else "does not exist"
        listed = ", ".join(str(v) for v in complete)
        raise ValueError(f"version {to} of {root} {state}; complete versions: {listed}")
    read_history(root)  # a damaged record is refused before anything changes
    try:
        previous = current_version(root)
    except PromotionRecordError:
        previous = None  # a damaged CURRENT is what a rollback mends
    if previous == to:
        return None
    # The record first: a rollback that cannot be recorded does not happen.
    entry = {"event": "rollback", "from": previous, "to": to, "time": _now(), "reason": reason}
    record = fileio.join(root, ROLLBACKS, f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json")
    atomic.write_atomic(record, json.dumps(entry))
    try:
        _switch_current(root, to)
    except OSError:
        fileio.remove(record)
        raise
    _rebuild_history(root)
    return entry


def read_history(root: str) -> list[dict[str, Any]]:
    """Every promotion and rollback recorded under ``root``, oldest first; a record that
    does not read as one raises :class:`PromotionRecordError` naming its file."""
    return _read_events(_record_paths(root))


def _claim_next(root: str) -> int:
    """Claim the lowest number above every claimed one (a lost race moves up by one)."""
    version = max(claimed_versions(root), default=0) + 1
    while not atomic.claim_folder(version_folder(root, version)):
        version += 1
    return version


def _adopt_legacy(root: str) -> None:
    """A policy promoted into ``root`` itself, before versions were kept, becomes version 1.

    The top-level copy stays where it is, so readers that resolved ``root`` to it go on
    reading it. When two promotions race here, the one that claims version 1 copies it.
    """
    if not is_legacy(root) or claimed_versions(root):
        return
    # Read before claiming: a marker that does not parse stops here, with nothing claimed.
    legacy = _load_json(fileio.join(root, COMPLETE), "fix it or remove it")
    legacy = legacy if isinstance(legacy, dict) else {}
    if not atomic.claim_folder(version_folder(root, 1)):
        return
    _copy_policy(root, version_folder(root, 1))
    promoted_at = legacy.get("promoted_at")
    entry = {
        "event": "promotion",
        "version": 1,
        "time": promoted_at if _aware_time(promoted_at) else _now(),
        "source": legacy.get("source", root),
        "note": "adopted: promoted into the folder itself, before versions were kept",
    }
    atomic.write_atomic(fileio.join(version_folder(root, 1), COMPLETE), json.dumps(entry))


def _copy_policy(policy_dir: str, folder: str) -> None:
    """Copy a policy's files into a claimed version folder (its marker and claims excluded)."""
    for name in atomic.listdir(policy_dir):
        if name in ROOT_ENTRIES or name.startswith((atomic.CLAIM_PREFIX, ".")):
            continue
        source, target = fileio.join(policy_dir, name), fileio.join(folder, name)
        if fileio.isdir(source):
            fileio.copy_tree(source, target)
        else:
            fileio.write_bytes(target, fileio.read_bytes(source))


def _promotion_entry(version: int, source: str, record: dict[str, Any]) -> dict[str, Any]:
    """The history line of a promotion: the caller's record, with the evaluation flattened."""
    extras = dict(record)
    summary = extras.pop("summary", None)
    if summary is not None:
        extras.setdefault("figures", stage_io.scalar_metrics(summary))
    return {**extras, "event": "promotion", "version": version, "time": _now(), "source": source}


def _switch_current(root: str, version: int) -> None:
    folder = f"{VERSIONS}/{version:06d}"
    pointer = {"version": version, "folder": folder, "switched_at": _now()}
    atomic.write_atomic(fileio.join(root, CURRENT), json.dumps(pointer))


def _rebuild_history(root: str) -> None:
    """Rewrite history.jsonl from the records; again while a racing event lands meanwhile.

    The records are the history: when history.jsonl cannot be written, the event stands
    and a warning says so."""
    for _ in range(5):
        paths = _record_paths(root)
        lines = [json.dumps(event, sort_keys=True) + "\n" for event in _read_events(paths)]
        try:
            atomic.write_atomic(fileio.join(root, HISTORY), "".join(lines))
        except OSError as error:
            log.warning("%s was not rewritten (%s); `alignpipe history` reads the records",
                        fileio.join(root, HISTORY), error)  # fmt: skip
            return
        if _record_paths(root) == paths:
            return


def _record_paths(root: str) -> list[str]:
    """The write-once records of ``root``'s events: complete versions' markers, rollbacks."""
    markers = [fileio.join(version_folder(root, v), COMPLETE) for v in complete_versions(root)]
    folder = fileio.join(root, ROLLBACKS)
    rollbacks = [
        fileio.join(folder, n) for n in sorted(atomic.listdir(folder)) if n.endswith(".json")
    ]
    return markers + rollbacks


def _read_events(paths: list[str]) -> list[dict[str, Any]]:
    events = [_read_record(path) for path in paths]
    return sorted(events, key=_event_order)


def _read_record(path: str) -> dict[str, Any]:
    """One event's record, checked for what the history needs: its event, its time (UTC,
    as written), and the version it made current (a promotion's ``version``, a rollback's
    ``to``)."""
    mend = f"fix it or remove it (the root's {HISTORY} holds every record as last read)"
    record = _load_json(path, mend)
    kind = "rollback" if os.path.basename(os.path.dirname(path)) == ROLLBACKS else "promotion"
    key = "to" if kind == "rollback" else "version"
    problem = ""
    if not isinstance(record, dict):
        problem = f"it holds {_clip(record)}, not an object"
    elif record.get("event") != kind:
        problem = f"its event is {record.get('event')!r}"
    elif type(record.get(key)) is not int:
        problem = f"its {key!r} is {record.get(key)!r}, not a version number"
    elif kind == "promotion" and f"{record[key]:06d}" != os.path.basename(os.path.dirname(path)):
        problem = f"its version {record[key]} is not its folder's"
    elif not _aware_time(record.get("time")):
        problem = f"its time is {record.get('time')!r}, not an ISO time with a time zone"
    if problem:
        raise PromotionRecordError(f"{path} is not a {kind} record: {problem}; {mend}")
    return record


def _aware_time(text: Any) -> bool:
    try:
        return datetime.datetime.fromisoformat(text).tzinfo is not None
    except (TypeError, ValueError):
        return False


def _load_json(path: str, mend: str) -> Any:
    """The JSON in ``path``; a damaged file is named, with ``mend``."""
    try:
        return json.loads(fileio.read_text(path))
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise PromotionRecordError(f"{path} is not valid JSON ({error}); {mend}") from None
    except OSError as error:  # a folder where the file should be, no permission, ...
        raise PromotionRecordError(f"{path} cannot be read ({error}); {mend}") from None


def _clip(value: Any) -> str:
    """A short rendering of a record's value for a message."""
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _event_order(event: dict[str, Any]) -> tuple[datetime.datetime, int]:
    return datetime.datetime.fromisoformat(event["time"]), int(event.get("version") or 0)


def _is_complete(root: str, version: int) -> bool:
    return fileio.exists(fileio.join(version_folder(root, version), COMPLETE))


def _now() -> str:
    """The UTC time to the microsecond, so events of one second still sort."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")
