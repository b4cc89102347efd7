"""bench_overoptimisation's measurement of a run's saved policies: each one's gold, proxy and
held-out scores, KL and length on the eval prompts, and its raw and length-controlled win
rates over the sft policy (``curve``); the last save exported as a model folder
(``export_last``). Imported after ``start_process`` (it imports JAX)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

EVAL_SAMPLES = 8  # samples of each eval prompt, by every saved policy and the sft one


def curve(
    paths: dict[str, str], output: str, seed: int, gold_fn: Callable[[str, str], float]
) -> list[dict[str, float]]:
    """Every saved policy's gold, proxy and held-out scores (z), KL per token (k3) to the sft
    policy and mean length, on the eval prompts (the same keys for every checkpoint); and its
    raw and length-controlled win rates against the sft policy's samples (drawn with those
    keys, so only pairs of independent draws count), by the proxy and by gold."""
    from components.core.data.tokenizers import load_tokenizer
    from components.core.model import eval_sampling
    from components.core.model.artifact import load_model
    from components.core.rewards.members import read_stats, reward_members, standardize
    from components.core.training import parallel
    from components.evaluate import generation
    from components.evaluate.measures import independent_pairs

    shards = paths["shards"]
    config, sft_model, template, checkpoints = saved_policies(paths, output)
    tokenizer = load_tokenizer(os.path.join(shards, "tokenizer"))
    prompts = eval_sampling.split_prompts(shards, "eval", prompt_len=config.prompt_len)
    pairs = zip(prompts.tokens, prompts.mask, strict=True)
    texts = [tokenizer.decode(t[m != 0].tolist()) for t, m in pairs]
    settings = eval_sampling.SamplingSettings(
        config.max_new_tokens, tokenizer.stop_ids, tokenizer.pad_id, config.temperature,
        tokenizer.vocab_size,
    )  # fmt: skip
    reference = generation.prepare(sft_model)
    judges = {"proxy": paths["reward"], "heldout": reward_members(paths["reward"]).heldout}
    rewards = {
        name: generation.prepare(load_model(folder, scalar_head=True)[0])
        for name, folder in judges.items()
    }

    def sample(policy: Any) -> dict[str, np.ndarray]:
        """``policy``'s responses, their gold and raw reward-model scores [P, S]."""
        responses = eval_sampling.sample_responses(
            policy.graphdef, policy.params, prompts, settings=settings,
            samples_per_prompt=EVAL_SAMPLES, seed=seed + 12345, batch_size=256,
        )  # fmt: skip
        mask = responses.mask != 0
        scores = {
            name: generation.response_rewards(model, prompts, responses, batch_size=256)
            for name, model in rewards.items()
        }
        scores["gold"] = np.array([
            [gold_fn(texts[p], tokenizer.decode(responses.tokens[p, s][mask[p, s]].tolist()))
             for s in range(EVAL_SAMPLES)]
            for p in range(len(texts))
        ])  # fmt: skip
        return {**scores, "responses": responses, "mask": mask, "length": mask.sum(-1)}

    sft = sample(reference)
    independent = independent_pairs(EVAL_SAMPLES, EVAL_SAMPLES, shared_keys=True)
    rows = []
    for step in checkpoints.all_steps():
        restored = checkpoints.restore_latest(template, np.zeros(2, np.uint32), step=step)
        policy = generation.LoadedModel(
            reference.graphdef, parallel.place(restored.state.policy.params), reference.config
        )
        drawn = sample(policy)
        mask = drawn["mask"]
        row = {"iteration": step, "gold": float(drawn["gold"].mean())}
        for name in rewards:
            row[name] = float(standardize(drawn[name], read_stats(judges[name])).mean())
        for judge_name in ("proxy", "gold"):
            raw, lc = win_rates(drawn, sft, judge_name, independent)
            row[f"{judge_name}_win_rate"], row[f"{judge_name}_lc_win_rate"] = raw, lc
        logprobs = [
            generation.policy_logprobs(
                m, prompts, drawn["responses"], temperature=1.0, batch_size=256
            )
            for m in (policy, reference)
        ]
        log_ratio = np.where(mask, logprobs[0] - logprobs[1], 0.0)
        k3 = np.where(mask, np.expm1(-log_ratio) + log_ratio, 0.0)
        row["kl_per_token"] = float(k3.sum() / mask.sum())
        row["length"] = float(drawn["length"].mean())
        rows.append(row)
    checkpoints.close()
    return rows


def win_rates(
    aligned: dict, reference: dict, judge_name: str, pairs: np.ndarray
) -> tuple[float, float]:
    """The raw and the length-controlled win rate of ``aligned``'s samples over
    ``reference``'s, by ``judge_name``, over the [S, N] ``pairs``: the evaluate stage's
    outcomes and model (``length_control``), without its bootstrap."""
    from components.evaluate import length_control

    outcome, difference = length_control._pairs(
        aligned[judge_name], reference[judge_name], aligned["length"], reference["length"], pairs
    )
    b0, _ = length_control.fit(outcome, difference)
    return float(outcome.mean()), float(1.0 / (1.0 + np.exp(-b0)))


def saved_policies(paths: dict[str, str], output: str) -> tuple[Any, Any, Any, Any]:
    """The ppo run's config, the sft model (the policy's graph), a template of its training
    state and its checkpointer (every save kept)."""
    from flax import nnx

    from components.core.model.artifact import load_model
    from components.core.training.checkpoint import (
        CheckpointConfig,
        TrainCheckpointer,
        training_state_dir,
    )
    from components.ppo import PPOConfig
    from components.ppo.update import PPOState

    info = json.loads(Path(output, "config.json").read_text())
    config = PPOConfig(**{**info["training"], "report_to": "none"})
    model, _ = load_model(paths["sft"])
    critic = None  # grpo and rloo train none
    if not config.uses_groups:
        critic = jax.device_get(
            nnx.split(load_model(paths["reward"], scalar_head=True)[0], nnx.Param)[1]
        )
    template = PPOState.create(jax.device_get(nnx.split(model, nnx.Param)[1]), critic, config)
    checkpoints = TrainCheckpointer(training_state_dir(output), CheckpointConfig(keep=1000))
    return config, model, template, checkpoints


def export_last(paths: dict[str, str], output: str, root: Path) -> str:
    """The last saved policy as a model folder (the stage outputs the selected one)."""

    from components.core.model.artifact import save_model
    from components.core.training.checkpoint import read_model_config

    config, model, template, checkpoints = saved_policies(paths, output)
    restored = checkpoints.restore_latest(template, np.zeros(2, np.uint32))
    checkpoints.close()
    last = str(root / "last")
    save_model(
        last, model, restored.state.policy.params,
        tokenizer=read_model_config(paths["sft"])["tokenizer"], stage="ppo",
        training=dataclasses.asdict(config), step=restored.step,
        tokenizer_dir=os.path.join(paths["shards"], "tokenizer"),
    )  # fmt: skip
    return last
