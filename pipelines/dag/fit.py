"""Whether a run preset, with the flags given over it, fits its chips: checked before a run
is compiled, submitted or started, so a stage that cannot fit never takes a slice.

``alignpipe compile|submit|run --run-preset P [flags]`` re-estimates every stage
(``run_presets.estimate``) with the flags applied, and refuses a stage over the chip's
budget (``memory.HEADROOM`` of its HBM) naming the stage, its figure, the chip's memory
and the cheapest change that makes it fit, tried in this order: fsdp, a smaller batch of
the stage (halved until it fits, no smaller than one sequence a chip; PPO's minibatches
with it), LoRA adapters, shorter sequences (halved), a slice with more chips.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipelines.dag import memory, param_table, phases
from pipelines.dag.params import held_out
from pipelines.dag.run_presets import ALGORITHM_STAGES, STAGES, RunPreset, estimate

# Pipeline-wide fields a preset holds itself (the stages share them).
PRESET_FIELDS = ("remat", "dtype", "fsdp", "lora_rank", "lora_alpha", "lora_targets")
# The batch field a stage is cut down by, and its pipeline parameter.
BATCH = {
    "sft": ("batch_size", "sft_batch_size"),
    "reward": ("batch_size", "reward_batch_size"),
    "ppo": ("rollout_batch_size", "ppo_rollout_batch_size"),
    "dpo": ("batch_size", "dpo_batch_size"),
    "evaluate": ("batch_size", "eval_batch_size"),
}
# The length field a stage is cut down by, and its pipeline parameter.
LENGTH = {
    "sft": ("max_len", "max_len"),
    "reward": ("max_len", "max_len"),
    "ppo": ("max_new_tokens", "max_new_tokens"),
    "dpo": ("max_len", "max_len"),
    "evaluate": ("max_new_tokens", "eval_max_new_tokens"),
}
LORA_FIX = 16  # the rank the LoRA presets use


class FitError(ValueError):
    """A stage that does not fit its chip, with the figure and the fix."""


def applied(preset: RunPreset, values: dict[str, Any]) -> tuple[RunPreset, dict[str, dict]]:
    """``preset`` with the pipeline-wide ``values`` applied, and per stage the config fields
    the other values set (through the parameter table: ``max_new_tokens`` → ppo's)."""
    fields: dict[str, dict[str, Any]] = {}
    for param in param_table.PARAMS:
        if param.name in values:
            for stage, field in param.targets:
                fields.setdefault(stage, {})[field] = values[param.name]
    shared = {k: v for k, v in fields.get("ppo", {}).items() if k in PRESET_FIELDS}
    prompt = fields.get("shard", {}).get("max_prompt_tokens", preset.prompt_len)
    preset = dataclasses.replace(preset, prompt_len=int(prompt), **shared)
    stages = {
        stage: {k: v for k, v in fields.get(stage, {}).items() if k not in PRESET_FIELDS}
        for stage in STAGES
    }
    for stage in ("ppo", "evaluate"):
        stages[stage]["prompt_len"] = preset.prompt_len
    # The reward artifact's held-out model and ensemble members (core/rewards/members.py): ppo
    # holds them all whole beside its networks, evaluate one at a time beside its three.
    members = int(held_out(values)) + int(values.get("reward_ensemble", 1)) - 1
    if members > 0:
        stages["ppo"][phases.MONITOR_MODELS] = members
        stages["evaluate"][phases.MONITOR_MODELS] = 1
    return preset, stages


def budget(preset: RunPreset) -> float:
    """Bytes a stage may use on one of the preset's chips."""
    return memory.HEADROOM * memory.CHIP_HBM[preset.chip]


def _total(preset: RunPreset, stage: str, overrides: dict[str, Any]) -> float:
    algorithm = overrides.get("algorithm", "ppo") if stage == "ppo" else "ppo"
    rest = {k: v for k, v in overrides.items() if k != "algorithm"}
    return estimate(preset, stage, rest, algorithm=algorithm)["total"]


def _smaller_batch(preset: RunPreset, stage: str, overrides: dict[str, Any]) -> str | None:
    """Flags of the largest halved batch (PPO: with its minibatches) that fits, or None."""
    field, param = BATCH[stage]
    size = int(overrides.get(field, preset.stages[stage][field]))
    minibatches = int(overrides.get("minibatches", preset.stages[stage].get("minibatches", 1)))
    while size // 2 >= preset.chips and size % 2 == 0:
        size //= 2
        # PPO's rollout batch is a multiple of chips × minibatches: fewer minibatches with it.
        minibatches = min(minibatches, size // preset.chips)
        smaller = {**overrides, field: size}
        flags = f"--{param.replace('_', '-')} {size}"
        if stage == "ppo":
            smaller["minibatches"] = minibatches
            flags += f" --ppo-minibatches {minibatches}"
        if _total(preset, stage, smaller) <= budget(preset):
            return flags
    return None


def _fix(preset: RunPreset, stage: str, overrides: dict[str, Any]) -> str:
    """The cheapest change that brings ``stage`` under the budget, as flags."""
    limit = budget(preset)
    sharded = dataclasses.replace(preset, fsdp=True)
    # fsdp does not hold the held-out model or the ensemble (params._check_monitors).
    monitored = bool(overrides.get(phases.MONITOR_MODELS))
    if not preset.fsdp and not monitored and _total(sharded, stage, overrides) <= limit:
        return "--fsdp true (each chip holds 1/chips of the weights and optimizer state)"
    if flags := _smaller_batch(preset, stage, overrides):
        return flags
    if stage != "evaluate" and not preset.lora_rank:
        lora = dataclasses.replace(preset, lora_rank=LORA_FIX)
        if _total(lora, stage, overrides) <= limit:
            return f"--lora-rank {LORA_FIX} (adapters train; the base stays frozen)"
    field, param = LENGTH[stage]
    length = int(overrides.get(field, preset.flags(stage)[field]))
    while length > 16:
        length //= 2
        shorter = {**overrides, field: length}
        flags = f"--{param.replace('_', '-')} {length}"
        if _total(preset, stage, shorter) <= limit:
            return f"{flags}, or a slice with more chips"
        if batch := _smaller_batch(preset, stage, shorter):
            return f"{flags} {batch}, or a slice with more chips"
    return "a slice with more chips (alignpipe run-presets)"


def check(preset: RunPreset, values: dict[str, Any]) -> None:
    """Refuse, naming each stage that does not fit, its figure, the chip and the fix."""
    preset, stages = applied(preset, values)
    limit = budget(preset)
    problems = []
    algorithm = stages["ppo"].get("algorithm", "ppo")
    for stage in ALGORITHM_STAGES[algorithm]:
        total = _total(preset, stage, stages[stage])
        if total > limit:
            name = f"{stage} ({algorithm})" if stage == "ppo" and algorithm != "ppo" else stage
            problems.append(
                f"{name} needs {total / memory.GiB:.1f} GiB per chip, over the "
                f"{limit / memory.GiB:.1f} GiB a {preset.chip} chip "
                f"({memory.CHIP_HBM[preset.chip] / memory.GiB:.0f} GiB) gives a run; fix: "
                f"{_fix(preset, stage, stages[stage])}"
            )
    if problems:
        raise FitError(
            f"the run does not fit {preset.slice_name} ({preset.chips} {preset.chip} chips) "
            "with these flags (the planner's estimate, run_presets.estimate):\n  "
            + "\n  ".join(problems)
        )
