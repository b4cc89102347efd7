"""How an import says no: the error it raises, and a config field refused by value."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


class HFImportError(ValueError):
    """A Hugging Face checkpoint alignpipe cannot import, with the reason and the fix."""


@dataclasses.dataclass(frozen=True, slots=True)
class Refusal:
    """A config field whose value alignpipe does not model: ``refused(value)`` says when."""

    field: str
    refused: Callable[[Any], bool]
    reason: str


def refuse(condition: bool, what: str) -> None:
    """Raise HFImportError saying ``what`` is not supported, when ``condition`` holds."""
    if condition:
        raise HFImportError(f"unsupported checkpoint: {what}")
