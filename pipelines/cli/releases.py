"""``alignpipe history URI``, ``alignpipe rollback URI --to VERSION`` and ``alignpipe promote
POLICY --to URI`` (seeding a root with the original policy): promoted versions."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

# The history table's figures: column title, name in the evaluation's flat figures, format.
FIGURES = (
    ("win rate", "win_rate/value", "{:.3f}"),
    ("KL/token", "kl/per_token", "{:.4f}"),
    ("anchor KL", "anchor/kl/per_token", "{:.4f}"),
    ("gold gain", "gold/difference/value", "{:+.3f}"),
)


URI_HELP = "a promoted_policy_uri: a local folder or gs://"


def add_history(parser: argparse.ArgumentParser) -> None:
    """``alignpipe history URI``."""
    parser.add_argument("uri", metavar="URI", help=URI_HELP)
    parser.add_argument("--json", action="store_true", help="print the events as JSON lines")
    parser.set_defaults(handler=_history)


def add_rollback(parser: argparse.ArgumentParser) -> None:
    """``alignpipe rollback URI --to VERSION``."""
    parser.description = (
        "Switch URI's CURRENT pointer to a complete version; the next run that "
        "warm-starts from URI reads it. The switch is recorded in the history."
    )
    parser.add_argument("uri", metavar="URI", help=URI_HELP)
    parser.add_argument("--to", type=int, required=True, metavar="VERSION", help="e.g. 2")
    parser.add_argument("--reason", default="", help="why, for the history")
    parser.set_defaults(handler=_rollback)


def add_promote(parser: argparse.ArgumentParser) -> None:
    """``alignpipe promote POLICY --to URI``."""
    parser.description = (
        "Copy POLICY (config.json + params/) into URI as its next version and make "
        "it current. Seeding an empty URI this way gives scheduled runs (base_policy=URI) "
        "their start and their anchor: the first version."
    )
    parser.add_argument("policy", metavar="POLICY", help="a policy model folder")
    parser.add_argument("--to", required=True, metavar="URI", help=URI_HELP)
    parser.add_argument("--note", default="", help="why, for the history")
    parser.set_defaults(handler=_promote)


def format_history(events: list[dict[str, Any]], current: int | None) -> str:
    """The events as a table, oldest first; ``*`` marks the current version.

    A ``registry`` column (the Vertex Model Registry version ID) shows when any version was
    uploaded there (pipeline parameter registry_model); ``--json`` has the model's name.
    """
    header = ["", "version", "event", "time (UTC)", "run", *(f[0] for f in FIGURES), "note"]
    rows = [header] + [_row(event, current) for event in events]
    if any(event.get("registry") for event in events):
        header.insert(-1, "registry")
        for row, event in zip(rows[1:], events, strict=True):
            registry = event.get("registry")
            row.insert(-1, _text(registry.get("version_id")) if isinstance(registry, dict) else "")
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    numeric = range(5, 5 + len(FIGURES))  # the figures line up on their right edge
    lines = []
    for row in rows:
        cells = [
            c.rjust(w) if i in numeric else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells))
    return "\n".join(line.rstrip() for line in lines)


def _row(event: dict[str, Any], current: int | None) -> list[str]:
    """One event's cells; the records' optional fields are shown whatever their type."""
    when = event["time"][:19].replace("T", " ")
    if event["event"] == "rollback":
        moved = f"{event.get('from') or '-'} -> {event['to']}"
        reason = _text(event.get("reason"))
        return ["", moved, "rollback", when, "", *("" for _ in FIGURES), reason]
    figures = event.get("figures")
    figures = figures if isinstance(figures, dict) else {}
    shown = [_figure(figures.get(name), fmt) for _, name, fmt in FIGURES]
    mark = "*" if event["version"] == current else ""
    run_id, note = _text(event.get("run_id")), _text(event.get("note"))
    return [mark, str(event["version"]), "promotion", when, run_id, *shown, note]


def _figure(value: Any, fmt: str) -> str:
    """A figure in its column's format; '-' when missing, as written when not a number."""
    if value is None:
        return "-"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return fmt.format(value)
    return _text(value)


def _text(value: Any) -> str:
    """An optional field as one line of text ('' for none)."""
    return "" if value is None else " ".join(str(value).split())


def _history(args: argparse.Namespace, rest: list[str]) -> int:
    from pipelines.releases import promotion

    try:
        root = _existing(args.uri)
        events = promotion.read_history(root)
        current = promotion.current_version(root)
    except (ValueError, OSError) as error:  # OSError: unwritable or odd files under URI
        return _error(error)
    if args.json:
        for event in events:
            print(json.dumps(event, sort_keys=True))
        return 0
    if not events:
        if promotion.is_legacy(root):
            print(f"{root} holds one policy, promoted before versions were kept; the next "
                  "promotion there keeps it as version 1")  # fmt: skip
            return 0
        return _error(f"{root} holds no promoted versions; pass the promoted_policy_uri of "
                      "runs whose evaluation blessed a policy")  # fmt: skip
    print(format_history(events, current))
    if current is None:
        if not promotion.is_legacy(root):
            return _error(f"{root} has no {promotion.CURRENT}; runs that read it fail until "
                          f"`alignpipe rollback {root} --to VERSION` names a version")  # fmt: skip
        return 0
    if current not in promotion.complete_versions(root):
        return _error(f"{root}'s {promotion.CURRENT} names version {current}, which is not a "
                      f"complete version; runs that read {root} fail until `alignpipe "
                      f"rollback {root} --to VERSION` names one")  # fmt: skip
    print(f"* current: version {current} ({promotion.version_folder(root, current)})")
    return 0


def _rollback(args: argparse.Namespace, rest: list[str]) -> int:
    from pipelines.releases import promotion

    try:
        root = _existing(args.uri)
        entry = promotion.rollback(root, args.to, args.reason)
    except (ValueError, OSError) as error:  # OSError: unwritable or odd files under URI
        return _error(error)
    if entry is None:
        print(f"version {args.to} is already current at {root}; nothing changed")
    else:
        was = (
            entry["from"]
            if entry["from"] is not None
            else f"none: {promotion.CURRENT} was unreadable or missing"
        )
        print(f"version {args.to} is current at {root} (was {was}); recorded in "
              f"{promotion.HISTORY}")  # fmt: skip
    return 0


def _promote(args: argparse.Namespace, rest: list[str]) -> int:
    from pipelines.releases import promotion

    if not args.to.strip():
        return _error("--to is empty; pass a promoted_policy_uri (a local folder or gs://)")
    record = {"run_id": "", "note": args.note or "promoted by hand"}
    try:
        version = promotion.promote(args.to, args.policy, record)
    except (ValueError, OSError) as error:  # OSError: unwritable or odd files under URI
        return _error(error)
    print(f"version {version} is current at {args.to}")
    return 0


def _existing(uri: str) -> str:
    """``uri`` when it names an existing folder; a message that says what to pass otherwise."""
    from components.core import fileio

    if not uri.strip():
        raise ValueError("URI is empty; pass a promoted_policy_uri (a local folder or gs://)")
    if not fileio.isdir(uri):
        raise FileNotFoundError(f"{uri} is not a folder; pass the promoted_policy_uri of a run")
    return uri


def _error(error: Exception | str) -> int:
    print(f"error: {error}", file=sys.stderr)
    return 1
