"""The pipeline's stages as the run reports them: their order, what each depends on, the
tasks that stand for each, and the run's one output. Plain data, for the DAG (pipeline.py),
the CLI's flags and the local run's progress lines alike."""

from __future__ import annotations

STAGES = ("data", "plan", "shard", "sft", "reward", "ppo", "dpo", "evaluate", "promote")
RESULT = "result"  # the run's one output
UPSTREAM = {
    "plan": ("data",),
    "shard": ("plan",),
    "sft": ("shard",),
    "reward": ("shard",),
    "ppo": ("sft", "reward"),
    "dpo": ("sft",),
    "evaluate": ("ppo", "dpo"),
    "promote": ("evaluate",),
}
# Task names (as kfp names them after their components) of each stage.
STAGE_TASKS = {
    "data": ("builtin-data", "find-data"),
    # Never cached: whether the data is new, the anchor, and whether sft trains (and the base
    # policy's fingerprint) are read afresh each run.
    "plan": ("plan-run", "no-new-data", "check-policy"),
    "shard": ("shard",),
    # given-policy stands for sft on warm starts.
    "sft": ("sft", "given-policy"),
    "reward": ("reward",),
    # ppo-2: the ppo task of a run whose reward functions alone score the rollouts.
    "ppo": ("ppo", "ppo-2"),
    "dpo": ("dpo",),
    "evaluate": ("evaluate",),
    "promote": ("promote",),
}


def downstream(stage: str) -> tuple[str, ...]:
    """``stage`` and every stage that depends on it, in pipeline order."""
    if stage not in STAGES:
        raise ValueError(f"stage: {stage!r} is unknown; use one of {STAGES}")
    found = {stage}
    for name in STAGES:
        if any(up in found for up in UPSTREAM.get(name, ())):
            found.add(name)
    return tuple(s for s in STAGES if s in found)
