"""Greedy decoding with a KV cache: bytes/s against this machine's memory bandwidth, and the
speed-up over recomputing the whole sequence each step.

Decode is memory-bound: each step reads every parameter (float32, as stored) and the whole
KV cache it attends over (benchmarks/_roofline.py). Its time per step is measured as
(generate N tokens − generate 1 token) / (N − 1), so the prefill is left out, and its
bytes/s is compared with the bandwidth measured at the start of the same run (a 1 GiB
stream over both cores), with the same stream pinned to one core, and with a stream the
size of the decode's working set (which sits in the caches on a CPU with a large L3). The
no-cache reference runs a full forward pass over its fixed [B, P + N] buffer each step, so
its per-step cost is that of the final length; it runs at the demo shape only (at 256 new
tokens it would take minutes).

Two settings, each timed side by side within itself:

* one device, ``--batch`` sequences: the sampler as ``jax.jit`` runs it. XLA:CPU runs a
  decode step's small operations one after another, each matmul of 8 rows on one thread,
  so this decode streams at most what one core does;
* the rollout: ``--rollout-batch`` sequences (bench_ppo.py's 32) data-parallel under
  ``jax.pmap`` over every device, as PPO's rollout runs them. Each device runs its own
  program on its own replica of the parameters, so a step reads every device's parameters
  and cache: that many bytes are counted.

``ALIGNPIPE_CPU_DEVICES`` sets the device count: by default one per core. The stages' 8
virtual devices on a 2-core host make XLA:CPU's intra-op thread pool 8 threads (it has at
least one per device), and every program, even one device's, then runs slower.

Shapes (benchmarks/_shapes.py): ``demo`` (the demo preset; 64-token prompts, 128 new
tokens) or ``real`` (twice the width, 64-token prompts, 256 new tokens, as bench_ppo.py).

    python benchmarks/bench_sampler.py [--shape demo|real] [--batch 8] [--rollout-batch 32]
        [--repeats 3] [--profile]
"""

from __future__ import annotations

import argparse
import os

import jax

# Before the backend starts: the CPU device count, by default one per core. XLA:CPU gives
# its intra-op thread pool at least one thread per device, so the stages' 8 virtual devices
# on 2 cores slow even one device's program (module docstring).
CPU_DEVICES = int(os.environ.get("ALIGNPIPE_CPU_DEVICES", os.cpu_count() or 1))
jax.config.update("jax_num_cpu_devices", CPU_DEVICES)

import _roofline  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _shapes import DEMO, REAL, REAL_PROMPT, REAL_RESPONSE  # noqa: E402
from _timing import (  # noqa: E402
    interleaved_median_seconds,
    mib,
    print_thunk_shares,
    wall_times,
)
from flax import nnx  # noqa: E402

from components.core.model.sampler import generate, generate_without_cache  # noqa: E402
from components.core.model.transformer import Transformer, model_config  # noqa: E402
from components.core.training import parallel  # noqa: E402

VOCAB = 512
PAD_ID = 0
EOS_ID = VOCAB  # outside the vocabulary: every sequence runs the full length
SHAPES = {"demo": (DEMO, 64, 128), "real": (REAL, REAL_PROMPT, REAL_RESPONSE)}


def left_padded_prompts(batch: int, prompt_len: int) -> tuple[jax.Array, jax.Array]:
    """Random prompts [B, P] of random lengths, left padded."""
    shape = (batch, prompt_len)
    tokens = jax.random.randint(jax.random.key(0), shape, 1, VOCAB, dtype=jnp.int32)
    lengths = jax.random.randint(jax.random.key(1), (batch, 1), 1, prompt_len + 1)
    return tokens, (jnp.arange(prompt_len)[None] >= prompt_len - lengths).astype(jnp.int32)


def greedy(graphdef, steps: int):
    """The KV-cache sampler, greedy, ``steps`` new tokens: a function of (params, tokens,
    mask) to ``jax.jit`` or ``jax.pmap``."""

    def sample(params, tokens, mask):
        return generate(
            (graphdef, params), tokens, mask, jax.random.key(0), temperature=0.0,
            max_new_tokens=steps, eos_id=EOS_ID, pad_id=PAD_ID,
        )  # fmt: skip

    return sample


def main() -> None:
    """Time the samplers side by side; print tokens/s, decode bytes/s and their fractions."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=8, help="sequences on one device")
    parser.add_argument(
        "--rollout-batch", type=int, default=32, help="sequences over the devices (bench_ppo's)"
    )
    parser.add_argument("--prompt-len", type=int, default=0, help="0: the shape's")
    parser.add_argument("--new-tokens", type=int, default=0, help="0: the shape's")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--profile", action="store_true", help="where the KV-cache sampler spends its time"
    )
    args = parser.parse_args()
    widths, prompt_len, new_tokens = SHAPES[args.shape]
    prompt_len, new_tokens = args.prompt_len or prompt_len, args.new_tokens or new_tokens

    peak = _roofline.measure_peak()
    print(_roofline.describe(peak))
    config = model_config("demo", VOCAB, **widths)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    tokens, mask = left_padded_prompts(args.batch, prompt_len)

    samplers = {
        "kv cache": jax.jit(greedy(graphdef, new_tokens)),
        "prefill + 1": jax.jit(greedy(graphdef, 1)),
    }
    if args.shape == "demo":
        settings = dict(max_new_tokens=new_tokens, eos_id=EOS_ID, pad_id=PAD_ID)
        samplers["no cache"] = jax.jit(
            lambda params, tokens, mask: generate_without_cache(
                (graphdef, params), tokens, mask, **settings
            )
        )
    seconds = interleaved_median_seconds(
        samplers, params, tokens, mask, warmup=1, repeats=args.repeats
    )
    print(
        f"{args.shape} shape: {config.n_layers} layers, dim {config.dim}, {config.dtype} on "
        f"{jax.devices()[0]}; greedy, batch {args.batch}, left-padded prompts of {prompt_len}, "
        f"{new_tokens} new tokens"
    )
    generated = args.batch * new_tokens
    for name in ("kv cache", "no cache"):
        if name in seconds:
            print(f"  {name:<9} {seconds[name]:7.3f} s   {generated / seconds[name]:9.1f} tokens/s")
    if "no cache" in seconds:
        same = np.array_equal(
            samplers["kv cache"](params, tokens, mask).tokens,
            samplers["no cache"](params, tokens, mask).tokens,
        )
        print(f"kv cache speed-up: {seconds['no cache'] / seconds['kv cache']:.1f}x; same: {same}")
    step_s = (seconds["kv cache"] - seconds["prefill + 1"]) / (new_tokens - 1)
    report_decode(config, params, args.batch, (prompt_len, new_tokens), step_s, peak)
    report_rollout_decode(
        config, (graphdef, params), args.rollout_batch, (prompt_len, new_tokens), args.repeats, peak
    )
    if args.profile:
        sample = samplers["kv cache"]
        print_thunk_shares(lambda: sample(params, tokens, mask), "the KV-cache sampler")


def report_decode(config, params, batch: int, lengths: tuple[int, int], step_s: float, peak):
    """Print a decode step's bytes, its bytes/s and the fraction of each bandwidth."""
    prompt_len, new_tokens = lengths
    slots = prompt_len + new_tokens - 1
    param_bytes = _roofline.tree_bytes(params)
    step_bytes = _roofline.decode_step_bytes(config, param_bytes, batch, slots)
    cache_bytes = step_bytes - param_bytes
    print(
        f"decode step {step_s * 1e3:.2f} ms ({batch / step_s:,.0f} tokens/s) reads "
        f"{mib(step_bytes)}: parameters {mib(param_bytes)} + KV cache {mib(cache_bytes)} "
        f"({slots} slots); {mib(step_bytes / batch)} per token"
    )
    print(f"  decode {_roofline.of_bandwidth(step_bytes, step_s, peak)} (1 GiB stream)")
    # The step attends over every slot; on average only prompt + half the response are filled.
    filled = _roofline.decode_step_bytes(config, param_bytes, batch, prompt_len + new_tokens // 2)
    print(
        f"  counting only the filled slots (mean {mib(filled)} a step): "
        f"{_roofline.of_bandwidth(filled, step_s, peak)}"
    )
    # The largest weight matmul of a step alone: the rate the decode's matmuls can reach.
    lone = jax.jit(jnp.matmul)
    rows, weight = jnp.ones((batch, config.dim)), jnp.ones((config.dim, config.hidden_dim))
    lone_s = min(wall_times(lone, rows, weight, warmup=2, repeats=200))
    print(
        f"  a lone [{batch}, {config.dim}] @ [{config.dim}, {config.hidden_dim}] matmul: "
        f"{_roofline.of_bandwidth(weight.nbytes, lone_s, peak)} (weights read)"
    )
    one_core = _roofline.one_core_bandwidth() if jax.default_backend() == "cpu" else None
    if one_core is not None:
        print(
            f"  decode at {step_bytes / step_s / one_core:.1%} of {one_core / 1e9:,.1f} GB/s, "
            "the 1 GiB stream pinned to one core, measured now: one device's decode runs "
            "its operations one after another, each on one core"
        )
    working_set = _roofline.bandwidth(jax.local_devices()[:1], max(step_bytes, 2**20))
    fraction = step_bytes / step_s / working_set
    print(
        f"  decode at {fraction:.1%} of {working_set / 1e9:,.1f} GB/s, a stream the size of "
        f"its working set ({mib(step_bytes)}), measured now"
    )


def decode_step_seconds(model, devices: list, rows: int, lengths: tuple[int, int], repeats: int):
    """Seconds of one decode step of ``rows`` sequences on each of ``devices`` at once, the
    sampler pmapped over them as PPO's rollout runs it."""
    graphdef, params = model
    prompt_len, new_tokens = lengths
    tokens, mask = left_padded_prompts(len(devices) * rows, prompt_len)
    tokens, mask = (a.reshape(len(devices), rows, prompt_len) for a in (tokens, mask))
    replicated = parallel.replicate(params, devices)

    samplers = {
        "all": jax.pmap(greedy(graphdef, new_tokens), devices=devices),
        "prefill + 1": jax.pmap(greedy(graphdef, 1), devices=devices),
    }
    seconds = interleaved_median_seconds(
        samplers, replicated, tokens, mask, warmup=1, repeats=repeats
    )
    return (seconds["all"] - seconds["prefill + 1"]) / (new_tokens - 1)


def report_rollout_decode(
    config, model, rollout_batch: int, lengths: tuple[int, int], repeats: int, peak
):
    """Print the decode of ``rollout_batch`` sequences data-parallel over every device: step
    time, tokens/s, the bytes all devices read, and its fraction of the bandwidth."""
    params = model[1]
    devices = jax.local_devices()
    if rollout_batch % len(devices):
        raise ValueError(
            f"--rollout-batch {rollout_batch} does not split over {len(devices)} devices: "
            "pass a multiple of the device count (ALIGNPIPE_CPU_DEVICES)"
        )
    rows, slots = rollout_batch // len(devices), sum(lengths) - 1
    step_s = decode_step_seconds(model, devices, rows, lengths, repeats)
    step_bytes = len(devices) * _roofline.decode_step_bytes(
        config, _roofline.tree_bytes(params), rows, slots
    )
    print(
        f"rollout decode, {len(devices)} devices x {rows} sequences (pmap as bench_ppo.py's "
        f"rollout, each device its own program and parameter replica), {slots} slots:"
    )
    print(
        f"  step {step_s * 1e3:.2f} ms ({rollout_batch / step_s:,.0f} tokens/s) reads "
        f"{mib(step_bytes)}: {_roofline.of_bandwidth(step_bytes, step_s, peak)}"
    )


if __name__ == "__main__":
    main()
