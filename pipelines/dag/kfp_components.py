"""The pipeline's lightweight components: each body imports its stage and calls ``run``
(the components that steer the run, not a stage, are ``run_components.py``'s).

The functions below are plain Python; :func:`build_components` turns them into
``@dsl.component`` definitions on a given base image when a pipeline is built for a
target, so no image is ever read from the environment at import. The bodies run as
they are under kfp.local and inside our images on Vertex AI or GKE (kfp is installed
there, so no task installs anything at run time).

Config fields arrive as parameters named like the fields; ``stage_io.config_from``
builds the stage's config from them, so the stage dataclass stays the one place of
each default and check.

The training components (sft, reward, ppo, dpo) also take ``checkpoint_root``: their
resumable state lives at ``<checkpoint_root>/<stage>/<key>`` while they run, the key a
digest of their config, inputs and code (``stage_io.training_state``).
"""

# No `from __future__ import annotations`: kfp reads the real annotations at build time.
from typing import Any, NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Artifact, Dataset, Input, Metrics, Model, Output

from pipelines.dag import run_components


def shard(
    sources: str,
    format: str,
    columns: str,
    tokenizer: str,
    max_prompt_tokens: int,
    max_response_tokens: int,
    chat_template_kwargs: str,
    system_message: str,
    num_shards: int,
    eval_fraction: float,
    heldout_fraction: float,
    min_eval_pairs: int,
    max_invalid_fraction: float,
    beam_args: str,
    base_policy: str,
    shards: Output[Dataset],
    sft_shards: Output[Dataset],
    metrics: Output[Metrics],
    sft_columns: str = "",
):
    """Validate, dedupe, tokenize and shard the sources (Beam; DirectRunner unless told);
    ``tokenizer`` '' = the base policy's own, else the data's. Sources of role "sft" (the
    sft stage's own data) are sharded apart, with the same settings, into ``sft_shards``
    (left empty without them), their columns renamed by ``sft_columns`` ('' = ``columns``);
    those of role "heldout" (the held-out reward model's) go with the run's data, all into
    its heldout split."""
    import dataclasses
    import json
    import shlex
    import time

    from components.shard import run
    from components.shard.config import ShardConfig
    from pipelines import stage_io
    from pipelines.releases import policies

    started = time.time()
    found = json.loads(sources)
    tokenizer = policies.shards_tokenizer(tokenizer, found, base_policy)
    config = stage_io.config_from(ShardConfig, locals())
    by_role = stage_io.sources_by_role(found)
    # Dataflow workers write to the artifact's gs:// URI; they cannot see this task's files.
    on_dataflow = "DataflowRunner" in beam_args
    if "sft" not in by_role:
        # A file all the same: kfp.local counts a task whose output has none as a cache miss.
        stage_io.no_shards(sft_shards.path)
    for role, artifact in (("", shards), ("sft", sft_shards)):
        if role not in by_role:
            continue
        output = artifact.uri if on_dataflow else artifact.path
        # e.g. too much rejected, too small an eval split
        with stage_io.failure_reason(artifact.path):
            heldout = by_role.get("heldout", []) if not role else []
            own = role == "sft" and sft_columns
            role_config = dataclasses.replace(config, columns=sft_columns) if own else config
            manifest = run(
                role_config, by_role[role], output, beam_args=shlex.split(beam_args),
                heldout_inputs=heldout,
            )  # fmt: skip
        artifact.metadata["counts"] = manifest["counts"]
        if not role:
            stage_io.write_metrics(metrics, "shard", manifest["counts"], started)


def sft(
    shards: Input[Dataset],
    sft_shards: Input[Dataset],
    base_policy: str,
    preset: str,
    max_len: int,
    seed: int,
    remat: str,
    dtype: str,
    fsdp: bool,
    lora_rank: int,
    lora_alpha: float,
    lora_targets: str,
    report_to: str,
    tracker_project: str,
    vertex_tensorboard: str,
    steps: int,
    batch_size: int,
    learning_rate: float,
    model: Output[Model],
    metrics: Output[Metrics],
    checkpoint_root: str = "",
) -> str:
    """Train the initial policy on the chosen responses (of ``sft_shards`` when the run has
    sft data of its own, else of ``shards``), from ``base_policy`` (a reference from
    check_policy, '' = a fresh model of the preset); returns a reference to it."""
    import time

    from pipelines import stage_io

    started = time.time()
    stage_io.start_jax()
    from components.sft import SFTConfig, run

    base = base_policy  # the reference: its fingerprint covers the base's weights
    base_policy = stage_io.reference_uri(base) if base else ""
    config = stage_io.config_from(SFTConfig, locals())
    data = sft_shards if stage_io.has_shards(sft_shards.path) else shards
    inputs = {"shards": data.uri, "base_policy": base}
    state = stage_io.training_state(checkpoint_root, "sft", config, inputs, model.uri)
    with stage_io.failure_reason(model.path), state:
        summary = run(config, data.path, model.path)
    stage_io.write_metrics(metrics, "sft", summary, started)
    return stage_io.reference(model.uri, stage_io.now())


def reward(
    shards: Input[Dataset],
    base_policy: str,
    preset: str,
    max_len: int,
    seed: int,
    remat: str,
    dtype: str,
    fsdp: bool,
    lora_rank: int,
    lora_alpha: float,
    lora_targets: str,
    report_to: str,
    tracker_project: str,
    vertex_tensorboard: str,
    steps: int,
    batch_size: int,
    learning_rate: float,
    min_reward_accuracy: float,
    ensemble_size: int,
    model: Output[Model],
    metrics: Output[Metrics],
    checkpoint_root: str = "",
):
    """Train the Bradley-Terry reward model; fail after writing it when below the accuracy gate."""
    import time

    from pipelines import stage_io

    started = time.time()
    stage_io.start_jax()
    from components.reward import RewardConfig, run

    config = stage_io.config_from(RewardConfig, locals())
    inputs = {"shards": shards.uri}
    state = stage_io.training_state(checkpoint_root, "reward", config, inputs, model.uri)
    with stage_io.failure_reason(model.path), state:  # e.g. below min_reward_accuracy
        summary = run(config, shards.path, model.path)
    model.metadata["eval/accuracy"] = summary.get("eval/accuracy")  # for the run's summary
    stage_io.write_metrics(metrics, "reward", summary, started)


def ppo(
    shards: Input[Dataset],
    policy: str,
    seed: int,
    remat: str,
    dtype: str,
    fsdp: bool,
    lora_rank: int,
    lora_alpha: float,
    lora_targets: str,
    report_to: str,
    tracker_project: str,
    vertex_tensorboard: str,
    algorithm: str,
    group_size: int,
    iterations: int,
    rollout_batch_size: int,
    minibatches: int,
    learning_rate: float,
    critic_learning_rate: float,
    ppo_epochs: int,
    kl_coef: float,
    adaptive_kl: bool,
    kl_target: float,
    kl_stop: float,
    max_new_tokens: int,
    kl_control: str,
    score_norm: str,
    loss_type: str,
    reward_functions: str,
    reward_weights: str,
    reward_timeout: float,
    reward_workers: int,
    conservative_reward: str,
    conservative_lambda: float,
    select_checkpoint: str,
    select_prompts: int,
    select_samples: int,
    heldout_patience: int,
    heldout_tolerance: float,
    model: Output[Model],
    metrics: Output[Metrics],
    checkpoint_root: str = "",
    reward: Input[Model] | None = None,
) -> str:
    """Align the policy against the reward model and/or the reward functions (none: the
    functions alone) with PPO, GRPO or RLOO (resumes from its checkpoints); returns a
    reference to the aligned policy and the reward model that judges it ('' for none)."""
    import time

    from pipelines import stage_io

    started = time.time()
    stage_io.start_jax()
    from components.ppo import run
    from components.ppo.config import PPOConfig

    config = stage_io.config_from(PPOConfig, locals())
    policy_dir = stage_io.reference_uri(policy)
    reward_uri, reward_path = (reward.uri, reward.path) if reward is not None else ("", "")
    inputs = {"shards": shards.uri, "policy": policy, "reward": reward_uri}
    state = stage_io.training_state(checkpoint_root, "ppo", config, inputs, model.uri)
    with stage_io.failure_reason(model.path), state:
        summary = run(config, shards.path, policy_dir, reward_path, model.path)
    stage_io.write_metrics(metrics, "ppo", summary, started)
    figures = {
        "reward_accuracy": reward.metadata.get("eval/accuracy") if reward is not None else None,
        "stopped_kl_guard": summary.get("stopped_kl_guard"),
        "restores": summary.get("guard/restores"),
    }
    return stage_io.reference(
        model.uri, stage_io.now(), algorithm=algorithm, reward=reward_uri, figures=figures
    )


def dpo(
    shards: Input[Dataset],
    policy: str,
    max_len: int,
    seed: int,
    remat: str,
    dtype: str,
    fsdp: bool,
    lora_rank: int,
    lora_alpha: float,
    lora_targets: str,
    report_to: str,
    tracker_project: str,
    vertex_tensorboard: str,
    steps: int,
    batch_size: int,
    learning_rate: float,
    beta: float,
    loss_type: str,
    label_smoothing: float,
    model: Output[Model],
    metrics: Output[Metrics],
    checkpoint_root: str = "",
) -> str:
    """Align the policy on the preference pairs with DPO (no reward model; resumes from its
    checkpoints); returns a reference to the aligned policy."""
    import time

    from pipelines import stage_io

    started = time.time()
    stage_io.start_jax()
    from components.dpo import DPOConfig, run

    config = stage_io.config_from(DPOConfig, locals())
    inputs = {"shards": shards.uri, "policy": policy}
    state = stage_io.training_state(checkpoint_root, "dpo", config, inputs, model.uri)
    with stage_io.failure_reason(model.path), state:
        summary = run(config, shards.path, stage_io.reference_uri(policy), model.path)
    stage_io.write_metrics(metrics, "dpo", summary, started)
    figures = {"steps": summary.get("step"), "accuracy": summary.get("eval/rewards/accuracies")}
    return stage_io.reference(
        model.uri, stage_io.now(), algorithm="dpo", reward="", figures=figures
    )


def evaluate(
    shards: Input[Dataset],
    policy: str,
    reference: str,
    anchor: str,
    reward_model: str,
    seed: int,
    fsdp: bool,
    min_win_rate_lower: float,
    max_kl: float,
    max_anchor_kl: float,
    min_accuracy_gain: float,
    min_heldout_gain: float,
    max_reward_gap: float,
    max_length_ratio: float,
    max_disagreement: float,
    max_eval_prompts: int,
    gold_reward: str,
    reward_functions: str,
    reward_weights: str,
    samples_per_prompt: int,
    best_of_n: str,
    max_new_tokens: int,
    batch_size: int,
    report_to: str,
    tracker_project: str,
    vertex_tensorboard: str,
    evaluation: Output[Artifact],
    report: Output[HTML],
    metrics: Output[Metrics],
) -> NamedTuple("Evaluated", [("Output", bool), ("result", str)]):
    """Measure the aligned policy against its reference and its anchor; returns whether it is
    blessed (``Output``) and the run's result (the aligned policy's reference and the
    evaluation's files).

    The verdict keeps the name ``Output``: kfp.local (2.17) resolves a condition on a task
    output inside a condition group only when the channel ends in ``-Output``.

    The judge is ``reward_model`` when given (a reward model trained apart from the one the
    policy was aligned against, or a dpo policy's), else the reward model the policy was
    aligned against, else the gold reward; with ``reward_functions``, they judge it: the
    verifiable evaluation (accuracy, pass@k) by the first of them.
    """
    import json
    import time
    from collections import namedtuple

    from pipelines import stage_io

    started = time.time()
    stage_io.start_jax()
    from components.evaluate import run
    from components.evaluate.config import EvalConfig
    from components.evaluate.run_info import run_id_of

    config = stage_io.config_from(EvalConfig, locals())
    aligned = stage_io.reference_details(policy)
    reward_dir = reward_model or aligned.get("reward")
    reference_dir = stage_io.reference_uri(reference)
    drift = stage_io.reference_details(anchor)
    with stage_io.failure_reason(evaluation.path):
        summary = run(
            config, shards.path, aligned["uri"], reference_dir, reward_dir, evaluation.path,
            anchor_dir=drift.get("uri", ""), past=drift.get("past", []),
            run_id=run_id_of(evaluation.uri),
        )  # fmt: skip
    stage_io.publish_report(evaluation.path, report.path)
    blessed = bool(summary["blessed"])
    evaluation.metadata["blessed"] = blessed
    stage_io.write_metrics(metrics, "evaluate", summary, started)
    result = {"status": "evaluated", "blessed": blessed, "aligned": policy,
              "evaluation": evaluation.uri, "metrics": metrics.uri}  # fmt: skip
    return namedtuple("Evaluated", ["Output", "result"])(blessed, json.dumps(result))


class Components(NamedTuple):
    """The pipeline's components, bound to one base image."""

    builtin_data: Any
    find_data: Any
    plan_run: Any
    no_new_data: Any
    shard: Any
    sft: Any
    check_policy: Any
    given_policy: Any
    reward: Any
    ppo: Any
    dpo: Any
    evaluate: Any
    promote: Any


DATA_COMPONENTS = ("builtin_data", "find_data", "shard")


def component_function(name: str) -> Any:
    """The plain function behind the component ``name``: this module's or run_components'."""
    return getattr(run_components, name, None) or globals()[name]


def build_components(image: str, data_image: str = "") -> Components:
    """Every component as a ``@dsl.component``: the data ones on ``data_image`` (if given).

    kfp comes with our images, so no task installs it at run time.
    """
    built = {
        name: dsl.component(
            component_function(name),
            base_image=(data_image or image) if name in DATA_COMPONENTS else image,
            install_kfp_package=False,
        )
        for name in Components._fields
    }
    return Components(**built)
