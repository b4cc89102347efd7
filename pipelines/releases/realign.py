"""Periodic realignment: whether a run has anything new to train on, and what anchors it.

Both are read from the promotion history at ``promoted_policy_uri`` (promotion.py):

- **Nothing new, nothing run.** A run whose data files (find-data's sources: uri and
  fingerprint of every file its glob matched) equal those of the last promoted run trains
  nothing and ends as "no new data", unless forced. The last promoted run is the newest
  promotion in time, whatever a rollback made current since: its data was trained on. The
  built-in task (``data_uri`` '') is generated into every run, so it is always new.
- **The anchor.** Drift is measured from a fixed policy: ``anchor_policy`` when given (a
  promotion root stands for its first version), else the first version promoted to
  ``promoted_policy_uri`` (seed it with the original SFT or base policy: ``alignpipe
  promote``), else none: the run's reference is its anchor.
"""

from __future__ import annotations

import json
from typing import Any

from components.core import fileio
from components.core.model.hf_folder import is_hf_dir
from pipelines import stage_io
from pipelines.releases import promotion

NO_NEW_DATA = "no new data"
# A promotion's flat figures (promotion._promotion_entry) behind each drift-table column.
DRIFT_FIGURES = {
    "anchor_kl": "anchor/kl/per_token",
    "anchor_win_rate": "anchor/win_rate/value",
    "anchor_gold_gain": "anchor/gold/difference/value",
    "kl": "kl/per_token",
}


def last_promotion(root: str) -> dict[str, Any] | None:
    """The newest promotion event under ``root`` (rollbacks skipped), or None."""
    if not root or not fileio.isdir(root):
        return None
    events = [e for e in promotion.read_history(root) if e.get("event") == "promotion"]
    return events[-1] if events else None


def has_new_data(data_uri: str, sources: str, root: str) -> bool:
    """Whether the sources differ from the last promoted run's (always for the built-in task)."""
    if not data_uri:
        return True
    last = last_promotion(root)
    if last is None or not last.get("data_fingerprint"):
        return True
    return last["data_fingerprint"] != stage_io.data_fingerprint(sources)


def anchor_folder(anchor_policy: str, root: str) -> str:
    """The anchor's policy folder, or '' for none (the reference is the anchor then)."""
    given = anchor_policy or root
    if not given:
        return ""
    complete = promotion.complete_versions(given) if fileio.isdir(given) else []
    if complete:
        return promotion.version_folder(given, complete[0])
    if not anchor_policy:
        return ""  # nothing promoted yet
    if is_hf_dir(anchor_policy):
        return anchor_policy  # imported by the evaluate task
    for name in promotion.POLICY_FILES:
        if not fileio.exists(fileio.join(anchor_policy, name)):
            raise FileNotFoundError(
                f"anchor_policy {anchor_policy!r} has no {name}; pass a policy folder "
                "(config.json + params/, or a Hugging Face model folder) or a "
                "promoted_policy_uri, or '' for the first promoted version"
            )
    return anchor_policy


def drift_rows(root: str) -> list[dict[str, Any]]:
    """One row per past promotion: its KL to its anchor and to its reference, win rate and
    gold gain against its anchor (None where the promotion predates anchors)."""
    if not root or not fileio.isdir(root):
        return []
    rows = []
    for event in promotion.read_history(root):
        if event.get("event") != "promotion":
            continue
        figures = event.get("figures", {})
        row = {key: figures.get(name) for key, name in DRIFT_FIGURES.items()}
        rows.append({"label": f"version {event['version']}", **row})
    return rows


def plan(
    data_uri: str, sources: str, force_run: bool, anchor_policy: str, root: str
) -> tuple[bool, str]:
    """Whether the run trains, and a reference to its anchor (uri '' for none) that carries
    the past promotions' drift rows (``past``)."""
    train = force_run or has_new_data(data_uri, sources, root)
    anchor = anchor_folder(anchor_policy, root)
    fingerprint = stage_io.fingerprint(anchor) if anchor else ""
    return train, stage_io.reference(anchor, fingerprint, past=drift_rows(root))


def no_new_data_result(sources: str, root: str) -> str:
    """The run's result when it trains nothing: the status and the promotion it matched."""
    last = last_promotion(root) or {}
    return json.dumps(
        {
            "status": NO_NEW_DATA,
            "data_fingerprint": stage_io.data_fingerprint(sources),
            "files": len(json.loads(sources)),
            "matches_version": last.get("version"),
            "matches_run": last.get("run_id", ""),
            "current_version": promotion.current_version(root),
        },
        sort_keys=True,
    )
