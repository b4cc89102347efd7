"""The error a record that fails validation raises, its reasons, and the field check the
record formats share (``formats.py``, ``messages.py``)."""

from __future__ import annotations

from typing import Any


class Invalid(Exception):
    """A record that fails validation: ``reason`` is one of ``REASONS``, ``detail`` says why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self) -> tuple:
        # Beam pickles the items that carry one (an undecodable line) between its stages;
        # the default would call __init__ with the message alone.
        return Invalid, (self.reason, self.detail)


REASONS = (
    "not_json",
    "not_object",
    "unknown_format",
    "missing_field",
    "wrong_type",
    "no_common_prompt",
    "empty_prompt",
    "empty_response",
    "identical_responses",
    "too_long",
    "invalid_choice",
    "non_finite_margin",
    "chat_template",  # the model's template refused the conversation (its message kept)
    "unsupported_content",  # an image, audio or video part in a text-only run
    "column_clash",  # a column renamed (the columns option) to a name the record has
)


def require(obj: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    """``obj[key]``, refused as missing or of another type than ``kind``."""
    if key not in obj:
        raise Invalid("missing_field", f"field {key!r} is missing")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise Invalid("wrong_type", f"field {key!r} must be {names}, got {type(value).__name__}")
    return value


def renamed(obj: Any, columns: dict[str, str]) -> Any:
    """A record with its columns renamed (``columns``: old name to new, as datasets'
    ``rename_columns``); a record that has a column under the new name too is refused."""
    if not columns or not isinstance(obj, dict):
        return obj
    out = {key: value for key, value in obj.items() if key not in columns}
    for old, new in columns.items():
        if old not in obj:
            continue
        if new in out:
            raise Invalid(
                "column_clash",
                f"column {old!r} is renamed to {new!r}, which the record has too; drop one "
                "or rename both",
            )
        out[new] = obj[old]
    return out
