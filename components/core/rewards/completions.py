"""What reward functions are called with, from sampled tokens and prompt records: each
response decoded up to its stop token, as TRL passes it, and the records' columns.

Shared by the RL stage's rollouts and the evaluate stage's verifiable evaluation, so both
call a function with the same arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from components.core.data.tokenizers import Tokenizer


def completion(tokenizer: Tokenizer, tokens: np.ndarray, mask: np.ndarray) -> tuple[str, list]:
    """One response's text up to (without) its first stop token, and its ids (with it: TRL's
    masked completion ids)."""
    ids = [int(t) for t in tokens[mask != 0]]
    stops = np.flatnonzero(np.isin(ids, np.asarray(tokenizer.stop_ids)))
    return tokenizer.decode(ids[: stops[0]] if stops.size else ids), ids


def as_completion(text: str, conversational: bool) -> Any:
    """A completion as TRL passes it: the text, or for conversational data one assistant
    message."""
    return [{"role": "assistant", "content": text}] if conversational else text


def columns_of(records: Sequence[Mapping[str, Any]]) -> dict[str, list]:
    """The records' columns, one list per name; a column a record lacks is None for it, as a
    missing field of a datasets row is."""
    names = sorted({name for record in records for name in record})
    return {name: [record.get(name) for record in records] for name in names}


def is_conversational(manifest: Mapping[str, Any]) -> bool:
    """Whether the shards' records were chat messages (TRL's conversational formats)."""
    return any(str(s.get("format", "")).startswith("conversational") for s in manifest["sources"])
