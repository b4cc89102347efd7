"""XLA's own memory figures for a stage's programs, compiled ahead of time with abstract shapes.

Each algorithm's step functions are the ones its stage runs (``parallel.make_train_step``
over the stage's loss; PPO's ``compiled_phases``), built over parameters that are shapes
only (``nnx.eval_shape``: nothing allocated) placed for the local devices as the stage
places them (replicated, or fsdp's chunks), lowered and compiled on this machine's devices
without running. ``memory_analysis()`` is per device: the program's arguments (parameters,
optimizer state, the batch), outputs, temporaries (gradients, activations, gathered
weights) and the outputs that reuse donated arguments.

A program's figure is ``argument + temp`` (the planner's ``memory.Program`` counts the same
two); what stays on a device beside it without being one of its arguments (the frozen
reference while the policy trains, the optimizer state while it samples) is ``resident``,
and a phase needs the two together. ``alignpipe plan`` prints these beside the planner's;
tests/test_memory_calibration.py holds the planner to them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from components.core.model.config import ModelConfig
from components.core.model.transformer import Transformer
from components.core.training import fsdp, parallel
from components.core.training.optim import OptimConfig

PyTree = Any


class Compiled(NamedTuple):
    """Per-device bytes of one compiled program, and the seconds its compile took."""

    argument: int
    temp: int
    output: int
    alias: int
    resident: int  # on the device beside it, not one of its arguments
    seconds: float

    @property
    def program(self) -> int:
        """What the planner's program figure counts: arguments and temporaries."""
        return self.argument + self.temp

    @property
    def peak(self) -> int:
        """The program's live bytes (donated outputs reuse their arguments) and the resident."""
        return self.argument + self.temp + self.output - self.alias + self.resident


def abstract_network(config: ModelConfig, *, scalar_head: bool) -> tuple[nnx.GraphDef, PyTree]:
    """The graph and parameter shapes of a network (nothing allocated)."""
    build = lambda: Transformer(config, rngs=nnx.Rngs(0), scalar_head=scalar_head)  # noqa: E731
    return nnx.split(nnx.eval_shape(build), nnx.Param)


def placed(tree: PyTree, *, sharded: bool) -> PyTree:
    """Shapes of ``tree`` as ``parallel.place`` puts it on the local devices: a leading device
    axis on every leaf, each device a whole copy or (``sharded``) fsdp's chunk."""
    local = jax.local_device_count()
    total = local * jax.process_count()

    def one(path: tuple, leaf: Any) -> Any:
        shape = tuple(leaf.shape)
        lead = fsdp._lead(path)
        if not sharded or len(shape) <= lead:
            return jax.ShapeDtypeStruct((local, *shape), leaf.dtype)
        size = int(np.prod(shape[lead:]))
        chunk = jax.ShapeDtypeStruct((local, *shape[:lead], -(-size // total)), leaf.dtype)
        return fsdp.Sharded(chunk, shape[lead:], fsdp.AXIS)

    return jax.tree_util.tree_map_with_path(one, tree)


def _bytes(tree: PyTree) -> int:
    """Bytes one device holds of a placed tree of shapes."""
    return sum(int(np.prod(leaf.shape[1:])) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def _rows(rows: int, **fields: tuple[tuple[int, ...], Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """A host batch of ``rows`` split over the local devices, as shapes."""
    local = jax.local_device_count()
    if rows % local:
        raise ValueError(f"a batch of {rows} rows does not split over {local} local devices")
    return {
        name: jax.ShapeDtypeStruct((local, rows // local, *shape), dtype)
        for name, (shape, dtype) in fields.items()
    }


def _compile(lowered: Any, resident: int, started: float) -> Compiled:
    stats = lowered.compile().memory_analysis()
    return Compiled(
        argument=int(stats.argument_size_in_bytes),
        temp=int(stats.temp_size_in_bytes),
        output=int(stats.output_size_in_bytes),
        alias=int(stats.alias_size_in_bytes),
        resident=resident,
        seconds=time.perf_counter() - started,
    )


def _train_state(params: PyTree, optimizer: OptimConfig, *, sharded: bool) -> PyTree:
    state = jax.eval_shape(lambda p: parallel.TrainState.create(p, optimizer), params)
    return placed(state, sharded=sharded)


_OPTIM = OptimConfig(learning_rate=1e-5, warmup_steps=0, total_steps=100)


def train_step(
    stage: str, config: ModelConfig, *, batch_size: int, max_len: int, fsdp_: bool = False
) -> dict[str, Compiled]:
    """The compiled train step of sft, reward or dpo (dpo: and its reference forward) for a
    global ``batch_size`` of sequences (reward, dpo: pairs) of ``max_len`` tokens."""
    from components.dpo.train import (
        REFERENCE_CHOSEN,
        REFERENCE_REJECTED,
        make_dpo_loss,
        make_reference_step,
    )
    from components.reward.train import make_reward_loss
    from components.sft.train import make_sft_loss

    started = time.perf_counter()
    graphdef, params = abstract_network(config, scalar_head=stage == "reward")
    tokens = ((max_len,), np.int32)
    if stage == "sft":
        loss = make_sft_loss(graphdef)
        batch = _rows(batch_size, chosen_tokens=tokens, chosen_mask=tokens, loss_mask=tokens)
    else:
        pair = dict(chosen_tokens=tokens, chosen_mask=tokens)
        pair.update(rejected_tokens=tokens, rejected_mask=tokens, loss_mask=tokens)
        pair.update(margin=((), np.float32))
        batch = _rows(batch_size, **pair)
        if stage == "reward":
            loss = make_reward_loss(graphdef, center_coef=0.01, use_margin=False)
        else:
            loss = make_dpo_loss(graphdef, beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
            scored = ((), np.float32)
            batch |= _rows(batch_size, **{REFERENCE_CHOSEN: scored, REFERENCE_REJECTED: scored})
    step = parallel.make_train_step(loss, _OPTIM)
    state = _train_state(params, _OPTIM, sharded=fsdp_)
    key = jax.ShapeDtypeStruct((2,), np.uint32)
    programs = {}
    if stage == "dpo":
        # Its reference forward runs first, beside the train state; the step beside the reference.
        reference = placed(params, sharded=fsdp_)
        plain = {k: v for k, v in batch.items() if k not in (REFERENCE_CHOSEN, REFERENCE_REJECTED)}
        forward = make_reference_step(graphdef, average=False)
        programs["reference"] = _compile(forward.lower(reference, plain), _bytes(state), started)
        started = time.perf_counter()
        programs["update"] = _compile(step.lower(state, batch, key), _bytes(reference), started)
    else:
        programs["update"] = _compile(step.lower(state, batch, key), 0, started)
    return programs


def rl_steps(
    config: ModelConfig, algorithm: str, *, rollout_batch_size: int, prompt_len: int,
    max_new_tokens: int, minibatches: int, fsdp_: bool = False, group_size: int = 4,
) -> dict[str, Compiled]:  # fmt: skip
    """The compiled rollout (sampling and scoring in one program) and update of ppo, grpo or
    rloo: networks of ``config``, full fine-tuning."""
    from components.ppo.config import PPOConfig
    from components.ppo.kl_control import init_kl_controller
    from components.ppo.loop import compiled_phases
    from components.ppo.rollout import Models, RolloutParams, ScoreNorm, TokenIds
    from components.ppo.update import PPOState

    started = time.perf_counter()
    ppo = PPOConfig(
        algorithm=algorithm, rollout_batch_size=rollout_batch_size, prompt_len=prompt_len,
        max_new_tokens=max_new_tokens, minibatches=minibatches, fsdp=fsdp_,
        group_size=group_size, iterations=1,
    ).resolved(pretrained=True)  # fmt: skip
    policy_graph, policy = abstract_network(config, scalar_head=False)
    reward_graph, reward = abstract_network(config, scalar_head=True)
    critic = None if ppo.uses_groups else reward
    models = Models(policy_graph, reward_graph, reward_graph)
    nets = _Nets(models, TokenIds(eos_id=1, pad_id=0), ScoreNorm(0.0, 1.0, 0.0, 0.0))
    rollout, update, _ = compiled_phases(ppo, nets)
    state = placed(
        jax.eval_shape(lambda p, c: PPOState.create(p, c, ppo), policy, critic), sharded=fsdp_
    )
    reference, reward = placed(policy, sharded=fsdp_), placed(reward, sharded=fsdp_)
    critic_params = None if state.critic is None else state.critic.params
    params = RolloutParams(state.policy.params, reference, critic_params, reward, None)
    prompts = _rows(rollout_batch_size, prompt_tokens=((prompt_len,), np.int32),
                    prompt_mask=((prompt_len,), np.int32))  # fmt: skip
    key = jax.ShapeDtypeStruct((2,), np.uint32)
    controller = init_kl_controller("fixed", ppo.kl_coef)
    state_bytes = _bytes(state)
    optimizer_bytes = (
        state_bytes - _bytes(params.policy) - (_bytes(critic_params) if critic_params else 0)
    )
    programs = {
        "rollout": _compile(
            rollout.lower(params, prompts, key, controller), optimizer_bytes, started
        )
    }
    started = time.perf_counter()
    batch, _, _ = jax.eval_shape(rollout, params, prompts, key, controller)
    scale = jax.ShapeDtypeStruct((), np.float32)
    lowered = update.lower(state, batch, key, scale, scale)
    programs["update"] = _compile(lowered, _bytes(reference) + _bytes(reward), started)
    return programs


@dataclasses.dataclass(frozen=True)
class _Nets:
    """What ``compiled_phases`` reads of the loop's networks (their shapes need no values)."""

    models: Any
    ids: Any
    norm: Any
    monitor_spec: Any = None  # no held-out model or ensemble


def stage_programs(
    config: ModelConfig, stage: str, flags: dict, *, algorithm: str = "ppo", fsdp_: bool = False
) -> dict[str, Compiled]:
    """The compiled programs of ``stage`` (the ppo stage: of the RL ``algorithm``) with the
    stage config ``flags`` a run preset gives it (``run_presets.RunPreset.flags``)."""
    if stage in ("sft", "reward", "dpo"):
        return train_step(
            stage, config, batch_size=flags["batch_size"], max_len=flags["max_len"], fsdp_=fsdp_
        )
    if stage != "ppo":
        raise ValueError(f"stage: {stage!r} has no program compiled here (sft, reward, dpo, ppo)")
    return rl_steps(
        config, algorithm, rollout_batch_size=flags["rollout_batch_size"],
        prompt_len=flags["prompt_len"], max_new_tokens=flags["max_new_tokens"],
        minibatches=flags["minibatches"], fsdp_=fsdp_,
        group_size=flags.get("group_size", 4),
    )  # fmt: skip


def preset_programs(preset: Any, values: dict) -> list[dict]:
    """XLA's figures of every compiled program of a run preset's stages with the pipeline
    parameters ``values`` over it (``alignpipe plan --compile``), on this process's devices:
    one per chip of the slice."""
    from pipelines.dag import fit
    from pipelines.dag.run_presets import ALGORITHM_STAGES

    preset, stages = fit.applied(preset, values)
    if jax.local_device_count() != preset.chips:
        raise ValueError(
            f"{jax.local_device_count()} devices here; the preset's slice has {preset.chips} chips"
        )
    algorithm = values.get("algorithm", "ppo")
    found = []
    for stage in ALGORITHM_STAGES[algorithm]:
        if stage == "evaluate":
            continue
        if preset.lora_rank:
            found.append({"stage": stage, "skipped": "LoRA programs are not compiled here"})
            continue
        flags = {"prompt_len": preset.prompt_len, **preset.flags(stage), **stages[stage]}
        programs = stage_programs(
            preset.config(), stage, flags, algorithm=algorithm, fsdp_=preset.fsdp
        )
        for program, figures in programs.items():
            found.append({"stage": stage, "program": program, **figures._asdict()})
    return found


def main() -> None:
    """``python -m pipelines.dag.compiled PRESET VALUES_JSON``: one JSON line per compiled
    program (:func:`preset_programs`). ``alignpipe plan --compile`` runs it in a process of
    its own, with one CPU device per chip of the slice."""
    import json
    import sys

    from pipelines.dag.run_presets import RUN_PRESETS

    name, values = sys.argv[1], json.loads(sys.argv[2])
    for line in preset_programs(RUN_PRESETS[name], values):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
