"""The built-in tasks a run can generate (``data_uri`` ''), and the parameters each sets.

``task`` '' is the preference task (``components/core/data/builtin_task.py``): the
pipeline's defaults are its, with a held-out reward model (``PREFERENCE``). ``arithmetic``
is the reasoning task (``components/core/data/reasoning_task.py``): every problem once as a
prompt with its answer, a few formatted solutions for the sft warm start, GRPO scored by
``builtin/exact-match`` alone (no reward stage), and the verifiable evaluation on the
eval split's problems. Its settings are below; a flag or config file value overrides any.
"""

from __future__ import annotations

from typing import Any

# Chosen on the demo preset: sft of 150 steps on 64 solutions left the held-out problems at
# 0.39 greedy accuracy (seed 0), and 300 GRPO iterations at 1e-4 raised them to 0.71; but
# seed 2 stayed at 0.48 through 400 (its sampled train accuracy 0.49 -> 0.59), and neither a
# rate of 3e-4 without std scaling nor operands 0..29 moved it (0.44-0.51, +0.08). With 128
# solutions (reasoning_task.write_task's) seed 2 rose from 0.52 to 0.71 by 400 iterations and
# was still rising, hence 500.
ARITHMETIC: dict[str, Any] = {
    # A quarter of the 450 problems held out (by prompt hash, the same in the prompt and
    # the solution shards): about 112 eval problems; sft reads its eval split in 8s.
    "eval_fraction": 0.25,
    "min_eval_pairs": 8,
    "sft_steps": 150,
    "sft_batch_size": 8,
    "sft_learning_rate": 3e-3,
    "algorithm": "grpo",
    "group_size": 8,
    "train_reward_model": False,
    "reward_functions": "builtin/exact-match",
    "ppo_iterations": 500,
    "ppo_rollout_batch_size": 128,
    "ppo_learning_rate": 1e-4,
    "max_new_tokens": 6,
    # A verifiable reward's usual setting (TRL's GRPO beta 0, DAPO): no KL penalty; the
    # guard's bound is raised to match, so only a non-finite run trips it.
    "adaptive_kl": False,
    "kl_coef": 0.0,
    "kl_stop": 50.0,
    "max_kl": 50.0,
    "eval_max_new_tokens": 6,
}
# The preference task (the demo) watches itself for reward hacking: a fifth of its prompts
# train a held-out reward model (docs/stages.md, over-optimisation). Measured on this 2-core
# host (2026-12-05, `alignpipe run` and `alignpipe run --heldout-reward 0.2` one after the
# other): 285 s and 363 s (+27%; the reward stage 71 s -> 150 s, ppo 138 s -> 141 s), the same
# gold gain (+0.283 both), blessed both; under the 30%, so on.
PREFERENCE: dict[str, Any] = {"heldout_reward": 0.2}
TASKS: dict[str, dict[str, Any]] = {"": PREFERENCE, "arithmetic": ARITHMETIC}


def with_task(values: dict[str, Any], sources: dict[str, str]) -> tuple[dict, dict]:
    """``values`` over the defaults of the task they name (the built-in preference task's
    only when it is generated: ``data_uri`` ''), and where each value came from."""
    task = values.get("task", "")
    generated = task or not values.get("data_uri")
    defaults = TASKS.get(task, {}) if generated else {}
    if not monitors_fit(values):
        defaults = {k: v for k, v in defaults.items() if k != "heldout_reward"}
    return {**defaults, **values}, {name: "task" for name in defaults} | sources


def monitors_fit(values: dict[str, Any]) -> bool:
    """Whether a run can hold the preference task's held-out reward model: it trains a reward
    model, without fsdp (params._check_monitors), and no run preset sizes it for a slice (a
    preset's model is a real one; its data is not the demo's). Where one cannot, the run goes
    on without it, as the pipeline's own defaults have it."""
    trains_none = values.get("algorithm") == "dpo" or values.get("train_reward_model") is False
    return not (trains_none or values.get("fsdp") or values.get("run_preset"))
