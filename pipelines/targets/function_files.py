"""A cloud run's function files: a local ``PATH.py:FUNCTION`` travels with the run.

The tasks of a Vertex or GKE run cannot read the submitting machine's files. At submit,
each local file a function parameter names (``reward_functions``, ``gold_reward``) is
copied under the pipeline root, at ``<pipeline_root>/functions/<sha256[:16]>/<name>.py``
(a content address: the same file is one object however often it is submitted, and a
changed file is a new one, so a cached task never reads code it was not keyed on), and the
spec is rewritten to it. A spec already on ``gs://``, a ``MODULE:FUNCTION`` (installed in
the image) and a built-in name stay as they are.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from components.core import fileio

FUNCTION_PARAMS = ("reward_functions", "gold_reward")
FOLDER = "functions"


def _uploaded(spec: str, pipeline_root: str) -> str:
    """``spec`` with its local file copied under the pipeline root, or as it is."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or "://" in path:
        return spec
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{spec!r}: no file {path!r} on this machine; give the file's path, or its gs:// "
            "copy, or a MODULE:FUNCTION installed in the image"
        )
    data = fileio.read_bytes(path)
    digest = hashlib.sha256(data).hexdigest()[:16]
    target = fileio.join(pipeline_root, FOLDER, digest, os.path.basename(path))
    if not fileio.exists(target):
        fileio.write_bytes(target, data)
    return f"{target}:{name}"


def with_uploaded_functions(values: dict[str, Any], pipeline_root: str) -> dict[str, Any]:
    """``values`` with every local function file copied under ``pipeline_root`` and named
    there (module docstring)."""
    out = dict(values)
    for param in FUNCTION_PARAMS:
        text = str(values.get(param) or "")
        if ".py:" in text:
            specs = [spec.strip() for spec in text.split(",") if spec.strip()]
            out[param] = ",".join(_uploaded(spec, pipeline_root) for spec in specs)
    return out
