"""PPO update time and FLOP/s on the demo model, this tree's update against a git revision's.

The update of ``bench_ppo.py``'s iteration (demo model for policy and critic, remat none,
batch 32, prompt 16 + response 32 tokens, 4 epochs x 2 minibatches, 8 CPU devices) on a
synthetic rollout batch. With ``--baseline REV`` the update as it was at REV (the model's
``layers.py`` and ``transformer.py``, ``scoring.py``, ``losses.py`` and ``update.py`` read
with ``git show``; the networks built with REV's transformer) runs in the same process and
both are timed round-robin, so load on the shared machine hits both alike. REV must have
the core's rooms (37697c7 or later: the modules' paths). Achieved FLOPs are bench_ppo.py's
model FLOPs (``_roofline.train_flops``: 6 · matmul weights · tokens plus attention, policy
with its logits and critic, every epoch, over the whole padded batch) and, beside them,
6 · parameters · tokens; the fraction is of the fp32 matmul peak ``_roofline`` measures in
the same run, and of the ceiling at these shapes (``_roofline.shape_ceiling``: the step's
own weight matmuls alone). With ``--longest`` below the response width both count the
padded batch: effective figures. Both sides start from the same state.

    python benchmarks/bench_ppo_update.py [--baseline REV] [--repeats 7] [--longest 16]
        [--profile]

``--profile`` also prints where this tree's update spends its time, by kind of XLA:CPU
thunk (weight matmuls, copies and transposes, collectives, the other fusions). Name a
commit as REV, not HEAD~1: other work lands on top of the update's own commits.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import subprocess
import sys
import time
import types
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ.get("ALIGNPIPE_CPU_DEVICES", "8")))

import _roofline  # noqa: E402
import numpy as np  # noqa: E402
from _timing import print_thunk_shares  # noqa: E402
from flax import nnx  # noqa: E402

from components.core.model.config import ModelConfig  # noqa: E402
from components.core.model.presets import model_config  # noqa: E402
from components.core.training import parallel  # noqa: E402
from components.core.training.host import on_host  # noqa: E402
from components.ppo import PPOConfig  # noqa: E402
from components.ppo.rollout import Models  # noqa: E402

VOCAB, BATCH, PROMPT, RESPONSE, EPOCHS, MINIBATCHES = 259, 32, 16, 32, 4, 2
TRANSFORMER, UPDATE = "components.core.model.transformer", "components.ppo.update"
# The modules whose revision --baseline swaps in, in import order.
SWAPPED = (
    "components.core.model.layers",
    TRANSFORMER,
    "components.core.model.scoring",
    "components.ppo.losses",
    UPDATE,
)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module_at(revision: str, name: str) -> types.ModuleType:
    """Module ``name`` as its file reads at git ``revision`` (not registered anywhere)."""
    path = name.replace(".", "/") + ".py"
    source = subprocess.run(
        ["git", "show", f"{revision}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(name)
    module.__file__ = f"{revision}:{path}"
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102
    return module


@contextlib.contextmanager
def _swapped(modules: dict[str, types.ModuleType]):
    """Imports of ``modules``' names resolve to them (sys.modules and package attributes)."""
    saved = {name: sys.modules[name] for name in modules}
    try:
        for name, module in modules.items():
            sys.modules[name] = module
            package, _, leaf = name.rpartition(".")
            setattr(sys.modules[package], leaf, module)
        yield
    finally:
        for name, module in saved.items():
            sys.modules[name] = module
            package, _, leaf = name.rpartition(".")
            setattr(sys.modules[package], leaf, module)


def side_modules(revision: str | None) -> tuple[types.ModuleType, types.ModuleType]:
    """(transformer, update) of this tree, or as they were at ``revision`` with its helpers."""
    if revision is None:
        return tuple(importlib.import_module(name) for name in (TRANSFORMER, UPDATE))
    loaded: dict[str, types.ModuleType] = {}
    for name in SWAPPED:
        with _swapped(loaded):
            loaded[name] = _module_at(revision, name)
    return loaded[TRANSFORMER], loaded[UPDATE]


def networks(transformer: types.ModuleType) -> tuple[Models, ModelConfig, Any, Any]:
    """Models and (policy, critic) parameters of the demo preset built with ``transformer``'s
    class: same seeds, so every side starts from the same values."""
    config = model_config("demo", VOCAB, remat="none")
    with on_host():
        policy = transformer.Transformer(config, rngs=nnx.Rngs(0))
        critic = transformer.Transformer(config, rngs=nnx.Rngs(1), scalar_head=True)
    policy_graph, policy_params = nnx.split(policy, nnx.Param)
    critic_graph, critic_params = nnx.split(critic, nnx.Param)
    return Models(policy_graph, critic_graph, critic_graph), config, policy_params, critic_params


def synthetic_batch(longest: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A rollout-shaped batch: every response full length (as a fresh policy's rarely meet
    EOS), or with ``longest`` < RESPONSE, lengths drawn from 1..``longest``."""
    rng = np.random.default_rng(seed)
    full = np.full(BATCH, RESPONSE)
    lengths = rng.integers(1, longest + 1, BATCH) if longest < RESPONSE else full
    mask = (np.arange(RESPONSE)[None] < lengths[:, None]).astype(np.int32)
    noise = (rng.normal(size=(BATCH, RESPONSE)) * mask).astype(np.float32)
    logprobs = (np.full((BATCH, RESPONSE), -np.log(VOCAB)) * mask).astype(np.float32)
    return {
        "prompt_tokens": rng.integers(3, VOCAB, (BATCH, PROMPT)).astype(np.int32),
        "prompt_mask": np.ones((BATCH, PROMPT), np.int32),
        "response_tokens": rng.integers(3, VOCAB, (BATCH, RESPONSE)).astype(np.int32),
        "response_mask": mask,
        "logprobs": logprobs,
        "advantages": noise,
        "values": 0.5 * noise,
        "returns": noise,
        "ref_logprobs": logprobs,
    }


def matmul_ceiling(config: ModelConfig, critic: bool) -> tuple[float, dict[str, float]]:
    """``_roofline.shape_ceiling`` of one device's minibatch step: its rows' tokens through
    the policy (logits at the response positions) and the critic, forward and backward; and
    of each of ``_roofline.PRODUCT_KINDS`` alone (the weight gradients contract over the tokens)."""
    rows = BATCH // MINIBATCHES // jax.local_device_count()
    tokens = rows * (PROMPT + RESPONSE)
    shapes = _roofline.with_backward(_roofline.weight_matmuls(config, tokens, rows * RESPONSE))
    if critic:
        shapes += _roofline.with_backward(_roofline.weight_matmuls(config, tokens))
    kinds = _roofline.PRODUCT_KINDS
    by_kind = {
        kind: _roofline.shape_ceiling(shapes[i :: len(kinds)]) for i, kind in enumerate(kinds)
    }
    return _roofline.shape_ceiling(shapes), by_kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision whose update is timed alongside")
    parser.add_argument("--repeats", type=int, default=7, help="timed updates per side")
    parser.add_argument(
        "--longest", type=int, default=RESPONSE,
        help=f"longest response of the batch (< {RESPONSE}: lengths drawn from 1..longest)",
    )  # fmt: skip
    parser.add_argument("--algorithm", default="ppo", choices=["ppo", "grpo", "rloo"])
    parser.add_argument(
        "--profile", action="store_true", help="where this tree's update spends its time"
    )
    args = parser.parse_args()
    config = PPOConfig(
        algorithm=args.algorithm, group_size=4, rollout_batch_size=BATCH,
        minibatches=MINIBATCHES, ppo_epochs=EPOCHS, prompt_len=PROMPT,
        max_new_tokens=RESPONSE, warmup_steps=0,
    ).resolved(pretrained=False)  # fmt: skip
    # On the devices, as the rollout leaves it.
    batch = jax.pmap(lambda rows: rows)(parallel.shard_batch(synthetic_batch(args.longest)))
    sides = {"this tree": side_modules(None)}
    if args.baseline:
        sides = {args.baseline: side_modules(args.baseline), **sides}
    runs = {}
    for name, (transformer, module) in sides.items():
        models, model, policy_params, critic_params = networks(transformer)
        critic_params = None if config.uses_groups else critic_params
        fields = {k: batch[k] for k in module.update_fields(config)}
        state = parallel.replicate(module.PPOState.create(policy_params, critic_params, config))
        runs[name] = [module.make_update(models, config), state, fields]
    times: dict[str, list[float]] = {name: [] for name in runs}
    cpu: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.repeats + 1):  # the first call compiles
        # Round-robin, the order reversed every other round: load hits both sides alike.
        for name in list(runs)[:: 1 if step % 2 else -1]:
            update, state, fields = runs[name]
            key = jax.random.PRNGKey(step)
            start, start_cpu = time.perf_counter(), time.process_time()
            state, metrics = update(state, fields, key, np.float32(1.0), np.float32(0.1))
            jax.device_get(metrics)
            runs[name][1] = state
            if step:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    trained = [policy_params] if critic_params is None else [policy_params, critic_params]
    params = sum(leaf.size for tree in trained for leaf in jax.tree.leaves(tree))
    six_n = 6 * params * BATCH * (PROMPT + RESPONSE) * EPOCHS
    length = PROMPT + RESPONSE
    flops = EPOCHS * _roofline.train_flops(model, BATCH, length, RESPONSE)
    if critic_params is not None:
        flops += EPOCHS * _roofline.train_flops(model, BATCH, length)
    peak = _roofline.measure_peak(dtypes=("float32",))
    print(_roofline.describe(peak))
    print(
        f"PPO update ({config.algorithm}): batch {BATCH}, prompt {PROMPT} + response "
        f"{RESPONSE} (longest {args.longest}), {EPOCHS} epochs x {MINIBATCHES} minibatches, "
        f"demo model, {jax.local_device_count()} CPU devices; {flops / 1e9:.1f} model GFLOP "
        f"({six_n / 1e9:.1f} as 6 x params x tokens)"
    )
    ceiling, by_kind = matmul_ceiling(model, critic_params is not None)
    fp32 = peak.matmul["float32"]
    print(
        f"  ceiling at these shapes: one device's share of a minibatch step's weight matmuls "
        f"(policy{' and critic' if critic_params is not None else ''}, forward and backward), "
        f"alone in one program: {ceiling / 1e9:.1f} GFLOP/s = {ceiling / fp32:.1%} of the "
        f"float32 peak; each kind alone: "
        + ", ".join(f"{kind} {rate / fp32:.1%}" for kind, rate in by_kind.items())
    )
    for name, values in times.items():
        best, median = min(values), statistics.median(values)
        print(
            f"  {name:>12}: best {best * 1e3:7.1f} ms (median {median * 1e3:7.1f}, CPU time "
            f"{min(cpu[name]) * 1e3:7.1f})  {_roofline.of_peak(flops, best, peak)}, "
            f"{flops / best / ceiling:.1%} of the ceiling; 6N: {six_n / best / 1e9:.1f} GFLOP/s"
        )
    if args.baseline:
        old, new = (min(times[name]) for name in runs)
        old_cpu, new_cpu = (min(cpu[name]) for name in runs)
        print(f"  speed-up, best vs best: wall {old / new:.2f}x, CPU time {old_cpu / new_cpu:.2f}x")
    if args.profile:
        print_profile(runs["this tree"])


def print_profile(run: list) -> None:
    """This tree's update under the jax profiler: its time by kind of XLA:CPU thunk."""
    update, _, fields = run

    def once():  # run[1]: the state, donated to each call and replaced by its result
        run[1], metrics = update(
            run[1], fields, jax.random.PRNGKey(0), np.float32(1.0), np.float32(0.1)
        )
        return metrics

    print_thunk_shares(once, "this tree's update")


if __name__ == "__main__":
    main()
