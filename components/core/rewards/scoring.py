"""Scoring a batch of completions with reward functions, on the host.

Each function is called with TRL's keyword arguments (``functions.py``); its output must be
one value per completion, each a finite number or None. The batch's reward is TRL's: the
weighted sum over the functions that judged a completion (``nansum``), NaN where none did
(TRL's "unscorable": no learning signal; the caller zeroes its advantage). What a function
gets wrong fails with a ``RewardFunctionError`` naming the function, one offending prompt and
the traceback: an exception (the prompt found by calling it on one completion at a time),
the wrong length, a non-number, NaN or infinity.

``workers`` > 0 runs the functions in that many spawned processes (a JAX process must not
fork), each loading the functions from their specs; a function's batch is split into one
contiguous chunk per worker, and each call must return within ``timeout`` seconds, else the
pool is stopped and the error names the function and the timeout. ``workers`` 0 calls them
in this process (no timeout: a Python call cannot be interrupted safely).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import multiprocessing
import numbers
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from components.core.rewards.functions import RewardFunction, load_reward_functions

_SHOWN_CHARS = 200


class RewardFunctionError(RuntimeError):
    """A reward function that failed or returned what cannot be a reward; the message names
    the function, one offending prompt and what went wrong (with its traceback)."""


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "…")


def weighted_total(per_function: Any, weights: Sequence[float], xp: Any = np) -> Any:
    """TRL's reward of each completion [N]: the weighted sum over the functions that judged
    it (``per_function`` [N, F], NaN = not judged: ``nansum``), NaN where none did. ``xp``:
    numpy on the host, jax.numpy on the devices (the RL stage's rollouts)."""
    judged = ~xp.isnan(per_function)
    total = xp.sum(xp.where(judged, per_function * xp.asarray(weights), 0.0), axis=1)
    return xp.where(xp.any(judged, axis=1), total, xp.nan)


@dataclasses.dataclass
class RewardBatch:
    """The functions' rewards of one batch: per function [N, F] (NaN = not judged), their
    weights, and the host seconds scoring took. The RL stage's figures of them (TRL's
    ``rewards/<name>/mean`` and ``/std``) are computed over every host, on the devices
    (``components/ppo/rollout.function_stats``)."""

    per_function: np.ndarray
    weights: tuple[float, ...]
    seconds: float

    @property
    def total(self) -> np.ndarray:
        """:func:`weighted_total` of the batch."""
        return weighted_total(self.per_function, self.weights)


def _rows(kwargs: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    """The per-completion arguments of rows [start, stop); scalars as they are."""
    return {
        key: (value[start:stop] if isinstance(value, list | tuple) else value)
        for key, value in kwargs.items()
    }


def check_output(
    function: RewardFunction, output: Any, kwargs: Mapping[str, Any], count: int
) -> np.ndarray:
    """The output as float64 [count] (None → NaN), or a RewardFunctionError naming why."""
    prompts = kwargs["prompts"]

    def fail(index: int, what: str) -> RewardFunctionError:
        return RewardFunctionError(
            f"reward function {function.name!r} ({function.spec}) {what}, on prompt "
            f"{_short(prompts[index])} and completion {_short(kwargs['completions'][index])}; "
            "fix the function (it must return one finite float, or None for not judged, per "
            "completion)"
        )

    if isinstance(output, str | bytes) or not isinstance(output, Sequence | np.ndarray):
        raise fail(0, f"returned a {type(output).__name__}, not a list")
    if len(output) != count:
        raise fail(0, f"returned {len(output)} rewards for {count} completions")
    values = np.full(count, np.nan)
    for i, value in enumerate(output):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise fail(i, f"returned {value!r} (a {type(value).__name__}), not a number")
        if not math.isfinite(float(value)):
            raise fail(i, f"returned {value!r}")
        values[i] = float(value)
    return values


def _raised(function: RewardFunction, kwargs: Mapping[str, Any], error: str, index: int):
    prompt = _short(kwargs["prompts"][index]) if kwargs["prompts"] else "(none)"
    return RewardFunctionError(
        f"reward function {function.name!r} ({function.spec}) raised on prompt {prompt}; fix "
        f"the function. Its traceback:\n{error}"
    )


# The functions a pool worker loaded (by spec, in its initializer).
_WORKER_FUNCTIONS: list[RewardFunction] = []


def _load_in_worker(specs: str, weights: str) -> None:
    _WORKER_FUNCTIONS[:] = load_reward_functions(specs, weights)


def _call_in_worker(index: int, kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    """(output, None), or (None, the traceback) when the function raised."""
    try:
        return _WORKER_FUNCTIONS[index].fn(**kwargs), None
    except Exception:
        return None, traceback.format_exc()


class RewardScorer:
    """Scores batches with ``functions`` (module docstring: in process, or a spawned pool)."""

    def __init__(
        self, functions: Sequence[RewardFunction], *, workers: int = 0, timeout: float = 60.0
    ) -> None:
        if workers < 0 or timeout <= 0:
            raise ValueError(f"reward workers {workers} must be >= 0, timeout {timeout} > 0")
        self.functions = list(functions)
        self.workers, self.timeout = workers, timeout
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        if workers and self.functions:
            specs = ",".join(f.spec for f in self.functions)
            weights = ",".join(repr(f.weight) for f in self.functions)
            self._pool = concurrent.futures.ProcessPoolExecutor(
                workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_load_in_worker,
                initargs=(specs, weights),
            )

    def score(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: Mapping[str, Sequence[Any]] | None = None,
        *,
        completion_ids: Sequence[Sequence[int]] | None = None,
        max_completion_length: int | None = None,
    ) -> RewardBatch:
        """Every function's rewards of one batch, and their weighted total."""
        started = time.monotonic()
        count = len(completions)
        kwargs: dict[str, Any] = {
            **{k: list(v) for k, v in (columns or {}).items()},
            "prompts": list(prompts),
            "completions": list(completions),
            "completion_ids": None if completion_ids is None else [list(c) for c in completion_ids],
            "max_completion_length": max_completion_length,
        }
        per_function = np.full((count, len(self.functions)), np.nan)
        for i, function in enumerate(self.functions):
            output = self._call(i, function, kwargs, count)
            per_function[:, i] = check_output(function, output, kwargs, count)
        weights = tuple(f.weight for f in self.functions)
        return RewardBatch(per_function, weights, time.monotonic() - started)

    def _call(self, index: int, function: RewardFunction, kwargs: dict, count: int) -> Any:
        if self._pool is None:
            try:
                return function.fn(**kwargs)
            except Exception:
                where = self._first_raising(function, kwargs, count)
                raise _raised(function, kwargs, traceback.format_exc(), where) from None
        split = np.array_split(np.arange(count), min(self.workers, max(count, 1)))
        chunks = [c for c in split if len(c)]
        futures = [
            self._pool.submit(_call_in_worker, index, _rows(kwargs, int(c[0]), int(c[-1]) + 1))
            for c in chunks
        ]
        output: list[Any] = []
        for chunk, future in zip(chunks, futures, strict=True):
            try:
                part, error = future.result(timeout=self.timeout)
            except concurrent.futures.TimeoutError:
                self._stop_pool()
                raise RewardFunctionError(
                    f"reward function {function.name!r} ({function.spec}) took longer than "
                    f"{self.timeout:g} s on {len(chunk)} completion(s), from prompt "
                    f"{_short(kwargs['prompts'][int(chunk[0])])}; make it faster or raise "
                    "reward_timeout"
                ) from None
            if error is not None:
                raise _raised(function, kwargs, error, int(chunk[0]))
            if isinstance(part, Sequence) and not isinstance(part, str | bytes):
                output.extend(part)
            else:
                output.append(part)  # check_output names what it was
        return output

    @staticmethod
    def _first_raising(function: RewardFunction, kwargs: dict, count: int) -> int:
        """The first completion the function raises on alone (0 when none does)."""
        for i in range(count):
            try:
                function.fn(**_rows(kwargs, i, i + 1))
            except Exception:
                return i
        return 0

    def _stop_pool(self) -> None:
        if self._pool is None:
            return
        for process in list(getattr(self._pool, "_processes", {}).values()):
            process.terminate()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
