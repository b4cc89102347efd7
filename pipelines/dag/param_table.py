"""The pipeline's parameter table: each parameter's name, and the stage config fields it sets,
from which it takes its default, help and type (``sft_steps`` → ``SFTConfig.steps``), so each
default lives once, in its stage's dataclass. The few parameters no stage config owns (where
the data is, where to promote) carry their own here.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

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
        hint = _type_hints(STAGE_CONFIGS[stage])[name]
        if typing.get_origin(hint) is typing.Literal:
            return type(typing.get_args(hint)[0])
        return hint


@functools.cache
def _type_hints(config: type) -> dict[str, Any]:
    """``config``'s resolved field types, read once: evaluating a config's annotations for
    each of its parameters was half of a pipeline compile (1,170 calls, 2026-12-07)."""
    return typing.get_type_hints(config)


# The stages that report figures to the experiment trackers (TrackingSettings).
REPORTING = ("sft", "reward", "ppo", "dpo", "evaluate")


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
        help="preference data, comma-separated: files (JSONL, JSON, Parquet, CSV, Arrow) or "
        "globs, Hugging Face dataset folders, local or gs://, or bq://PROJECT.DATASET.TABLE; "
        "'' = generate the built-in task into the run",
    ),
    Param(
        "sft_data_uri",
        default="",
        kind=str,
        help="the sft stage's own data (TRL prompt-completion or messages records, or "
        "preference pairs; files as data_uri), sharded apart with the same settings, e.g. a "
        "few formatted solutions before RL on prompts; '' = sft trains on data_uri's",
    ),
    Param(
        "heldout_data_uri",
        default="",
        kind=str,
        help="preference data from other annotators (files as data_uri), all of it in the "
        "shards' heldout split: the reward stage trains the held-out reward model on it "
        "(with heldout_reward's share of data_uri's prompts, if any) and no other stage "
        "trains on it; '' = none",
    ),
    Param(
        "task",
        default="",
        kind=str,
        help="with data_uri '': the built-in task generated into the run: '' = the preference "
        "task, arithmetic = the reasoning task (problems with exact answers, a few formatted "
        "solutions for sft, GRPO with builtin/exact-match; pipelines/dag/tasks.py sets its "
        "defaults)",
    ),
    # 4000 (was 2000): the same sft and reward steps see more distinct pairs; on the demo's
    # validation prompts ppo's gold win rate of independent pairs rose from 0.697 to 0.706
    # (kl_target 0.045, score_norm quantile, seeds 0 and 1).
    Param("builtin_pairs", default=4000, kind=int, help="pairs of the built-in task (data_uri '')"),
    Param("data_format", (("shard", "format"),)),
    Param("data_columns", (("shard", "columns"),)),
    Param(
        "sft_data_columns",
        default="",
        kind=str,
        help="the columns renaming for sft_data_uri's records, as data_columns ('' = "
        'data_columns\'): e.g. \'{"question": "prompt", "answer": "completion"}\' to '
        'train sft on openai/gsm8k\'s solutions while data_columns \'{"question": "prompt"}\' '
        "reads its questions as the RL prompts",
    ),
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
    *_stage("shard", "chat_template_kwargs", "system_message"),
    *_stage("shard", "eval_fraction", "max_invalid_fraction"),
    Param("heldout_reward", (("shard", "heldout_fraction"),)),
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
    *(_shared(f, f, *REPORTING) for f in ("report_to", "tracker_project", "vertex_tensorboard")),
    *_stage("sft", "steps", "batch_size", "learning_rate", prefix="sft_"),
    *_stage("reward", "steps", "batch_size", "learning_rate", prefix="reward_"),
    Param(
        "min_reward_accuracy",
        (("reward", "min_reward_accuracy"),),
        default=0.6,  # noisy labels allow ~0.6; the built-in task's reward model reaches ~0.9
        help="stop the run after the reward stage (no ppo, evaluate or promote) when the reward "
        "model's eval accuracy is below this; 0 = never",
    ),
    Param("reward_ensemble", (("reward", "ensemble_size"),)),
    Param(
        "algorithm",
        (("ppo", "algorithm"),),
        default="ppo",
        kind=str,
        help="ppo (reward model, critic), grpo or rloo (reward model, no critic: group "
        "baselines), or dpo (no reward model: the dpo stage replaces the reward and ppo stages)",
    ),
    Param("group_size", (("ppo", "group_size"),)),
    Param(
        "train_reward_model",
        default=True,
        kind=bool,
        help="ppo, grpo, rloo: train the reward model (the reward stage) and score rollouts "
        "with it; false = reward_functions alone score them and the reward stage is skipped",
    ),
    _shared("reward_functions", "reward_functions", "ppo", "evaluate"),
    _shared("reward_weights", "reward_weights", "ppo", "evaluate"),
    *_stage("ppo", "reward_timeout", "reward_workers"),
    *_stage("ppo", "conservative_reward", "conservative_lambda"),
    *_stage("ppo", "select_checkpoint", "select_prompts", "select_samples"),
    *_stage("ppo", "heldout_patience", "heldout_tolerance"),
    *_stage("ppo", "iterations", "rollout_batch_size", "minibatches", prefix="ppo_"),
    *_stage("ppo", "learning_rate", "critic_learning_rate", prefix="ppo_"),
    Param("ppo_epochs", (("ppo", "ppo_epochs"),)),
    *_stage("ppo", "kl_coef", "adaptive_kl", "kl_target", "kl_stop", "max_new_tokens"),
    *_stage("ppo", "kl_control", "score_norm"),
    Param("grpo_loss_type", (("ppo", "loss_type"),)),
    *_stage("dpo", "steps", "batch_size", "learning_rate", "beta", prefix="dpo_"),
    *_stage("dpo", "loss_type", "label_smoothing", prefix="dpo_"),
    *_stage("evaluate", "min_win_rate_lower", "max_kl", "max_anchor_kl", "min_accuracy_gain"),
    *_stage("evaluate", "max_eval_prompts", "gold_reward"),
    *_stage("evaluate", "min_heldout_gain", "max_reward_gap", "max_length_ratio"),
    Param("max_disagreement", (("evaluate", "max_disagreement"),)),
    Param(
        "eval_reward_model",
        default="",
        kind=str,
        help="a reward model folder (reward stage output, local or gs://) evaluate judges "
        "the aligned policy with, trained apart from the one ppo, grpo or rloo trained "
        "against; '' = that one (dpo: the gold reward, built-in task or gold_reward)",
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
