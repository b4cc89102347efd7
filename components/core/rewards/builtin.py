"""Built-in reward functions for verifiable tasks, with TRL's signature:
``(prompts, completions, **columns) -> list[float | None]``.

A completion is a string (standard prompts) or a list of messages whose first holds the
response's ``content`` (conversational prompts), as TRL passes them; both are read here.

- ``builtin/exact-match``: 1.0 when the completion's answer equals the record's ``answer``
  column (else its ``solution`` column, as TRL's ``accuracy_reward`` reads it), else 0.0;
  None (not judged) where the record has neither (None, NaN or blank). The answer is the last
  ``<answer>…</answer>`` tag, else the last ``\\boxed{…}``, else the last number in the
  text. The reference is read as the datasets write it (:func:`reference_answer`): GSM8K's
  worked solution by its last line's text after ``####`` (as verl's gsm8k reward reads it),
  a MATH solution by its last ``\\boxed{…}``, anything else whole. Numbers compare as
  numbers (``12``, ``12.0``, ``1,200`` = ``1200``), text by its stripped, case-folded form.
- ``builtin/think-format``: 1.0 when the completion is ``<think>…</think>`` followed by a
  non-empty answer, with no second ``<think>``; else 0.0 (TRL's ``think_format_reward``
  pattern, plus the answer after it).
- ``builtin/length-penalty``: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13, as
  TRL's ``get_soft_overlong_punishment``): 0 up to ``L_max - L_cache`` tokens, then falling
  linearly to -1 at ``L_max``; ``L_max`` is the rollout's ``max_completion_length``,
  ``L_cache`` a fifth of it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
# GSM8K's final line: "#### 72" (a markdown heading elsewhere in a solution is not it).
GSM8K_FINAL = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*([^\n]*\S)[ \t]*\Z")
THINK = re.compile(r"^\s*<think>(?!.*<think>)(.+?)</think>\s*(\S.*)$", re.DOTALL)
LENGTH_CACHE_FRACTION = 0.2


def text_of(completion: Any) -> str:
    """A completion's text: the string, or its first message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Sequence) and completion and isinstance(completion[0], dict):
        content = completion[0].get("content", "")
        return content if isinstance(content, str) else str(content)
    return str(completion)


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None


def extract_answer(text: str) -> str | None:
    """The answer a completion gives: its last answer tag, else last box, else last number."""
    tags = ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _number(text: str) -> float | None:
    cleaned = text.strip().replace(",", "").rstrip(".")
    try:
        return float(cleaned)
    except ValueError:
        return None


def reference_answer(reference: Any) -> str:
    """The answer a reference column states: openai/gsm8k's ``answer`` is a worked solution
    whose last line is ``#### 72`` (that line's text), a MATH ``solution`` boxes its answer
    (the last ``\\boxed{…}``); a plain answer is itself."""
    text = str(reference).strip()
    final = GSM8K_FINAL.search(text)
    if final:
        return final.group(1).strip()
    boxed = _boxed(text)
    return boxed.strip() if boxed is not None else text


def _missing(value: Any) -> bool:
    """No reference: None, NaN (a Parquet float column's null) or blank text (a CSV's)."""
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    return isinstance(value, str) and not value.strip()


def answers_match(given: str | None, expected: Any) -> bool:
    """Whether an extracted answer equals the reference's (numbers by value)."""
    if given is None:
        return False
    expected_text = reference_answer(expected)
    a, b = _number(given), _number(expected_text)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-9 * max(1.0, abs(b))
    return given.strip().casefold() == expected_text.casefold()


def exact_match(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any] = (),
    solution: Sequence[Any] = (),
    **_: Any,
) -> list[float | None]:
    """1.0 when the completion's answer equals the reference's: ``answer``, else
    ``solution`` (None where a record has neither)."""
    n = len(completions)
    answers = list(answer) if answer is not None and len(answer) == n else [None] * n
    solutions = list(solution) if solution is not None and len(solution) == n else [None] * n
    answers = [s if _missing(a) else a for a, s in zip(answers, solutions, strict=True)]
    return [
        None if _missing(expected) else float(answers_match(extract_answer(text_of(c)), expected))
        for c, expected in zip(completions, answers, strict=True)
    ]


def think_format(completions: Sequence[Any], **_: Any) -> list[float]:
    """1.0 for ``<think>reasoning</think> answer``, else 0.0."""
    return [1.0 if THINK.match(text_of(c)) else 0.0 for c in completions]


def length_penalty(
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None = None,
    max_completion_length: int | None = None,
    **_: Any,
) -> list[float]:
    """DAPO's soft overlong punishment of each completion's token count (module docstring)."""
    if completion_ids is None or not max_completion_length:
        raise ValueError(
            "builtin/length-penalty needs completion_ids and max_completion_length (the "
            "rollout passes both)"
        )
    limit = int(max_completion_length)
    cache = max(1, int(limit * LENGTH_CACHE_FRACTION))
    free = limit - cache
    penalties = []
    for ids in completion_ids:
        n = len(ids)
        penalties.append(0.0 if n <= free else (-1.0 if n > limit else (free - n) / cache))
    return penalties


BUILTIN = {
    "builtin/exact-match": exact_match,
    "builtin/think-format": think_format,
    "builtin/length-penalty": length_penalty,
}
