"""Compiled temporary memory of the PPO update step, with and without layer remat.

XLA's ``memory_analysis()`` of the pmapped update (policy + critic forward and
backward, both AdamW steps) on one CPU device, demo-width models with more
layers, a per-device minibatch of 32 sequences of 48 + 48 tokens. Temp memory
is what activations cost; the target is full remat <= 0.5x no remat.

    python benchmarks/bench_ppo_memory.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _timing import mib  # noqa: E402
from flax import nnx  # noqa: E402

from components.core.model.artifact import create_model  # noqa: E402
from components.core.training import parallel  # noqa: E402
from components.ppo import PPOConfig  # noqa: E402
from components.ppo.rollout import Models  # noqa: E402
from components.ppo.update import PPOState, make_update  # noqa: E402

VOCAB, ROWS, PROMPT, RESPONSE, LAYERS = 259, 32, 48, 48, 8


def _batch() -> dict[str, np.ndarray]:
    """A full rollout batch of one device (values are irrelevant to memory)."""
    rng = np.random.default_rng(0)
    floats = rng.normal(size=(ROWS, RESPONSE)).astype(np.float32)
    return {
        "prompt_tokens": rng.integers(3, VOCAB, (ROWS, PROMPT)).astype(np.int32),
        "prompt_mask": np.ones((ROWS, PROMPT), np.int32),
        "response_tokens": rng.integers(3, VOCAB, (ROWS, RESPONSE)).astype(np.int32),
        "response_mask": np.ones((ROWS, RESPONSE), np.int32),
        "logprobs": floats,
        "values": floats,
        "advantages": floats,
        "returns": floats,
    }


def update_temp_bytes(remat: str) -> int:
    """Temp bytes of the compiled update step with layer remat ``remat``."""
    config = PPOConfig(
        rollout_batch_size=ROWS, minibatches=1, ppo_epochs=1,
        prompt_len=PROMPT, max_new_tokens=RESPONSE, warmup_steps=0,
    ).resolved(pretrained=False)  # fmt: skip
    shape = dict(remat=remat, n_layers=LAYERS)
    policy = create_model("demo", VOCAB, scalar_head=False, seed=0, **shape)
    critic = create_model("demo", VOCAB, scalar_head=True, seed=1, **shape)
    policy_graph, policy_params = nnx.split(policy, nnx.Param)
    critic_graph, critic_params = nnx.split(critic, nnx.Param)
    device = [jax.local_devices()[0]]
    update = make_update(Models(policy_graph, critic_graph, critic_graph), config, device)
    state = parallel.replicate(PPOState.create(policy_params, critic_params, config), device)
    batch = parallel.shard_batch(_batch(), device)
    compiled = update.lower(
        state, batch, jax.random.PRNGKey(0), np.float32(1.0), np.float32(0.0)
    ).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main() -> None:
    print(
        f"PPO update step, one device: demo width, {LAYERS} layers, {ROWS} sequences of "
        f"{PROMPT} + {RESPONSE} tokens, policy + critic"
    )
    sizes = {remat: update_temp_bytes(remat) for remat in ("none", "dots_saveable", "full")}
    for remat, size in sizes.items():
        print(f"  remat {remat:14s} temp {mib(size):>12s}  {size / sizes['none']:.2f}x of none")
    ratio = sizes["full"] / sizes["none"]
    print(f"full / none: {ratio:.2f}x (target <= 0.5x)")


if __name__ == "__main__":
    main()
