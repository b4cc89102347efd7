"""Shared measuring helpers for the benchmark scripts: wall time and compiled memory."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def wall_times(fn: Callable[..., Any], *args: Any, warmup: int, repeats: int) -> list[float]:
    """Wall times of ``repeats`` calls of ``fn(*args)`` after ``warmup`` calls (compilation
    excluded)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn: Callable[..., Any], *args: Any, warmup: int = 2, repeats: int = 5) -> float:
    """Median wall time of ``fn(*args)`` after ``warmup`` calls (compilation excluded)."""
    return statistics.median(wall_times(fn, *args, warmup=warmup, repeats=repeats))


def interleaved_median_seconds(
    fns: dict[str, Callable[..., Any]], *args: Any, warmup: int = 2, repeats: int = 5
) -> dict[str, float]:
    """Median wall time of each ``fn(*args)``, timed round-robin so drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def compiled_temp_bytes(fn: Callable[..., Any], *args: Any, **jit_kwargs: Any) -> int:
    """XLA's temporary-buffer size for ``jax.jit(fn)`` compiled on ``args`` (activations etc.)."""
    compiled = jax.jit(fn, **jit_kwargs).lower(*args).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def mib(n_bytes: float) -> str:
    """Bytes as a MiB figure for printing."""
    return f"{n_bytes / 2**20:,.1f} MiB"
