"""The alignment pipeline (KFP v2), built for one target.

Steps:
1. data      the built-in task (``task``) generated into the run (``data_uri`` '') or the
             files ``data_uri`` (and ``sft_data_uri``, ``heldout_data_uri``) match (a glob:
             the newest data of a periodic run)
   plan      when those files equal the last promoted run's, the run trains nothing and
             ends as "no new data" (unless ``force_run``); resolves the anchor policy
             that drift is measured from (``anchor_policy``, else the first promoted one)
2. shard     validate, dedupe, tokenize and shard by prompt hash (Beam); the sft data of
             the run's own apart, with the same settings
3. sft       train the initial policy (on the sft data's shards when the run has some, else
             the data's) when no ``base_policy`` is given, or on it when ``sft_on_base``;
             otherwise the given policy (an alignpipe or Hugging Face folder, or the last
             promoted one) is checked and used as it is
4. reward    train the Bradley-Terry reward model; below ``min_reward_accuracy`` the run
             stops here, the model kept for inspection; skipped when ``train_reward_model``
             is false (``reward_functions`` alone score the rollouts)
5. ppo       align the policy against the reward model and/or the reward functions (PPO,
             GRPO or RLOO), KL to the initial policy
   dpo       instead of 4 and 5 when ``algorithm`` is dpo: align the policy on the pairs
             directly, no reward model
6. evaluate  win rate, KL, rewards against the initial policy, judged by the reward model
             (a dpo run's: ``eval_reward_model``, else the gold reward); KL to the anchor,
             win rate and gold gain against it; HTML report; ``blessed``
7. promote   only when blessed: a new version at ``promoted_policy_uri``, with its record

The run's one output, ``result``, is a JSON string: the evaluation's (status "evaluated",
the aligned policy's reference, the evaluation and metrics folders) or the no-new-data
one (status "no new data"). kfp.local cannot dsl.OneOf artifacts, and a pipeline output
must come from a top-level task or a OneOf, so the training branch returns a string.

Parameter defaults come from the stage configs (``pipelines/dag/param_table.py``); placement
per target from ``pipelines/targets/placement.py``.
"""

# No `from __future__ import annotations`: kfp reads the real annotations of the pipeline.
import inspect
from typing import Any, NamedTuple

from kfp import dsl

from pipelines import PIPELINE_NAME
from pipelines.dag import param_table, params
from pipelines.dag.kfp_components import build_components
from pipelines.dag.stages import downstream
from pipelines.targets.placement import DATA, LIGHT, TRAIN, Placement, place


class Outputs(NamedTuple):
    """What a run hands back: its result (evaluated, or no new data), as JSON."""

    result: str


PARAMETER_NAMES = tuple(p.name for p in param_table.PARAMS)
SIGNATURE = inspect.Signature(
    [
        inspect.Parameter(
            p.name,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=p.default_value(),
            annotation=p.type(),
        )  # fmt: skip
        for p in param_table.PARAMS
    ],
    return_annotation=Outputs,
)


def build_pipeline(placement: Placement, fresh_from: str | None = None) -> Any:
    """The pipeline with tasks placed for ``placement``; no caching from ``fresh_from`` on."""
    c = build_components(placement.image_for(TRAIN), placement.image_for(DATA))
    fresh = set(downstream(fresh_from)) if fresh_from else set()

    def configure(task: Any, stage: str, role: str, cache: bool = True) -> Any:
        """Caching (off from ``fresh_from`` on) and placement of one task."""
        task.set_caching_options(cache and stage not in fresh)
        return place(task, role, placement)

    def alignment_pipeline(*channels: Any) -> Outputs:
        """Align a policy to the preference data; promote it only when evaluation blesses it."""
        p = dict(zip(PARAMETER_NAMES, channels, strict=True))  # the parameter channels by name
        with dsl.If(p["data_uri"] == "", name="builtin-data"):
            data = c.builtin_data(pairs=p["builtin_pairs"], seed=p["seed"], task=p["task"])
            generated = configure(data, "data", DATA)
        with dsl.Else(name="given-data"):
            # Never cached: the same glob matches new files on a later run.
            found = c.find_data(
                data_uri=p["data_uri"], sft_data_uri=p["sft_data_uri"],
                heldout_data_uri=p["heldout_data_uri"],
            )  # fmt: skip
            configure(found, "data", DATA, cache=False)
        sources = dsl.OneOf(generated.outputs["Output"], found.output)
        plan = c.plan_run(
            data_uri=p["data_uri"], sources=sources, force_run=p["force_run"],
            anchor_policy=p["anchor_policy"], promoted_policy_uri=p["promoted_policy_uri"],
        )  # fmt: skip
        # Never cached: the promotion history it reads moves between runs.
        configure(plan, "plan", LIGHT, cache=False)
        with dsl.If(plan.outputs["new_data"] == True, name="new-data"):  # noqa: E712
            evaluated = _train_and_evaluate(c, configure, p, sources, plan.outputs["anchor"])
        with dsl.Else(name="nothing-new"):
            nothing = c.no_new_data(sources=sources, promoted_policy_uri=p["promoted_policy_uri"])
            configure(nothing, "plan", LIGHT, cache=False)
        return Outputs(result=dsl.OneOf(evaluated, nothing.output))

    # KFP reads the pipeline's inputs from its signature: one typed parameter per row of the
    # parameter table (param_table.PARAMS), its default the stage config's.
    alignment_pipeline.__signature__ = SIGNATURE
    return dsl.pipeline(
        name=PIPELINE_NAME, description="RLHF: shard, sft, reward, PPO (or DPO), evaluate."
    )(alignment_pipeline)


def _train_and_evaluate(
    c: Any, configure: Any, p: dict[str, Any], sources: Any, anchor: Any
) -> Any:
    """Shard, the initial policy, the aligning branch, evaluate and promote; returns the
    evaluation's result channel."""
    # The tokenizer is the data's own unless given, or the base policy brings one.
    shard = c.shard(
        sources=sources, beam_args=p["beam_args"], base_policy=p["base_policy"],
        sft_columns=p["sft_data_columns"], **params.stage_values("shard", p),
    )  # fmt: skip
    shards = configure(shard, "shard", DATA).outputs["shards"]
    sft_shards = shard.outputs["sft_shards"]  # empty unless the run has sft data of its own
    # Each training task keeps its resumable state under checkpoint_root (stage_io.state_key).
    state = {"checkpoint_root": p["checkpoint_root"]}

    # Never cached: a policy promoted again to the same folder, or new weights behind the
    # same path, must be re-read; its reference's fingerprint keys the tasks after it.
    checked = c.check_policy(base_policy=p["base_policy"], sft_on_base=p["sft_on_base"])
    configure(checked, "plan", LIGHT, cache=False)
    base = checked.outputs["reference"]
    with dsl.If(checked.outputs["Output"] == True, name="train-policy"):  # noqa: E712
        sft_values = {**params.stage_values("sft", p), "base_policy": base}
        sft = c.sft(shards=shards, sft_shards=sft_shards, **sft_values, **state)
        configure(sft, "sft", TRAIN)
    with dsl.Else(name="warm-start"):
        given = configure(c.given_policy(reference=base), "sft", LIGHT)
    initial_policy = dsl.OneOf(sft.outputs["Output"], given.output)

    # The reward gate (min_reward_accuracy) is the reward task failing after it wrote its
    # model: a failed task stops its dependents on every backend with its reason as the
    # error. Each branch returns a reference to its policy (kfp.local cannot dsl.OneOf
    # artifacts): evaluate and promote stay one task each, whichever branch ran.
    ppo_values = {**params.stage_values("ppo", p), **state}
    with dsl.If(p["algorithm"] == "dpo", name="algorithm-dpo"):
        dpo = c.dpo(shards=shards, policy=initial_policy, **params.stage_values("dpo", p), **state)
        configure(dpo, "dpo", TRAIN)
    with dsl.Elif(p["train_reward_model"] == True, name="reward-model"):  # noqa: E712
        reward = c.reward(shards=shards, **params.stage_values("reward", p), **state)
        reward_model = configure(reward, "reward", TRAIN).outputs["model"]
        ppo = c.ppo(shards=shards, policy=initial_policy, reward=reward_model, **ppo_values)
        configure(ppo, "ppo", TRAIN)
    with dsl.Else(name="reward-functions"):
        # No reward model: the reward functions alone score the rollouts.
        scored = configure(c.ppo(shards=shards, policy=initial_policy, **ppo_values), "ppo", TRAIN)
    aligned = dsl.OneOf(dpo.outputs["Output"], ppo.outputs["Output"], scored.outputs["Output"])
    evaluate = c.evaluate(
        shards=shards, policy=aligned, reference=initial_policy, anchor=anchor,
        reward_model=p["eval_reward_model"], **params.stage_values("evaluate", p),
    )  # fmt: skip
    configure(evaluate, "evaluate", TRAIN)

    # A pipeline condition (compiled to the backend), not a Python comparison.
    with dsl.If(evaluate.outputs["Output"] == True, name="blessed"):  # noqa: E712
        promote = c.promote(
            policy=aligned, evaluation=evaluate.outputs["evaluation"], sources=sources,
            run_id=dsl.PIPELINE_JOB_NAME_PLACEHOLDER,
            promoted_policy_uri=p["promoted_policy_uri"], registry_model=p["registry_model"],
        )  # fmt: skip
        # Never cached: a promotion is a side effect (a new version, CURRENT moved), and a
        # cache hit would report it done without doing it.
        configure(promote, "promote", LIGHT, cache=False)
    return evaluate.outputs["result"]
