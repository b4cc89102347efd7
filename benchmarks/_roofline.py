"""Roofline figures for the benchmarks: this machine's peaks, measured in the same run, and
the model FLOPs and bytes a step needs, so each benchmark can print its fraction of peak.

Peaks are measured, never looked up, on whatever backend JAX runs (CPU, GPU, TPU), with
XLA's default matmul precision, as the models run:

* matmul FLOP/s, per dtype: ``a @ b`` of square matrices pmapped over the devices, from
  512 doubling until one call takes ``MIN_CALL_SECONDS``; the fastest call of any size
  after a warm-up, 2·n³ FLOPs per product per device;
* memory bandwidth: a 1 GiB float32 stream split over the devices (twice the 480 MiB L3
  of the development machines, far above a GPU's L2), the best of a sum (bytes read) and
  an in-place scale (bytes read + written, the buffer donated).

On CPU the peaks are one device's (virtual CPU devices share the host's cores, and one
device's program already uses them all); on accelerators, all devices' together.

Model FLOPs (PaLM, Chowdhery et al. 2022, appendix B): a forward pass costs 2·N·tokens,
N the weights its matmuls use (every block's q, k, v, o and MLP projections, plus the
output projection [dim, vocab] at the positions whose logits are computed; embedding
lookups, norms and biases are not counted), plus attention 4·L·H·Hd·S per token (QKᵀ and
AV over the S keys each query is computed against: the whole padded sequence, masked, or
the whole KV cache in a decode step). A training step is 3× its forward pass (the
backward costs two): 6·N·tokens + 12·L·H·Hd·S·tokens. Remat's recomputation is not
counted: these are model FLOPs, not hardware FLOPs, so remat shows as a lower fraction.

Decode bytes per step: every parameter as stored (float32) plus the whole KV cache the
step attends over (2 · L · B · S · Kv · Hd in the compute dtype), each read once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from _timing import wall_times

from components.core.model.config import ModelConfig

MIN_CALL_SECONDS = 0.05  # the largest matmul takes this long: launch overhead is negligible
MAX_BYTES = 2**32  # a, b and a @ b over all devices stay under this
SECONDS_PER_SIZE = 0.5  # short matmuls are repeated for about this long
MAX_REPEATS = 400
STREAM_BYTES = 2**30  # the bandwidth stream, over all devices together
REPEATS = 5
DTYPES = ("float32", "bfloat16")


class Peak(NamedTuple):
    """This machine's measured peaks over a set of devices."""

    matmul: dict[str, float]  # dtype name -> FLOP/s
    bandwidth: float  # bytes/s
    devices: str  # e.g. "cpu, 2 cores"
    seconds: float  # spent measuring
    load: float  # the host's 1-minute load average then: other work sharing the machine


def best_seconds(fn: Callable[..., Any], *args: Any, repeats: int = REPEATS) -> float:
    """Fastest wall time of ``fn(*args)`` after one warm-up call (compilation excluded)."""
    return min(wall_times(fn, *args, warmup=1, repeats=repeats))


def _per_device(devices: Sequence[jax.Device], shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A [devices, *shape] array of 0.5s whose row i lives on device i (a pmap input); dense
    kernels do not look at the values, and filling in place is quicker than drawing them."""
    mesh = jax.sharding.Mesh(np.array(list(devices)), ("devices",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("devices"))
    fill = jax.jit(lambda: jnp.full((len(devices), *shape), 0.5, dtype), out_shardings=sharding)
    return fill()


def _repeats(first_call_seconds: float) -> int:
    """How many timed calls: more for short ones (``SECONDS_PER_SIZE`` in all), at least
    ``REPEATS``: on a machine shared with other work, the fastest call ran alone."""
    return max(REPEATS, min(MAX_REPEATS, int(SECONDS_PER_SIZE / max(first_call_seconds, 1e-6))))


def matmul_flops(dtype: str, devices: Sequence[jax.Device]) -> float:
    """Best FLOP/s of square ``a @ b`` in ``dtype`` on every device of ``devices`` at once,
    over sizes from 512 doubling until a call takes ``MIN_CALL_SECONDS``."""
    matmul = jax.pmap(jnp.matmul, devices=list(devices))
    itemsize = jnp.dtype(dtype).itemsize
    best, n = 0.0, 512
    while True:
        a = _per_device(devices, (n, n), dtype)
        b = _per_device(devices, (n, n), dtype)
        first = best_seconds(matmul, a, b, repeats=1)
        seconds = min(first, best_seconds(matmul, a, b, repeats=_repeats(first)))
        best = max(best, 2 * n**3 * len(devices) / seconds)
        if first >= MIN_CALL_SECONDS or 3 * len(devices) * (2 * n) ** 2 * itemsize > MAX_BYTES:
            return best
        n *= 2


def bandwidth(devices: Sequence[jax.Device], total_bytes: int = STREAM_BYTES) -> float:
    """Best bytes/s of streaming ``total_bytes`` of float32 over ``devices``: a sum (read) or
    an in-place scale (read + write)."""
    x = _per_device(devices, (total_bytes // 4 // len(devices),), jnp.float32)
    total = jax.pmap(jnp.sum, devices=list(devices))
    first = best_seconds(total, x, repeats=1)
    read = total_bytes / best_seconds(total, x, repeats=_repeats(first))
    scale = jax.pmap(lambda v: v * 1.0001, devices=list(devices), donate_argnums=0)
    times = []
    for _ in range(1 + _repeats(total_bytes / read)):  # the first call compiles
        start = time.perf_counter()
        x = jax.block_until_ready(scale(x))
        times.append(time.perf_counter() - start)
    return max(read, 2 * total_bytes / min(times[1:]))


def one_core_bandwidth(core: int = 0) -> float | None:
    """:func:`bandwidth` of one device in a child process pinned to one core (Linux; None
    elsewhere): what a program streams when it runs its operations one after another, each
    on one thread, as XLA:CPU runs a decode step's small matmuls."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        f"import os, sys; os.sched_setaffinity(0, {{{core}}}); sys.path.insert(0, {here!r}); "
        "import jax, _roofline; print(_roofline.bandwidth(jax.local_devices()[:1]))"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"the one-core bandwidth child failed:\n{run.stderr[-2000:]}")
    return float(run.stdout.split()[-1])


def measure_peak(
    devices: Sequence[jax.Device] | None = None, dtypes: Sequence[str] = DTYPES
) -> Peak:
    """Matmul FLOP/s per dtype and memory bandwidth of ``devices`` (default: every local one).

    CPU "devices" are one host's cores, which one device's program already uses (measured:
    a matmul pmapped over 8 CPU devices ran slower than on one), so CPU peaks are measured
    on one device; accelerators' on all of them together.
    """
    devices = list(devices or jax.local_devices())
    start = time.perf_counter()
    platform = devices[0].platform
    if platform == "cpu":
        devices, label = devices[:1], f"cpu, {os.cpu_count()} cores"
    else:
        label = f"{len(devices)} {platform} device{'s' if len(devices) > 1 else ''}"
    matmul = {dtype: matmul_flops(dtype, devices) for dtype in dtypes}
    stream = bandwidth(devices)
    return Peak(matmul, stream, label, time.perf_counter() - start, os.getloadavg()[0])


def weight_matmuls(config: ModelConfig, tokens: int, logits_tokens: int = 0) -> list[tuple]:
    """(m, k, n) of each weight matmul of a forward pass over ``tokens`` tokens: q, k, v, o
    and the gated MLP's three in every layer, and the output projection at ``logits_tokens``
    positions (attention's own products are left out: they hold no weights)."""
    d, hidden, hd = config.dim, config.hidden_dim, config.resolved_head_dim
    q, kv = config.n_heads * hd, config.n_kv_heads * hd
    layer = [(d, q), (d, kv), (d, kv), (q, d), (d, hidden), (d, hidden), (hidden, d)]
    shapes = [(tokens, k, n) for k, n in layer] * config.n_layers
    return shapes + ([(logits_tokens, d, config.vocab_size)] if logits_tokens else [])


# What with_backward's three products of each forward one are, in its order.
PRODUCT_KINDS = ("forward", "input gradients", "weight gradients")


def with_backward(forward: list[tuple]) -> list[tuple]:
    """A training step's matmuls: each forward [m, k] @ [k, n], the input's gradient
    [m, n] @ [n, k] and the weight's [k, m] @ [m, n], every operand laid out as it is used."""
    return [shape for m, k, n in forward for shape in ((m, k, n), (m, n, k), (k, m, n))]


def shape_ceiling(shapes: list[tuple], dtype: str = "float32") -> float:
    """FLOP/s of exactly ``shapes``' matmuls, with nothing else, in one compiled program on
    one device: the most a step made of them could reach. Small matmuls run far below the
    large-matmul peak; the gap between this and a step's rate is everything else it does
    (elementwise work, transposes, collectives, the loop)."""
    device = jax.local_devices()[0]
    operands = [(jnp.full((m, k), 0.5, dtype), jnp.full((k, n), 0.5, dtype)) for m, k, n in shapes]
    operands = jax.device_put(operands, device)
    run = jax.jit(lambda pairs: [a @ b for a, b in pairs])
    first = best_seconds(run, operands, repeats=1)
    seconds = min(first, best_seconds(run, operands, repeats=_repeats(first)))
    return sum(2 * m * k * n for m, k, n in shapes) / seconds


def describe(peak: Peak) -> str:
    """The peaks, with how long measuring took and the load the machine was under."""
    flops = ", ".join(f"{dtype} {rate / 1e9:,.1f} GFLOP/s" for dtype, rate in peak.matmul.items())
    return (
        f"peak of this machine ({peak.devices}; measured in this run, {peak.seconds:.0f} s, "
        f"load average {peak.load:.1f}): matmul {flops}; "
        f"memory bandwidth {peak.bandwidth / 1e9:,.1f} GB/s"
    )


def of_peak(flops: float, seconds: float, peak: Peak, dtype: str = "float32") -> str:
    """``flops`` done in ``seconds`` as GFLOP/s and the fraction of the ``dtype`` matmul peak."""
    rate = flops / seconds
    return f"{rate / 1e9:7.1f} GFLOP/s = {rate / peak.matmul[dtype]:6.1%} of {dtype} peak"


def of_bandwidth(n_bytes: float, seconds: float, peak: Peak) -> str:
    """``n_bytes`` moved in ``seconds`` as GB/s and the fraction of the measured bandwidth."""
    rate = n_bytes / seconds
    return f"{rate / 1e9:7.2f} GB/s = {rate / peak.bandwidth:6.1%} of memory bandwidth"


# --- model FLOPs and bytes ------------------------------------------------------------------


def block_weights(config: ModelConfig) -> int:
    """Matmul weights of the layer stack: q, k, v, o and the gated MLP's three, every layer."""
    head_dim = config.resolved_head_dim
    attention = config.dim * head_dim * 2 * (config.n_heads + config.n_kv_heads)
    return config.n_layers * (attention + 3 * config.dim * config.hidden_dim)


def attention_flops(config: ModelConfig, queries: int, keys: int) -> int:
    """QKᵀ and AV of ``queries`` query tokens, each over ``keys`` keys, in every layer."""
    return 4 * config.n_layers * config.n_heads * config.resolved_head_dim * keys * queries


def forward_flops(config: ModelConfig, rows: int, length: int, logits_per_row: int = 0) -> int:
    """Model FLOPs of a forward pass over [rows, length] with ``logits_per_row`` output
    projections per row (0: a scalar head only; its dim FLOPs are not counted)."""
    tokens = rows * length
    head = 2 * config.dim * config.vocab_size * rows * logits_per_row
    return 2 * block_weights(config) * tokens + attention_flops(config, tokens, length) + head


def train_flops(config: ModelConfig, rows: int, length: int, logits_per_row: int = 0) -> int:
    """Model FLOPs of a training step (forward + backward = 3 forward passes)."""
    return 3 * forward_flops(config, rows, length, logits_per_row)


def decode_step_flops(config: ModelConfig, rows: int, cache_slots: int) -> int:
    """Model FLOPs of one decode step: one token per row, attending over the whole cache."""
    head = 2 * config.dim * config.vocab_size * rows
    return 2 * block_weights(config) * rows + attention_flops(config, rows, cache_slots) + head


def generate_flops(
    config: ModelConfig, rows: int, prompt_len: int, max_new_tokens: int, decode_steps: int
) -> int:
    """Model FLOPs of the KV-cache sampler: the prefill (logits at the last prompt position),
    then ``decode_steps`` steps (max_new_tokens - 1 unless every row ended sooner), each
    over the whole cache of prompt_len + max_new_tokens - 1 slots."""
    slots = prompt_len + max_new_tokens - 1
    prefill = forward_flops(config, rows, prompt_len, logits_per_row=1)
    return prefill + decode_steps * decode_step_flops(config, rows, slots)


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of ``tree`` as stored."""
    return sum(int(np.prod(leaf.shape)) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def kv_cache_bytes(config: ModelConfig, rows: int, cache_slots: int) -> int:
    """Bytes of the keys and values of every layer for ``cache_slots`` slots per row."""
    per_slot = 2 * config.n_layers * config.n_kv_heads * config.resolved_head_dim
    return per_slot * rows * cache_slots * jnp.dtype(config.compute_dtype).itemsize


def decode_step_bytes(config: ModelConfig, param_bytes: int, rows: int, cache_slots: int) -> int:
    """Bytes one decode step must read: the parameters and the whole KV cache."""
    return param_bytes + kv_cache_bytes(config, rows, cache_slots)
