"""What a run was: every pipeline parameter with its value and where it came from, the code
and library versions, the inputs with their digests, the times and the outcome.

A local run writes it as ``run.json`` in its run folder (``alignpipe runs`` lists and shows
them, ``alignpipe rerun --run RUN`` repeats one). A compiled cloud spec carries the same
record, less the run's times and outcome (``spec_record``), in its ``pipelineInfo``'s
description, which Vertex AI and Kubeflow keep with every run of it; its runs are labelled
with the code's version and commit and the libraries' versions (``cloud_labels``).
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import json
import os
import re
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from components.core import fileio
from components.core.file_digest import file_digest, weights_digest
from pipelines.dag import param_table

RECORD_FILE = "run.json"
SCHEMA_VERSION = 1
LIBRARIES = ("jax", "flax", "optax", "orbax-checkpoint", "kfp", "apache-beam", "transformers")
# Where a value came from, weakest first: a later source overrides an earlier one.
SOURCES = ("default", "task", "run preset", "last run", "config", "flag")
# Parameters that name inputs: their digests are recorded.
INPUT_PARAMS = (
    "data_uri", "sft_data_uri", "base_policy", "reward_base_policy", "tokenizer", "gold_reward",
    "reward_functions",
)  # fmt: skip
# Parameters whose PATH.py:FUNCTION specs name files (a module or built-in names none).
FUNCTION_PARAMS = ("gold_reward", "reward_functions")


def code_version() -> dict[str, Any]:
    """alignpipe's version, and the git commit of a source checkout (dirty or not)."""
    root = Path(__file__).resolve().parents[1]
    found: dict[str, Any] = {"alignpipe": metadata.version("alignpipe"), "commit": None}
    if not (root / ".git").exists():
        return found
    try:
        commit = _git(root, "rev-parse", "HEAD")
        found |= {"commit": commit, "dirty": bool(_git(root, "status", "--porcelain", "-uno"))}
    except (OSError, subprocess.SubprocessError):
        pass
    return found


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def library_versions() -> dict[str, str | None]:
    """The installed versions of the libraries a run's results depend on."""
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def parameters(values: dict[str, Any], sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every pipeline parameter: its value and its source (``default`` where none set it)."""
    table = {}
    for param in param_table.PARAMS:
        if param.name in values:
            table[param.name] = {"value": values[param.name], "source": sources.get(param.name)}
        else:
            table[param.name] = {"value": param.default_value(), "source": "default"}
    return table


def input_digests(values: dict[str, Any]) -> dict[str, dict[str, str]]:
    """For each input parameter set: each path it names and that path's digest (a file's
    sha256, a folder's weights or files; gs:// objects by size and update time)."""
    found = {}
    for name in INPUT_PARAMS:
        text = str(values.get(name) or "")
        paths = [p.strip() for p in text.split(",") if p.strip()]
        if name in FUNCTION_PARAMS:
            paths = [p.split(".py:")[0] + ".py" for p in paths if ".py:" in p]
        digests = {}
        for path in paths:
            for match in _matches(path):
                digests[match] = _digest(match)
        if digests:
            found[name] = digests
    return found


def _matches(path: str) -> list[str]:
    if "://" in path:
        return fileio.glob(path) if any(c in path for c in "*?[") else [path]
    if any(c in path for c in "*?["):
        return sorted(glob.glob(path))
    return [path] if os.path.exists(path) else []


def _digest(path: str) -> str:
    """A file's digest; a folder's: its weight files', else every file's under it."""
    try:
        if not fileio.isdir(path):
            return f"sha256:{file_digest(path)}" if "://" not in path else file_digest(path)
        weights = weights_digest(path)
        if weights:
            return f"weights:{weights}"
        digest = hashlib.sha256()
        for file in sorted(fileio.glob(fileio.join(path, "**", "*"))):
            if not fileio.isdir(file):
                digest.update(f"{os.path.relpath(file, path)}\0{file_digest(file)}\0".encode())
        return f"files:{digest.hexdigest()[:16]}"
    except (OSError, ValueError) as error:
        return f"unread: {error}"


def record(
    values: dict[str, Any],
    sources: dict[str, str],
    *,
    started: datetime.datetime,
    ended: datetime.datetime,
    outcome: str,
    stages: dict[str, dict[str, Any]] | None = None,
    error: str = "",
) -> dict[str, Any]:
    """The run's record: what ``run.json`` holds."""
    return {
        "schema_version": SCHEMA_VERSION,
        "code": code_version(),
        "libraries": library_versions(),
        "parameters": parameters(values, sources),
        "inputs": input_digests(values),
        "started": started.isoformat(timespec="seconds"),
        "ended": ended.isoformat(timespec="seconds"),
        "seconds": round((ended - started).total_seconds(), 1),
        "outcome": outcome,
        "stages": stages or {},
        "error": error,
    }


SPEC_PREFIX = "alignpipe run record: "


def spec_record(values: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    """What a compiled spec carries of its runs' record: the parameters with their sources,
    the code and the libraries, and the local inputs' digests (remote ones are listed and
    fingerprinted by the run's own find-data task, with the run's credentials)."""
    local = {k: v for k, v in values.items() if k not in INPUT_PARAMS or "://" not in str(v)}
    return {
        "schema_version": SCHEMA_VERSION,
        "code": code_version(),
        "libraries": library_versions(),
        "parameters": parameters(values, sources),
        "inputs": input_digests(local),
    }


def read_spec_record(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The record a compiled spec (its first YAML document) carries, or None."""
    description = (spec.get("pipelineInfo") or {}).get("description") or ""
    if not description.startswith(SPEC_PREFIX):
        return None
    return json.loads(description[len(SPEC_PREFIX) :])


def values_of(run: dict[str, Any]) -> dict[str, Any]:
    """The parameter values a record's run was given (every source but the defaults), as
    ``rerun`` passes them again: a default stays a default, as it was."""
    return {
        name: entry["value"]
        for name, entry in run["parameters"].items()
        if entry.get("source") != "default"
    }


def cloud_labels() -> dict[str, str]:
    """alignpipe's version and commit, and the libraries' versions, as Vertex/Kubeflow labels
    (lowercase, 63 characters)."""
    code = code_version()
    labels = {"alignpipe_version": _label(code["alignpipe"])}
    if code.get("commit"):
        labels["alignpipe_commit"] = code["commit"][:12] + ("-dirty" if code.get("dirty") else "")
    for name, version in library_versions().items():  # jax_version: 0-10-2
        if version:
            labels[f"{name.split('-')[0]}_version"] = _label(version)
    return {k: v.lower()[:63] for k, v in labels.items()}


def _label(text: str) -> str:
    """``text`` as a label value: lowercase letters, digits, ``_`` and ``-``."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())
