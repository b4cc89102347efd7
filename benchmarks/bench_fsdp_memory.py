"""Per-device compiled memory of one pmapped train step: replicated vs fully sharded state.

The sft stage's train step (its loss) built by ``parallel.make_train_step`` over 8 virtual
CPU devices, its state placed with ``parallel.replicate`` or ``parallel.place(...,
sharded=True)`` (ZeRO-3, fsdp.py). XLA's ``memory_analysis()`` of the compiled pmap
is per device: arguments (parameters + Adam moments), outputs (the new state, aliased
to the donated arguments), temporaries (gradients, updates, activations, gathered
weights). Theory: 20 bytes/param replicated (fp32 parameters, gradients, two Adam
moments, update temporaries), 1/8 of that sharded; activations and the gathered
embedding table and current layer come on top.

    .venv/bin/python benchmarks/bench_fsdp_memory.py [--preset demo] [--vocab 8192]
        [--dim 512] [--layers 8] [--hidden 1536] [--batch 8] [--seq-len 128] [--remat full]
        [--steps 5]

Step time is timed too, both placements round-robin (on 8 virtual devices sharing
the machine's cores the replicated step repeats the optimizer update 8 times; a
TPU's chips do it in parallel, so there the ratio says little).

The sharded HLO's all-gathers are listed too: with one layer gathered at a time their
count and sizes do not grow with --layers (embedding once, each layer tensor twice:
forward and the remat recompute).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

DEVICES = 8
jax.config.update("jax_num_cpu_devices", DEVICES)
jax.config.update("jax_platforms", "cpu")

import numpy as np  # noqa: E402
from _timing import mib  # noqa: E402
from flax import nnx  # noqa: E402

from components.core.model.transformer import Transformer, model_config  # noqa: E402
from components.core.training import parallel  # noqa: E402
from components.core.training.optim import OptimConfig  # noqa: E402
from components.sft.train import make_sft_loss  # noqa: E402
from pipelines.dag.memory import TRAINED_BYTES_PER_PARAM as STATE_BYTES_PER_PARAM  # noqa: E402
from pipelines.dag.memory import activation_bytes, gathered_bytes  # noqa: E402

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1, "s8": 1, "u8": 1}


def collective_bytes(hlo: str, op: str) -> list[int]:
    """Result sizes (bytes) of every ``op`` instruction in an HLO text, largest first."""
    sizes = []
    pattern = rf"= (\(?[^=]*?\)?) {op}(?:-start)?\("
    for match in re.finditer(pattern, hlo):
        total = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1)):
            count = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
            total += count * DTYPE_BYTES.get(dtype, 4)
        sizes.append(total)
    return sorted(sizes, reverse=True)


def measure(step, state, batch, key) -> tuple[dict[str, int], str, float]:
    """Per-device memory figures of the compiled step, its HLO text and compile seconds."""
    start = time.perf_counter()
    compiled = step.lower(state, batch, key).compile()
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    figures = {
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
    }
    figures["sum"] = figures["argument"] + figures["output"] + figures["temp"]
    # Donated state: outputs reuse the arguments' buffers, so the live peak excludes aliases.
    figures["live"] = figures["sum"] - figures["alias"]
    return figures, compiled.as_text(), seconds


def step_seconds(step, states: dict, batch, key, repeats: int) -> dict[str, float]:
    """Median seconds per step of each placement, round-robin so drift hits both alike.

    The step donates its state, so each call takes the state the previous one returned.
    """
    times: dict[str, list[float]] = {name: [] for name in states}
    for round_ in range(repeats + 1):  # round 0 compiles and warms up
        for name in states:
            start = time.perf_counter()
            states[name], metrics = step(states[name], batch, key)
            jax.block_until_ready(metrics)
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: float(np.median(values)) for name, values in times.items()}


def main() -> None:
    """Compile both steps and print their per-device memory and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--vocab", type=int, default=8192)
    # Wider and deeper than demo, so the state (not activations) dominates: 29.4M params.
    parser.add_argument("--dim", type=int, default=512, help="width (0: the preset's)")
    parser.add_argument("--layers", type=int, default=8, help="n_layers (0: the preset's)")
    parser.add_argument("--hidden", type=int, default=1536, help="MLP hidden_dim (0: preset's)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--remat", default="full", choices=("none", "full", "dots_saveable"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per placement")
    args = parser.parse_args()

    overrides = dict(remat=args.remat, dtype=args.dtype)
    for name, value in (("dim", args.dim), ("n_layers", args.layers), ("hidden_dim", args.hidden)):
        if value:
            overrides[name] = value
    config = model_config(args.preset, args.vocab, **overrides)
    graphdef, params = nnx.split(Transformer(config, rngs=nnx.Rngs(0)), nnx.Param)
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(params))
    per_layer = sum(
        int(np.prod(leaf.shape[1:])) for leaf in jax.tree.leaves(nnx.state(params)["blocks"])
    )
    optimizer = OptimConfig(learning_rate=1e-4, warmup_steps=0, total_steps=100)
    step = parallel.make_train_step(make_sft_loss(graphdef), optimizer)
    rng = np.random.default_rng(0)
    batch = parallel.shard_batch(
        {
            "chosen_tokens": rng.integers(3, args.vocab, (args.batch, args.seq_len)).astype(
                np.int32
            ),
            "chosen_mask": np.ones((args.batch, args.seq_len), np.int32),
            "loss_mask": np.ones((args.batch, args.seq_len), np.int32),
        }
    )
    key = jax.random.PRNGKey(0)

    devices = jax.local_device_count()
    print(
        f"preset={args.preset} dim={config.dim} layers={config.n_layers} "
        f"hidden={config.hidden_dim} vocab={args.vocab} remat={args.remat} dtype={args.dtype}"
    )
    print(
        f"sft train step, global batch {args.batch} x {args.seq_len} tokens "
        f"({args.batch // devices} sequence(s) per device), {devices} CPU devices"
    )
    print(
        f"parameters: {count:,} ({per_layer:,} per layer, "
        f"{count - per_layer * config.n_layers:,} outside the stack)"
    )
    theory = {
        "replicated": STATE_BYTES_PER_PARAM * count,
        "sharded": STATE_BYTES_PER_PARAM * count / devices,
    }
    print(
        f"theoretical state per device ({STATE_BYTES_PER_PARAM} B/param): "
        f"replicated {mib(theory['replicated'])}, sharded {mib(theory['sharded'])}"
    )

    results, texts, states = {}, {}, {}
    for name, sharded in (("replicated", False), ("sharded", True)):
        state = parallel.place(parallel.TrainState.create(params, optimizer), sharded=sharded)
        results[name], texts[name], seconds = measure(step, state, batch, key)
        states[name] = state
        print(f"  {name} compiled in {seconds:.1f} s")

    print("per device:        replicated        sharded   sharded/replicated")
    for field in ("argument", "output", "alias", "temp", "sum", "live"):
        rep, sh = results["replicated"][field], results["sharded"][field]
        label = {"sum": "arg+out+temp", "live": "live (- alias)"}.get(field, field)
        print(f"  {label:<15} {mib(rep):>13} {mib(sh):>13}   {sh / rep:6.3f}x")
    print(f"  argument ratio target ~{1 / devices:.3f}x (1/{devices})")
    # The arithmetic the run presets are chosen by (pipelines/dag/memory.py).
    acts = activation_bytes(
        config, args.batch // devices, args.seq_len, logits_len=args.seq_len, train=True
    )
    estimate = {
        "replicated": theory["replicated"] + acts,
        "sharded": theory["sharded"] + gathered_bytes(config, networks=1, trained=True) + acts,
    }
    rep, sh = estimate["replicated"], estimate["sharded"]
    print(f"  {'run_presets est.':<15} {mib(rep):>13} {mib(sh):>13}   {sh / rep:6.3f}x")
    for name in ("replicated", "sharded"):
        ratio = results[name]["live"] / estimate[name]
        print(f"  live / estimate, {name}: {ratio:.2f}")

    times = step_seconds(step, states, batch, key, args.steps)
    print(
        f"step time (median of {args.steps}, interleaved): replicated "
        f"{times['replicated'] * 1e3:.1f} ms, sharded {times['sharded'] * 1e3:.1f} ms = "
        f"{times['sharded'] / times['replicated']:.2f}x"
    )
    gathers = collective_bytes(texts["sharded"], "all-gather")
    scatters = collective_bytes(texts["sharded"], "reduce-scatter")
    layer_bytes = per_layer * 4
    print(
        f"sharded HLO: {len(gathers)} all-gathers (largest {mib(max(gathers, default=0))}, "
        f"all {mib(sum(gathers))}), {len(scatters)} reduce-scatters; "
        f"one layer's fp32 weights {mib(layer_bytes)}, "
        f"embedding {mib(4 * args.vocab * config.dim)}"
    )


if __name__ == "__main__":
    main()
