"""The pipeline's parameters: names, defaults and help drawn from the stage configs, and checks.

A stage parameter names the config field it sets (``sft_steps`` → ``SFTConfig.steps``) and
takes that field's default and help, so each default lives once, in its stage's dataclass.
The few parameters no stage config owns (where the data is, where to promote) are defined
here. ``validate`` runs at compile (and local run) time, before anything is submitted.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from components.core.model.config import PRESETS
from components.dpo.config import DPOConfig
from components.evaluate.config import EvalConfig
from components.ppo.config import PPOConfig
from components.reward.config import RewardConfig
from components.sft.config import SFTConfig
from components.shard.config import ShardConfig

STAGE_CONFIGS: dict[str, type] = {
    "shard": ShardConfig,
    "sft": SFTConfig,
    "reward": RewardConfig,
    "ppo": PPOConfig,
    "dpo": DPOConfig,
    "evaluate": EvalConfig,
}
ALGORITHMS = ("ppo", "grpo", "rloo", "dpo")
# The stages a run of each kind trains: dpo needs no reward model and replaces ppo.
TRAINED_STAGES = {"rl": ("sft", "reward", "ppo"), "dpo": ("sft", "dpo")}


class ParamError(ValueError):
    """A pipeline parameter a run must not start with; the message names it and the fix."""


@dataclasses.dataclass(frozen=True, slots=True)
class Param:
    """One pipeline parameter: the stage config fields it sets, or its own default."""

    name: str
    targets: tuple[tuple[str, str], ...] = ()  # (stage, config field) pairs it sets
    default: Any = None  # parameters no stage config owns, or a pipeline-level default
    help: str = ""
    kind: type | None = None

    @property
    def source(self) -> dataclasses.Field | None:
        """The config field the default and help come from (the first target)."""
        if not self.targets:
            return None
        stage, name = self.targets[0]
        return {f.name: f for f in dataclasses.fields(STAGE_CONFIGS[stage])}[name]

    def default_value(self) -> Any:
        """The default: this parameter's own when it sets one, else the stage config's."""
        source = self.source
        if source is None or self.default is not None:
            return self.default
        if source.default_factory is not dataclasses.MISSING:
            return source.default_factory()
        return source.default

    def help_text(self) -> str:
        """The help: the stage config field's, else this parameter's own."""
        source = self.source
        if self.help or source is None:
            return self.help
        return source.metadata.get("help", "")

    def type(self) -> type:
        """The scalar Python type the pipeline declares (str, int, float or bool)."""
        if self.kind is not None:
            return self.kind
        stage, name = self.targets[0]
        hint = typing.get_type_hints(STAGE_CONFIGS[stage])[name]
        if typing.get_origin(hint) is typing.Literal:
            return type(typing.get_args(hint)[0])
        return hint


def _stage(stage: str, *fields: str, prefix: str = "") -> tuple[Param, ...]:
    """Parameters ``prefix + field`` for fields of one stage's config."""
    return tuple(Param(prefix + f, ((stage, f),)) for f in fields)


def _shared(name: str, field: str, *stages: str) -> Param:
    """One parameter that sets the same field in several stages' configs."""
    return Param(name, tuple((s, field) for s in stages))


PARAMS: tuple[Param, ...] = (
    Param(
        "data_uri",
        default="",
        kind=str,
        help="preference files (JSONL/Parquet), comma-separated paths or globs, local or gs://; "
        "'' = generate the built-in task into the run",
    ),
    Param("builtin_pairs", default=2000, kind=int, help="pairs of the built-in task (data_uri '')"),
    Param("data_format", (("shard", "format"),)),
    Param(
        "tokenizer",
        (("shard", "tokenizer"),),
        default="",
        kind=str,
        help="'' = base_policy's own, else the data's (builtin-words for the built-in task, "
        "byte for files); 'byte', a Hugging Face tokenizer.json or model folder, or a "
        "SentencePiece .model",
    ),
    *_stage("shard", "max_prompt_tokens", "max_response_tokens", "num_shards"),
    *_stage("shard", "eval_fraction", "max_invalid_fraction"),
    Param(
        "min_eval_pairs",
        (("shard", "min_eval_pairs"),),
        default=max(SFTConfig().batch_size, RewardConfig().batch_size),
        help="the shard stage refuses an eval split with fewer pairs; sft and reward read it in "
        "batches of their batch_size, so at least the larger of sft_batch_size and "
        "reward_batch_size (0 = no check)",
    ),
    Param(
        "beam_args",
        default="",
        kind=str,
        help="Beam pipeline options of the shard stage, e.g. '--runner=DataflowRunner "
        "--project=P --region=R --temp_location=gs://B/tmp --sdk_container_image=IMAGE'; "
        "'' = Beam's local FnApiRunner in the task",
    ),
    Param(
        "base_policy",
        (("sft", "base_policy"),),
        help="the policy to align: a model folder (alignpipe, or Hugging Face with "
        "safetensors and its tokenizer, local or gs://) or a promoted_policy_uri; its "
        "tokenizer shards the data unless tokenizer is set; '' = train one with sft",
    ),
    Param(
        "sft_on_base",
        default=False,
        kind=bool,
        help="with base_policy: fine-tune it on the chosen responses (the sft stage) before "
        "aligning it; false = align base_policy as it is",
    ),
    Param(
        "reward_base_policy",
        (("reward", "base_policy"),),
        help="model folder (artifact or Hugging Face, local or gs://) the reward model starts "
        "from with a fresh scalar head, e.g. the same as base_policy; '' = a fresh model of preset",
    ),
    _shared("preset", "preset", "sft", "reward"),
    _shared("max_len", "max_len", "sft", "reward", "dpo"),
    _shared("seed", "seed", "sft", "reward", "ppo", "dpo", "evaluate"),
    _shared("remat", "remat", "sft", "reward", "ppo", "dpo"),
    _shared("dtype", "dtype", "sft", "reward", "ppo", "dpo"),
    _shared("fsdp", "fsdp", "sft", "reward", "ppo", "dpo", "evaluate"),
    _shared("lora_rank", "lora_rank", "sft", "reward", "ppo", "dpo"),
    _shared("lora_alpha", "lora_alpha", "sft", "reward", "ppo", "dpo"),
    _shared("lora_targets", "lora_targets", "sft", "reward", "ppo", "dpo"),
    *_stage("sft", "steps", "batch_size", "learning_rate", prefix="sft_"),
    *_stage("reward", "steps", "batch_size", "learning_rate", prefix="reward_"),
    Param(
        "min_reward_accuracy",
        (("reward", "min_reward_accuracy"),),
        default=0.6,  # noisy labels allow ~0.6; the built-in task's reward model reaches ~0.9
        help="stop the run after the reward stage (no ppo, evaluate or promote) when the reward "
        "model's eval accuracy is below this; 0 = never",
    ),
    Param(
        "algorithm",
        (("ppo", "algorithm"),),
        default="ppo",
        kind=str,
        help="ppo (reward model, critic), grpo or rloo (reward model, no critic: group "
        "baselines), or dpo (no reward model: the dpo stage replaces the reward and ppo stages)",
    ),
    Param("group_size", (("ppo", "group_size"),)),
    *_stage("ppo", "iterations", "rollout_batch_size", "minibatches", prefix="ppo_"),
    *_stage("ppo", "learning_rate", "critic_learning_rate", prefix="ppo_"),
    Param("ppo_epochs", (("ppo", "ppo_epochs"),)),
    *_stage("ppo", "kl_coef", "adaptive_kl", "kl_target", "kl_stop", "max_new_tokens"),
    *_stage("dpo", "steps", "batch_size", "learning_rate", "beta", prefix="dpo_"),
    *_stage("dpo", "loss_type", "label_smoothing", prefix="dpo_"),
    *_stage("evaluate", "min_win_rate_lower", "max_kl", "max_anchor_kl"),
    *_stage("evaluate", "max_eval_prompts", "gold_reward"),
    Param(
        "eval_reward_model",
        default="",
        kind=str,
        help="algorithm dpo only: a reward model folder (reward stage output, local or gs://) "
        "evaluate judges the dpo policy with; '' = the gold reward judges (built-in task, or "
        "gold_reward)",
    ),
    Param("eval_samples_per_prompt", (("evaluate", "samples_per_prompt"),)),
    Param("best_of_n", (("evaluate", "best_of_n"),), kind=str),
    Param("eval_max_new_tokens", (("evaluate", "max_new_tokens"),)),
    Param("eval_batch_size", (("evaluate", "batch_size"),)),
    Param(
        "checkpoint_root",
        default="",
        kind=str,
        help="durable folder of the training stages' resumable state (gs:// on the cloud, "
        "written by Orbax itself; a local folder locally): each trained task keeps it in "
        "<checkpoint_root>/<stage>/<digest of its config, inputs and code>, where a retried or "
        "preempted attempt of that task resumes, and the model artifacts hold only the final "
        "model; kept after "
        "success (the last checkpoints); '' = inside each model artifact, which only local "
        "runs allow (a training task whose artifact is on gs:// refuses it)",
    ),
    Param(
        "promoted_policy_uri",
        default="",
        kind=str,
        help="folder (local or gs://) the policy is copied to when evaluation blesses it; "
        "'' = keep it only as the promote task's artifact",
    ),
    Param(
        "registry_model",
        default="",
        kind=str,
        help="Vertex Model Registry model each promoted version is also uploaded to as its new "
        "default version (alias v<version>): a display name (in the run's project and "
        "region; created on the first upload) or projects/P/locations/L/models/ID; needs a "
        "gs:// promoted_policy_uri; '' = no upload",
    ),
    Param(
        "anchor_policy",
        default="",
        kind=str,
        help="policy folder (or promotion root: its first version) drift is measured from: "
        "evaluate reports KL to it, win rate and gold gain against it, max_anchor_kl gates "
        "it; '' = the first version promoted to promoted_policy_uri, else the run's initial "
        "policy",
    ),
    Param(
        "force_run",
        default=False,
        kind=bool,
        help="train even when data_uri matches the same files as the last promoted run "
        "(otherwise such a run ends as 'no new data')",
    ),
)
BY_NAME: dict[str, Param] = {p.name: p for p in PARAMS}
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
    _check_registry(merged)
    _check_checkpoint_root(merged["checkpoint_root"])
    for stage in ("shard", *trained_stages(merged), "evaluate"):
        try:
            STAGE_CONFIGS[stage](**stage_values(stage, merged))
        except ValueError as error:
            raise ParamError(f"{stage} parameters: {error}") from None
    _check_batches(merged, chips)
    return merged


def trained_stages(values: dict[str, Any]) -> tuple[str, ...]:
    """The training stages a run with these parameters runs (sft only without base_policy,
    or with sft_on_base)."""
    stages = TRAINED_STAGES["dpo" if values["algorithm"] == "dpo" else "rl"]
    sft = not values["base_policy"] or values["sft_on_base"]
    return tuple(s for s in stages if s != "sft" or sft)


def _check_algorithm(values: dict[str, Any]) -> None:
    """A known algorithm, and a judge for evaluate when no reward model is trained."""
    algorithm = values["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ParamError(f"algorithm: {algorithm!r} is unknown; use one of {ALGORITHMS}")
    if algorithm != "dpo" and values["eval_reward_model"]:
        raise ParamError(
            f"eval_reward_model: applies to algorithm dpo only; with {algorithm} the reward "
            "stage's model judges the evaluation: set eval_reward_model to ''"
        )
    has_gold = values["gold_reward"] or not values["data_uri"]  # the built-in task has one
    if algorithm == "dpo" and not (values["eval_reward_model"] or has_gold):
        raise ParamError(
            "algorithm: dpo trains no reward model, so evaluate has no judge for your data: "
            "pass eval_reward_model (a reward model folder) or gold_reward (a gold scoring "
            "function, PATH.py:FUNCTION)"
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
