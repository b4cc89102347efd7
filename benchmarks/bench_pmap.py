"""Train-step throughput: pmap over 8 CPU devices vs 1 device, same global batch (demo model).

Both steps are built by ``parallel.make_train_step`` in one process (8 virtual CPU
devices; the 1-device step is pmapped over the first only), on the demo-preset
Transformer with a next-token loss, and timed alternately so drift hits both alike.
Each prints its model FLOP/s (6·N·tokens with attention and the output projection at
every predicting position, benchmarks/_roofline.py) as a fraction of the matmul peak
measured at the start of the same run.

    python benchmarks/bench_pmap.py [--batch 32] [--seq-len 128] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import _roofline  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from components.core.model.transformer import Transformer, model_config  # noqa: E402
from components.core.training import parallel  # noqa: E402
from components.core.training.optim import OptimConfig  # noqa: E402

VOCAB = 512


def sft_loss_fn(graphdef: nnx.GraphDef):
    """Masked next-token negative log-likelihood, as the sft stage computes it."""

    def loss_fn(params, batch, rng):
        del rng
        model = nnx.merge(graphdef, params)
        logprobs = model.token_logprobs(batch["tokens"], batch["mask"])
        weights = batch["mask"][:, 1:].astype(jnp.float32)
        return -(logprobs * weights).sum() / jnp.maximum(weights.sum(), 1.0), {}

    return loss_fn


def main() -> None:
    """Time both steps and print steps/s, tokens/s and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    args = parser.parse_args()

    peak = _roofline.measure_peak()
    print(_roofline.describe(peak))
    config = model_config(args.preset, VOCAB)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    optimizer = OptimConfig(learning_rate=1e-4, warmup_steps=0, total_steps=100)
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(3, VOCAB, (args.batch, args.seq_len)).astype(np.int32),
        "mask": np.ones((args.batch, args.seq_len), bool),
    }
    variants = {}
    for devices in (jax.local_devices()[:1], jax.local_devices()):
        step = parallel.make_train_step(sft_loss_fn(graphdef), optimizer, devices=devices)
        state = parallel.replicate(parallel.TrainState.create(params, optimizer), devices)
        variants[len(devices)] = [step, state, parallel.shard_batch(batch, devices)]
    key = jax.random.PRNGKey(0)
    times: dict[int, list[float]] = {count: [] for count in variants}
    for repeat in range(args.steps + 2):  # the first two: compilation and warm-up
        for count, variant in variants.items():
            step, state, sharded = variant
            start = time.perf_counter()
            state, metrics = step(state, sharded, key)
            jax.block_until_ready(metrics["loss"])
            variant[1] = state
            if repeat >= 2:
                times[count].append(time.perf_counter() - start)
    tokens = args.batch * args.seq_len
    # The loss predicts every position but the last: seq_len - 1 output projections per row.
    flops = _roofline.train_flops(config, args.batch, args.seq_len, args.seq_len - 1)
    print(
        f"preset={args.preset} (remat {config.remat}) global batch={args.batch} x "
        f"{args.seq_len} tokens, "
        f"{len(jax.local_devices())} CPU devices on {os.cpu_count()} cores, "
        f"{flops / 1e9:.1f} GFLOP per step"
    )
    rates = {}
    for count, values in times.items():
        seconds = statistics.median(values)
        rates[count] = 1.0 / seconds
        print(
            f"  {count} device(s): {seconds * 1e3:8.1f} ms/step  {rates[count]:6.2f} steps/s  "
            f"{tokens * rates[count]:9.0f} tokens/s  "
            f"{_roofline.of_peak(flops, seconds, peak, config.dtype)}"
        )
    print(f"  ratio 8 devices / 1 device: {rates[8] / rates[1]:.2f}x")


if __name__ == "__main__":
    main()
