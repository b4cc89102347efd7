"""Reward functions by spec, weighted, as TRL's ``reward_funcs`` and ``reward_weights``.

``reward_functions`` is a comma-separated list of specs: a built-in name
(``builtin/exact-match``, ``builtin/think-format``, ``builtin/length-penalty``:
``builtin.py``), ``PATH.py:FUNCTION`` (a Python file, local or ``gs://``) or
``MODULE:FUNCTION``. ``reward_weights`` is a comma-separated list of as many numbers ('' =
1.0 each). Each function has TRL's signature::

    def my_reward(prompts, completions, **columns) -> list[float | None]: ...

called with keyword arguments: ``prompts`` and ``completions`` (strings, or message lists for
conversational data), ``completion_ids`` (token ids), ``max_completion_length``, and the
prompt dataset's other columns (``answer``, ``solution``, ``tests``, …), one value per
completion. None means "not judged". A function is named in the metrics by its ``__name__``,
as TRL names it (``rewards/<name>/mean``); a built-in by its name without ``builtin/``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from components.core import function_specs
from components.core.rewards.builtin import BUILTIN

RewardFn = Callable[..., Any]
KIND = function_specs.FunctionKind(
    what="reward function",
    signature="(prompts, completions, **columns) -> list[float | None]",
    builtins=tuple(BUILTIN),
    module_prefix="alignpipe_rewards",
)


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """One reward function: its spec, the name its metrics carry, its weight."""

    spec: str
    name: str
    weight: float
    fn: RewardFn = dataclasses.field(repr=False, compare=False)


def parse_specs(text: str) -> list[str]:
    """The specs of a comma-separated ``reward_functions`` ('' = none)."""
    return [spec.strip() for spec in text.split(",") if spec.strip()]


def parse_weights(text: str, count: int) -> list[float]:
    """``reward_weights`` as ``count`` finite numbers ('' = 1.0 each)."""
    if not text.strip():
        return [1.0] * count
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ValueError(
            f"reward_weights: {text!r} is not a comma-separated list of numbers, e.g. '1.0,0.5'"
        ) from None
    if len(weights) != count:
        raise ValueError(
            f"reward_weights: {len(weights)} weight(s) for {count} reward function(s); give "
            "one per function, in order, or '' for 1.0 each"
        )
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"reward_weights: {text!r} must be finite numbers")
    return weights


def check_reward_settings(specs: str, weights: str, timeout: float, workers: int) -> None:
    """A stage config's reward-function settings, without loading the functions (the stage
    does, and the pipeline's checks before a run): weights that match, a positive timeout."""
    parse_weights(weights, len(parse_specs(specs)))
    if weights.strip() and not parse_specs(specs):
        raise ValueError(
            f"reward_weights: {weights!r} weighs no reward function; give reward_functions "
            "too, or leave reward_weights ''"
        )
    if not timeout > 0 or workers < 0:
        raise ValueError(
            f"reward_timeout ({timeout}) must be > 0 and reward_workers ({workers}) >= 0"
        )


def load_one(spec: str) -> RewardFn:
    """The function one spec names (built-in, file or module)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if spec.startswith("builtin/") or ":" not in spec:
        raise ValueError(
            f"reward function {spec!r} is not a built-in one ({', '.join(BUILTIN)}); pass one "
            "of those, PATH.py:FUNCTION or MODULE:FUNCTION"
        )
    return function_specs.load_function(spec, KIND)


def function_name(spec: str, fn: RewardFn) -> str:
    """The name a function's metrics carry: TRL's (``__name__``), a built-in's own."""
    if spec in BUILTIN:
        return spec.removeprefix("builtin/").replace("-", "_")
    return getattr(fn, "__name__", None) or spec.rpartition(":")[2]


def load_reward_functions(specs: str, weights: str = "") -> list[RewardFunction]:
    """The weighted functions ``reward_functions`` and ``reward_weights`` name, loaded."""
    names = parse_specs(specs)
    loaded = [load_one(spec) for spec in names]
    scaled = parse_weights(weights, len(names))
    functions = [
        RewardFunction(spec, function_name(spec, fn), weight, fn)
        for spec, fn, weight in zip(names, loaded, scaled, strict=True)
    ]
    seen: dict[str, str] = {}
    for f in functions:
        if f.name in seen:
            raise ValueError(
                f"reward_functions: {seen[f.name]!r} and {f.spec!r} are both named {f.name!r} "
                "in the metrics; rename one of the functions"
            )
        seen[f.name] = f.spec
    return functions


def validate_reward_functions(specs: str, weights: str = "") -> None:
    """Raise ValueError when the specs or weights name no loadable functions ('' is fine)."""
    load_reward_functions(specs, weights)
