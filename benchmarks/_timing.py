"""Shared measuring helpers for the benchmark scripts: wall time and compiled memory."""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
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


# XLA:CPU names each thunk of a trace after its HLO instruction ("ynn_fusion.14", "dot.130",
# "copy_bitcast_fusion.7"); Python frames, executors and waits have other names.
_HLO_NAME = re.compile(r"^([a-z][a-z0-9_-]*?)(\.\d+)?$")
_CONTAINERS = ("while", "conditional", "call")  # their time is their bodies' thunks'
THUNK_KINDS = (
    ("matmuls", ("ynn_fusion", "dot", "convolution", "custom-call")),
    ("copies and transposes", ("copy", "transpose")),
    ("collectives", ("psum", "pmax", "pmin", "all-reduce", "all-gather", "reduce-scatter")),
)


def thunk_kind(name: str) -> str | None:
    """The kind of an XLA:CPU thunk by its HLO name; None for anything else in a trace."""
    match = _HLO_NAME.match(name)
    if match is None or match.group(1) in _CONTAINERS:
        return None
    for kind, prefixes in THUNK_KINDS:
        if match.group(1).startswith(prefixes):
            return kind
    return "elementwise and other fusions"


def thunk_shares(fn: Callable[[], Any], calls: int = 3) -> dict[str, float]:
    """Share of the time XLA:CPU's thunks ran, by kind, over ``calls`` calls of ``fn`` (after a
    warm-up call), from a ``jax.profiler`` trace; largest first."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        for _ in range(calls):
            jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as handle:
            events = json.load(handle)["traceEvents"]
    spent: collections.Counter[str] = collections.Counter()
    for event in events:
        kind = thunk_kind(event.get("name", "")) if event.get("ph") == "X" else None
        if kind is not None:
            spent[kind] += event["dur"]
    total = sum(spent.values())
    return {kind: value / total for kind, value in spent.most_common()}


def print_thunk_shares(fn: Callable[[], Any], what: str, calls: int = 3) -> None:
    """Print :func:`thunk_shares` of ``fn``: where ``what`` spends its time."""
    print(f"  {what} by kind of XLA:CPU thunk (jax profiler, {calls} calls):")
    for kind, share in thunk_shares(fn, calls).items():
        print(f"    {kind:<30} {share:6.1%}")


def mib(n_bytes: float) -> str:
    """Bytes as a MiB figure for printing."""
    return f"{n_bytes / 2**20:,.1f} MiB"
