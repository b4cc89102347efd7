"""The pipeline's parameters in use: their defaults and values by stage, flags read back to
values, the README's table, and ``validate``, which runs at compile (and local run) time,
before anything is submitted. The table itself is ``param_table.py``.
"""

from __future__ import annotations

import math
from typing import Any

from components.core.model.presets import PRESETS
from pipelines.dag.param_table import BY_NAME, PARAMS, STAGE_CONFIGS

ALGORITHMS = ("ppo", "grpo", "rloo", "dpo")
# The stages a run of each kind trains: dpo needs no reward model and replaces ppo.
TRAINED_STAGES = {"rl": ("sft", "reward", "ppo"), "dpo": ("sft", "dpo")}


class ParamError(ValueError):
    """A pipeline parameter a run must not start with; the message names it and the fix."""


# Stages whose tasks hold the accelerator: their batches must split over its chips.
BATCHES_PER_CHIP = {"sft_batch_size": "sft", "reward_batch_size": "reward", "dpo_batch_size": "dpo"}


def defaults() -> dict[str, Any]:
    """Every parameter's default, by name."""
    return {p.name: p.default_value() for p in PARAMS}


def stage_values(stage: str, values: dict[str, Any]) -> dict[str, Any]:
    """The config fields of ``stage`` that ``values`` (parameter → value) set."""
    return {
        field: values[p.name]
        for p in PARAMS
        for s, field in p.targets
        if s == stage and p.name in values
    }


def coerce(name: str, text: str) -> Any:
    """A parameter value from command-line text, in the parameter's type."""
    if name not in BY_NAME:
        raise ParamError(f"unknown parameter {name!r}; known: {', '.join(BY_NAME)}")
    kind = BY_NAME[name].type()
    if kind is bool:
        lowered = text.strip().lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ParamError(f"{name}: expected true or false, got {text!r}")
        return lowered in ("true", "1", "yes")
    try:
        return kind(text)
    except ValueError:
        raise ParamError(f"{name}: expected {kind.__name__}, got {text!r}") from None


def validate(values: dict[str, Any], chips: int) -> dict[str, Any]:
    """Every parameter's value (defaults filled in), checked; raises ParamError on the first fault.

    ``chips`` is the accelerator count each training task gets (the virtual CPU
    devices for local runs): global batches must split evenly over them.
    """
    unknown = sorted(set(values) - set(BY_NAME))
    if unknown:
        raise ParamError(f"unknown parameter(s) {unknown}; known: {', '.join(BY_NAME)}")
    merged = {**defaults(), **values}
    for name, value in merged.items():
        _check_type(name, value)
    if merged["preset"] not in PRESETS:
        raise ParamError(
            f"preset: {merged['preset']!r} is not a model preset; use one of {sorted(PRESETS)}"
        )
    if merged["builtin_pairs"] < 1:
        raise ParamError(f"builtin_pairs: {merged['builtin_pairs']} must be at least 1")
    _check_algorithm(merged)
    _check_rewards(merged)
    _check_monitors(merged)
    _check_task(merged)
    _check_registry(merged)
    _check_checkpoint_root(merged["checkpoint_root"])
    for stage in ("shard", *trained_stages(merged), "evaluate"):
        try:
            STAGE_CONFIGS[stage](**stage_values(stage, merged))
        except ValueError as error:
            raise ParamError(f"{stage} parameters: {error}") from None
    try:  # the sft data's own renaming, as data_columns is checked with the shard stage's
        STAGE_CONFIGS["shard"](columns=merged["sft_data_columns"])
    except ValueError as error:
        raise ParamError(f"sft_data_columns: {error}") from None
    _check_batches(merged, chips)
    return merged


def trained_stages(values: dict[str, Any]) -> tuple[str, ...]:
    """The training stages a run with these parameters runs (sft only without base_policy,
    or with sft_on_base)."""
    stages = TRAINED_STAGES["dpo" if values["algorithm"] == "dpo" else "rl"]
    sft = not values["base_policy"] or values["sft_on_base"]
    reward = values.get("train_reward_model", True)
    return tuple(s for s in stages if (s != "sft" or sft) and (s != "reward" or reward))


def _check_algorithm(values: dict[str, Any]) -> None:
    """A known algorithm, and a judge for evaluate when no reward model is trained."""
    algorithm = values["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ParamError(f"algorithm: {algorithm!r} is unknown; use one of {ALGORITHMS}")
    # The built-in preference task has a gold reward; reward functions judge a verifiable run.
    has_gold = values["gold_reward"] or not values["data_uri"] or values["reward_functions"]
    if algorithm == "dpo" and not (values["eval_reward_model"] or has_gold):
        raise ParamError(
            "algorithm: dpo trains no reward model, so evaluate has no judge for your data: "
            "pass eval_reward_model (a reward model folder) or gold_reward (a gold scoring "
            "function, PATH.py:FUNCTION)"
        )


def _check_rewards(values: dict[str, Any]) -> None:
    """Something scores an RL run's rollouts, and the reward functions this machine can load
    (built-ins and local files) load; a module or gs:// file is loaded by the task."""
    from components.core.rewards.functions import load_reward_functions, parse_specs

    if values["algorithm"] != "dpo" and not values["train_reward_model"]:
        if not values["reward_functions"]:
            raise ParamError(
                "train_reward_model: false, and no reward_functions: nothing would score the "
                f"{values['algorithm']} rollouts; give reward_functions (e.g. "
                "builtin/exact-match, or PATH.py:FUNCTION), or set train_reward_model true"
            )
    local = [
        spec for spec in parse_specs(values["reward_functions"])
        if spec.startswith("builtin/") or (".py:" in spec and "://" not in spec)
    ]  # fmt: skip
    try:
        load_reward_functions(",".join(local))
    except (ValueError, OSError, ImportError) as error:
        raise ParamError(f"reward_functions: {error}") from None


def _check_monitors(values: dict[str, Any]) -> None:
    """The over-optimisation settings a run can act on: a conservative reward needs an
    ensemble; the held-out model and the ensemble need a reward model that ppo holds whole."""
    if values["conservative_reward"] and values["reward_ensemble"] < 2:
        raise ParamError(
            f"conservative_reward: {values['conservative_reward']!r} combines a reward "
            f"ensemble, but reward_ensemble is {values['reward_ensemble']}; set reward_ensemble "
            "to 3 (Coste et al.'s smallest that helps) or conservative_reward ''"
        )
    monitored = held_out(values) or values["reward_ensemble"] > 1
    if monitored and values["fsdp"]:
        raise ParamError(
            "heldout_reward, heldout_data_uri or reward_ensemble with fsdp: ppo holds those "
            "reward models whole on every device, which fsdp runs do not; set heldout_reward "
            "0, heldout_data_uri '' and reward_ensemble 1, or fsdp false"
        )
    if monitored and (values["algorithm"] == "dpo" or not values["train_reward_model"]):
        raise ParamError(
            "heldout_reward, heldout_data_uri and reward_ensemble train reward models beside "
            "the one ppo trains against; this run trains none (dpo, or train_reward_model "
            "false): set them to 0, '' and 1"
        )


def held_out(values: dict[str, Any]) -> bool:
    """Whether the run trains a held-out reward model: on a share of its prompts
    (``heldout_reward``) or on other annotators' data (``heldout_data_uri``)."""
    return values.get("heldout_reward", 0) > 0 or bool(values.get("heldout_data_uri"))


def _check_task(values: dict[str, Any]) -> None:
    """A built-in task this release has, generated only when no data is given; sft data of
    its own only beside given data."""
    from pipelines.dag.tasks import TASKS

    if values["task"] not in TASKS:
        raise ParamError(f"task: {values['task']!r} is unknown; use one of {sorted(TASKS)}")
    if values["task"] and values["data_uri"]:
        raise ParamError(
            f"task: {values['task']!r} generates the built-in data, but data_uri is given; "
            "leave one of them ''"
        )
    if values["sft_data_uri"] and not values["data_uri"]:
        raise ParamError(
            "sft_data_uri: the built-in tasks bring their own sft data; give data_uri too, or "
            "leave sft_data_uri ''"
        )
    if values["heldout_data_uri"] and not values["data_uri"]:
        raise ParamError(
            "heldout_data_uri: the built-in tasks hold out a share of their own prompts "
            "(heldout_reward); give data_uri too, or leave heldout_data_uri ''"
        )


def _check_registry(values: dict[str, Any]) -> None:
    """A registry model needs versions on gs://, and a well-formed resource name."""
    from pipelines.releases import registry

    registry_model, root = values["registry_model"], values["promoted_policy_uri"]
    if not registry_model:
        return
    if not root.startswith("gs://"):
        where = f"the local folder {root!r}" if root else "'' (no promotion)"
        raise ParamError(
            f"registry_model: {registry_model!r} needs promoted versions on Cloud Storage, "
            f"but promoted_policy_uri is {where}; set promoted_policy_uri to a gs:// folder, "
            "or registry_model to ''"
        )
    try:
        registry.parse_model(registry_model)
    except ValueError as error:
        raise ParamError(str(error)) from None


def _check_checkpoint_root(root: str) -> None:
    """A checkpoint root Orbax can keep durable state in (gs://, or a local folder)."""
    from components.core.training.checkpoint import check_checkpoint_root

    try:
        check_checkpoint_root(root)
    except ValueError as error:
        raise ParamError(str(error)) from None


def with_cloud_checkpoint_root(values: dict[str, Any], pipeline_root: str) -> dict[str, Any]:
    """``values`` for a cloud run: ``checkpoint_root`` defaults to ``<pipeline_root>/checkpoints``
    and must be on Cloud Storage, where every attempt of a task (on any node) finds it."""
    root = values.get("checkpoint_root") or f"{pipeline_root.rstrip('/')}/checkpoints"
    _check_checkpoint_root(root)
    if not root.startswith("gs://"):
        raise ParamError(
            f"checkpoint_root: {root!r} is not on Cloud Storage; a retried task may run on "
            "another node, so cloud runs keep training state at a gs:// folder (the default "
            "is <pipeline root>/checkpoints)"
        )
    return {**values, "checkpoint_root": root}


def _check_type(name: str, value: Any) -> None:
    """Refuse a value of the wrong type (an int is accepted for a float)."""
    kind = BY_NAME[name].type()
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        raise ParamError(f"{name}: expected {kind.__name__}, got {value!r}")
    if kind is float and not math.isfinite(value):
        # Pipeline specs carry parameters as JSON numbers, which have no inf or nan.
        off = " (to turn the check off, pass a large value such as 1e9)" if value > 0 else ""
        raise ParamError(f"{name}: {value!r}: pipeline parameters must be finite numbers{off}")


def _check_batches(values: dict[str, Any], chips: int) -> None:
    """Global batches must split evenly over the chips of one training task."""
    if chips < 1:
        raise ParamError(f"chip count: {chips} must be at least 1")
    trained = trained_stages(values)
    for name in (n for n, stage in BATCHES_PER_CHIP.items() if stage in trained):
        if values[name] % chips:
            nearest = max(chips, values[name] // chips * chips)
            raise ParamError(
                f"{name}: {values[name]} does not split over {chips} chips; "
                f"use a multiple of {chips} (e.g. {nearest})"
            )
    _check_min_eval_pairs(values)
    if "ppo" not in trained:
        return
    quantum = chips * values["ppo_minibatches"]
    if values["ppo_rollout_batch_size"] % quantum:
        raise ParamError(
            f"ppo_rollout_batch_size: {values['ppo_rollout_batch_size']} must be a multiple of "
            f"{chips} chips x {values['ppo_minibatches']} ppo_minibatches = {quantum}"
        )
    groups = chips * values["group_size"]
    if values["algorithm"] in ("grpo", "rloo") and values["ppo_rollout_batch_size"] % groups:
        # A group's responses share a chip: their baseline is computed there.
        raise ParamError(
            f"ppo_rollout_batch_size: {values['ppo_rollout_batch_size']} must be a multiple of "
            f"{chips} chips x group_size {values['group_size']} = {groups} for "
            f"{values['algorithm']}"
        )


def _check_min_eval_pairs(values: dict[str, Any]) -> None:
    """The shard stage must keep one eval batch of each training stage that runs."""
    if not values["min_eval_pairs"]:
        return
    trained = trained_stages(values)
    batches = [name for name, stage in BATCHES_PER_CHIP.items() if stage in trained]
    largest = max(batches, key=lambda name: values[name])
    if values["min_eval_pairs"] < values[largest]:
        raise ParamError(
            f"min_eval_pairs: {values['min_eval_pairs']} is below {largest} "
            f"{values[largest]}, and the training stages read the eval split in batches of "
            f"their batch_size; set min_eval_pairs to {values[largest]}"
        )


def markdown_table() -> str:
    """The parameter table for the README: name, type, default, what it does."""
    rows = ["| parameter | type | default | what it sets |", "| --- | --- | --- | --- |"]
    for p in PARAMS:
        where = ", ".join(f"`{s}.{f}`" for s, f in p.targets) or "pipeline"
        text = p.help_text().replace("|", "\\|")
        rows.append(
            f"| `{p.name}` | {p.type().__name__} | `{p.default_value()!r}` | {text} ({where}) |"
        )
    return "\n".join(rows)
