"""Per-device update memory of an alignment stage's compiled program, at the shapes it ran.

XLA's ``memory_analysis()`` of the pmapped program (bench_fsdp_memory.measure): arguments
+ outputs + temporaries − donated aliases, plus the frozen parameters that stay on the
device meanwhile. PPO's update holds policy and critic with their optimizer states,
reference and reward model resident; GRPO's and RLOO's no critic; DPO's update is its
reference forward and then its train step (the frozen reference resident during the step,
the train state during the forward), and the larger of the two counts. With LoRA
(:func:`networks_update_memory`) the frozen bases are the update's arguments and count
once, as resident. Used by bench_algorithms.py and bench_lora.py, which configure the CPU
devices before importing it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from bench_fsdp_memory import measure
from flax import nnx

from components.core.data.input_pipeline import read_manifest
from components.core.model.artifact import stage_model
from components.core.training import parallel
from components.core.training.checkpoint import read_model_config
from components.core.training.trainer import preference_streams
from components.dpo.config import DPOConfig
from components.dpo.stage import ReferenceScored
from components.dpo.train import (
    REFERENCE_CHOSEN,
    REFERENCE_REJECTED,
    make_dpo_loss,
    make_reference_step,
)
from components.ppo.config import PPOConfig
from components.ppo.kl_control import init_kl_controller
from components.ppo.loop import compiled_phases
from components.ppo.networks import Networks
from components.ppo.rollout import Frozen, RolloutParams
from components.ppo.stage import build_networks
from components.ppo.update import PPOState


class _Bound(NamedTuple):
    """A pmapped program with its arguments after the first two bound: what measure() lowers."""

    program: Any
    rest: tuple

    def lower(self, first: Any, second: Any, key: Any) -> Any:
        return self.program.lower(first, second, *self.rest)


def _bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of a placed tree: every leaf is [devices, ...] (whole tensors
    replicated, or fsdp's chunks)."""
    return sum(int(np.prod(leaf.shape[1:])) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def rl_update_memory(output: str, shards: str, sft: str, reward: str) -> dict[str, int]:
    """Per-device bytes of the RL stage's compiled update at the shapes it ran, and resident."""
    config = PPOConfig(**read_model_config(output)["training"])
    _, nets = build_networks(config, read_manifest(shards), sft, reward)
    return networks_update_memory(config, nets)


def _abstract_placed(tree: Any) -> Any:
    """Shapes of ``tree`` replicated on every local device (nothing allocated)."""
    devices = jax.local_device_count()
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct((devices, *leaf.shape), leaf.dtype), tree)


def networks_update_memory(
    config: PPOConfig, nets: Networks, *, abstract: bool = False
) -> dict[str, int]:
    """Per-device bytes of ``nets``' compiled update under ``config``, and what stays resident:
    reference and reward model, and with LoRA (``nets.frozen``) the frozen bases the update
    reads (passed to it, and counted as resident, not as the program's). ``abstract``:
    ``nets`` holds shapes (jax.ShapeDtypeStruct) only; replicated."""
    if abstract and config.fsdp:
        raise ValueError("networks_update_memory: abstract networks are measured replicated")
    rollout, update, _ = compiled_phases(config, nets)
    if abstract:
        place, create = _abstract_placed, jax.eval_shape
    else:
        place = lambda tree: parallel.place(tree, sharded=config.fsdp)  # noqa: E731
        create = lambda build, *args: build(*args)  # noqa: E731
    state = place(create(lambda p, c: PPOState.create(p, c, config), nets.policy, nets.critic))
    # The reference has the policy's shapes (with LoRA: its adapters, which are turned off).
    frozen = {"reference": place(nets.policy), "reward": place(nets.reward)}
    bases = None if nets.frozen is None else Frozen(*map(place, nets.frozen))
    critic = None if state.critic is None else state.critic.params
    rollout_params = RolloutParams(
        state.policy.params, frozen["reference"], critic, frozen["reward"], bases
    )
    rows = config.rollout_batch_size
    prompts = parallel.shard_batch(
        {
            "prompt_tokens": np.zeros((rows, config.prompt_len), np.int32),
            "prompt_mask": np.ones((rows, config.prompt_len), np.int32),
        }
    )
    key, kl_coef = jax.random.PRNGKey(0), np.float32(config.kl_coef)
    # The rollout batch's shapes and dtypes, traced (not run): memory depends on nothing else.
    controller = init_kl_controller("fixed", config.kl_coef)
    shapes, _, _ = jax.eval_shape(rollout, rollout_params, prompts, key, controller)
    batch = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    extra = (key, np.float32(1.0), kl_coef) + (() if bases is None else (bases,))
    figures, _, _ = measure(_Bound(update, extra), state, batch, key)
    # LoRA's bases are the update's arguments too: counted once, as resident.
    held_bases = 0 if bases is None else _bytes_per_device(bases)
    resident = _bytes_per_device(frozen) + held_bases
    return {
        "program_live": figures["live"] - held_bases,
        "resident": resident,
        "peak": figures["live"] - held_bases + resident,
    }


def dpo_step_memory(output: str, shards: str, sft: str) -> dict[str, int]:
    """Per-device bytes of DPO's reference forward and train step, each with what stays resident."""
    config = DPOConfig(**read_model_config(output)["training"])
    model = stage_model(
        read_manifest(shards), base=sft, preset=config.preset, scalar_head=False,
        seed=config.seed, remat=config.remat, dtype=config.dtype,
    )  # fmt: skip
    graphdef, initial = nnx.split(model, nnx.Param)
    optimizer = config.optim()
    loss = {"beta": config.beta, "loss_type": config.loss_type}
    step = parallel.make_train_step(
        make_dpo_loss(graphdef, **loss, label_smoothing=config.label_smoothing), optimizer
    )
    state = parallel.place(parallel.TrainState.create(initial, optimizer), sharded=config.fsdp)
    reference = parallel.place(jax.device_get(initial), sharded=config.fsdp)
    forward = make_reference_step(graphdef, average=config.loss_type == "ipo")
    batches = preference_streams(shards, "train", config, shuffle=False, repeat=True)
    scored = ReferenceScored(batches, lambda batch: forward(reference, batch))
    batch = parallel.shard_batch(next(scored))
    key = jax.random.PRNGKey(0)
    train, _, _ = measure(step, state, batch, key)
    plain = {k: v for k, v in batch.items() if k not in (REFERENCE_CHOSEN, REFERENCE_REJECTED)}
    reference_pass, _, _ = measure(_Bound(forward, ()), reference, plain, key)
    held_reference = _bytes_per_device(reference)
    held_state = _bytes_per_device(state)
    return {
        "program_live": max(train["live"], reference_pass["live"]),
        "train_step_live": train["live"],
        "reference_forward_live": reference_pass["live"],
        "resident": held_reference,
        "peak": max(train["live"] + held_reference, reference_pass["live"] + held_state),
    }
