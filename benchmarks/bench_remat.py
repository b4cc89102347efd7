"""Remat vs no remat on a reward-model train step: compiled temp memory and step time.

The step is the reward stage's: Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) of the
scalar head, value_and_grad, one optax AdamW update. Demo preset, sequence length 512.
Targets: temp memory with remat <= 0.5x, step time with remat <= 1.4x. Each step's model
FLOP/s (6·N·tokens with attention, no output projection: the scalar head reads the last
token; benchmarks/_roofline.py) is printed as a fraction of the matmul peak measured at the
start of the same run; remat's recomputation is not counted, so it shows as a lower fraction.

    python benchmarks/bench_remat.py [--pairs 8] [--seq-len 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses

import _roofline
import jax
import jax.numpy as jnp
import optax
from _timing import compiled_temp_bytes, interleaved_median_seconds, mib
from flax import nnx

from components.core.model.transformer import Transformer, model_config

VOCAB = 512


def make_train_step(config, tx: optax.GradientTransformation):
    """A pure reward train step (params, opt_state, batch) -> (params, opt_state, loss)."""
    graphdef = nnx.graphdef(
        nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), scalar_head=True))
    )

    def train_step(params, opt_state, tokens, mask):
        def loss_fn(params):
            model = nnx.merge(graphdef, params)
            rewards = model.scalar(model(tokens, mask), mask)
            chosen, rejected = jnp.split(rewards, 2)
            return -jnp.mean(jax.nn.log_sigmoid(chosen - rejected))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def main() -> None:
    """Measure and print temp memory and step time for each remat policy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    peak = _roofline.measure_peak()
    print(_roofline.describe(peak))
    base = model_config("demo", VOCAB)
    params = nnx.split(Transformer(base, rngs=nnx.Rngs(0), scalar_head=True), nnx.Param)[1]
    tx = optax.adamw(1e-4)
    opt_state = tx.init(params)
    # Chosen rows first, then rejected; random lengths so padding is exercised.
    shape = (2 * args.pairs, args.seq_len)
    tokens = jax.random.randint(jax.random.key(0), shape, 1, VOCAB, dtype=jnp.int32)
    lengths = jax.random.randint(jax.random.key(1), (shape[0], 1), args.seq_len // 2, args.seq_len)
    mask = (jnp.arange(args.seq_len)[None] < lengths).astype(jnp.int32)
    batch = (params, opt_state, tokens, mask)

    print(
        f"demo preset: {base.n_layers} layers, dim {base.dim}, fp32 compute on {jax.devices()[0]}"
    )
    print(f"reward train step on {args.pairs} pairs x {args.seq_len} tokens")
    policies = ("none", "full", "dots_saveable")
    steps = {p: make_train_step(dataclasses.replace(base, remat=p), tx) for p in policies}
    temps = {p: compiled_temp_bytes(step, *batch) for p, step in steps.items()}
    jitted = {p: jax.jit(step) for p, step in steps.items()}
    seconds = interleaved_median_seconds(jitted, *batch, repeats=args.repeats)
    results = {p: (temps[p], seconds[p]) for p in policies}
    flops = _roofline.train_flops(base, 2 * args.pairs, args.seq_len)
    for policy, (temp, step_s) in results.items():
        print(
            f"  remat={policy:<14} temp {mib(temp):>12}   step {step_s * 1e3:8.1f} ms  "
            f"{_roofline.of_peak(flops, step_s, peak, base.dtype)}"
        )

    none_temp, none_time = results["none"]
    for policy in ("full", "dots_saveable"):
        temp, seconds = results[policy]
        print(
            f"remat={policy} vs none: memory {temp / none_temp:.2f}x (target <= 0.5x), "
            f"time {seconds / none_time:.2f}x (target <= 1.4x)"
        )


if __name__ == "__main__":
    main()
