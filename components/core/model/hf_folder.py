"""Whether a folder is a Hugging Face model folder: a light check (no JAX), for the
pipeline's small tasks and preflight as much as for the stages."""

from __future__ import annotations

import json

from components.core import fileio


def is_hf_dir(path: str) -> bool:
    """Whether ``path`` (local or gs://) is a HF model folder rather than an alignpipe artifact."""
    config = fileio.join(path, "config.json") if path else ""
    if not config or not fileio.exists(config):
        return False
    try:
        data = json.loads(fileio.read_text(config))
    except ValueError:  # not JSON: neither kind; the reader of the folder names the fault
        return False
    return (
        isinstance(data, dict)
        and "schema_version" not in data
        and ("architectures" in data or "model_type" in data)
    )
