"""Greedy generation with a KV cache vs recomputing the whole sequence each step (demo model).

The no-cache reference runs a full forward pass over its fixed [B, P + N] buffer each step
(one compilation; not-yet-generated slots are masked), so its per-step cost is that of the
final sequence length.

    python benchmarks/bench_sampler.py [--batch 8] [--prompt-len 64] [--new-tokens 128]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from _timing import interleaved_median_seconds
from flax import nnx

from components.core.model import Transformer, model_config
from components.core.sampler import generate, generate_without_cache

VOCAB = 512
PAD_ID = 0
EOS_ID = VOCAB  # outside the vocabulary: every sequence runs the full length


def main() -> None:
    """Time both samplers side by side and print tokens/s and the speed-up."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = model_config("demo", VOCAB)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    shape = (args.batch, args.prompt_len)
    tokens = jax.random.randint(jax.random.key(0), shape, 1, VOCAB, dtype=jnp.int32)
    lengths = jax.random.randint(jax.random.key(1), (args.batch, 1), 1, args.prompt_len + 1)
    mask = (jnp.arange(args.prompt_len)[None] >= args.prompt_len - lengths).astype(jnp.int32)
    settings = dict(max_new_tokens=args.new_tokens, eos_id=EOS_ID, pad_id=PAD_ID)

    @jax.jit
    def with_cache(params, tokens, mask):
        return generate(
            (graphdef, params), tokens, mask, jax.random.key(0), temperature=0.0, **settings
        )

    @jax.jit
    def without_cache(params, tokens, mask):
        return generate_without_cache((graphdef, params), tokens, mask, **settings)

    same = np.array_equal(
        with_cache(params, tokens, mask).tokens, without_cache(params, tokens, mask).tokens
    )
    seconds = interleaved_median_seconds(
        {"kv cache": with_cache, "no cache": without_cache},
        params, tokens, mask, warmup=1, repeats=args.repeats,
    )  # fmt: skip
    generated = args.batch * args.new_tokens
    print(f"demo preset: {config.n_layers} layers, dim {config.dim}, fp32 on {jax.devices()[0]}")
    print(
        f"greedy, batch {args.batch}, left-padded prompts of {args.prompt_len}, "
        f"{args.new_tokens} new tokens; identical tokens: {same}"
    )
    for name, value in seconds.items():
        print(f"  {name:<9} {value:7.3f} s   {generated / value:9.1f} tokens/s")
    print(f"kv cache speed-up: {seconds['no cache'] / seconds['kv cache']:.1f}x")


if __name__ == "__main__":
    main()
