"""Logits a tile at a time against whole logits, side by side: XLA's memory and CPU time.

Two programs of PPO at a real vocabulary (151,936, Qwen2.5's) on a small network (so the
vocabulary dominates, as it does for the 0.5B model):

- **rollout scoring**: ``scoring.response_stats`` with the reference, what the rollout
  calls (policy and reference log-probs, exact KL), forward only;
- **update**: the gradient of the policy's terms the update differentiates (the log-probs
  times advantages, plus the entropy bonus), through ``ppo.update._policy_terms``.

Memory: ``jit(...).lower(...).compile().memory_analysis()`` temp bytes (compiled only, never
run) at the ``v5e-8-0.5b`` preset's shapes per chip: 8 rows of 512 + 512 tokens scored, a
minibatch of 2 rows updated. Time: the median of ``--repeats`` alternating runs (A B A B…)
at ``--time-rows`` rows of ``--time-len`` + ``--time-len`` tokens on this CPU.
Targets (issue 49): temp bytes tiled ≤ 0.35× whole, time ≤ 1.1×.

    python benchmarks/bench_vocab_tiles.py [--repeats 7] [--time-rows 2] [--time-len 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from components.core.model.artifact import create_model
from components.core.model.scoring import response_stats
from components.ppo import PPOConfig
from components.ppo.rollout import Models
from components.ppo.update import _policy_terms

VOCAB = 151_936
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=2048)
WHOLE, TILED = 0, 2**24


def batch_of(rows: int, length: int, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    ones = np.ones((rows, length), np.int32)
    return {
        "prompt_tokens": jnp.asarray(rng.integers(0, VOCAB, (rows, length)), jnp.int32),
        "prompt_mask": jnp.asarray(ones),
        "response_tokens": jnp.asarray(rng.integers(0, VOCAB, (rows, length)), jnp.int32),
        "response_mask": jnp.asarray(ones),
        "advantages": jnp.asarray(rng.normal(size=(rows, length)), jnp.float32),
    }


def programs(tile: int):
    """(scoring, update) jitted for networks whose logits tile is ``tile``."""
    make = dict(scalar_head=False, logits_tile=tile, **SMALL)
    policy = create_model("tiny", VOCAB, seed=1, **make)
    graph, params = nnx.split(policy, nnx.Param)
    reference = nnx.split(create_model("tiny", VOCAB, seed=2, **make), nnx.Param)[1]
    models = Models(graph, None, None)
    config = dataclasses.replace(PPOConfig(), entropy_coef=0.01)

    @jax.jit
    def scoring(params, reference, batch):
        stats = response_stats(graph, params, batch, reference=reference)
        return stats.logprobs, stats.ref_logprobs, stats.kl

    @jax.jit
    def update(params, batch):
        def loss(p):
            logprobs, entropy = _policy_terms(p, batch, models, config)
            return -jnp.mean(logprobs * batch["advantages"]) - 0.01 * entropy

        return jax.grad(loss)(params)

    return params, reference, scoring, update


def temp_bytes(jitted, *args) -> int:
    return jitted.lower(*args).compile().memory_analysis().temp_size_in_bytes


def timed(fn, *args) -> float:
    started = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--time-rows", type=int, default=2)
    parser.add_argument("--time-len", type=int, default=128)
    args = parser.parse_args()
    built = {tile: programs(tile) for tile in (WHOLE, TILED)}
    score_batch, update_batch = batch_of(8, 512), batch_of(2, 512)
    print(f"vocab {VOCAB}, logits tile {TILED} elements ({TILED // VOCAB} positions)")
    header = f"{'program (v5e-8-0.5b shapes per chip)':<44}{'whole MiB':>11}{'tiled MiB':>11}"
    print(f"{header}{'ratio':>8}")
    for name, index, batch in (("rollout scoring, 8 × (512 + 512)", 2, score_batch),
                               ("update gradient, 2 × (512 + 512)", 3, update_batch)):  # fmt: skip
        sizes = []
        for tile in (WHOLE, TILED):
            params, reference, scoring, update = built[tile]
            args_ = (params, reference, batch) if index == 2 else (params, batch)
            sizes.append(temp_bytes(built[tile][index], *args_))
        ratio = sizes[1] / sizes[0]
        print(f"{name:<44}{sizes[0] / 2**20:>11.1f}{sizes[1] / 2**20:>11.1f}{ratio:>7.3f}x")
    rows, length = args.time_rows, args.time_len
    small = batch_of(rows, length, seed=1)
    times = {(tile, part): [] for tile in (WHOLE, TILED) for part in ("scoring", "update")}
    for tile in (WHOLE, TILED):  # compile and warm up
        params, reference, scoring, update = built[tile]
        for _ in range(2):
            timed(scoring, params, reference, small)
            timed(update, params, small)
    for _ in range(args.repeats):
        for tile in (WHOLE, TILED):
            params, reference, scoring, update = built[tile]
            times[tile, "scoring"].append(timed(scoring, params, reference, small))
            times[tile, "update"].append(timed(update, params, small))
    print(f"CPU time, {rows} × ({length} + {length}) tokens, median of {args.repeats}:")
    for part in ("scoring", "update"):
        whole = statistics.median(times[WHOLE, part])
        tiled = statistics.median(times[TILED, part])
        print(f"  {part:<8} whole {whole * 1e3:8.1f} ms  tiled {tiled * 1e3:8.1f} ms  "
              f"{tiled / whole:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
