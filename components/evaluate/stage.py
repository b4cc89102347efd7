"""The evaluate stage: sample both policies on the eval prompts, measure, gate and report.

Rewards are the reward model's raw scores (no normalization): the win rate and the EOS and
length figures do not depend on it, and raw scores stay comparable with the reward stage's
own figures. KL(aligned ‖ reference) is the k1 estimate on the aligned policy's samples,
both log-probs recomputed by one forward pass each (not the sampler's cached ones), so two
identical policies give exactly 0. With temperature ≠ 1 or greedy decoding the samples do not
come from the aligned policy itself, and the figure is the mean log-ratio on those responses.

Every host computes the same figures from every eval shard; process 0 writes the outputs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, NamedTuple

import numpy as np

from components.core import builtin_task, fileio
from components.core.checkpoint import read_model_config
from components.core.distributed import is_primary, maybe_initialize
from components.core.input_pipeline import DataError, check_vocab, longest_lengths, read_manifest
from components.core.metrics import read_metrics
from components.core.model_io import ModelMismatchError, check_tokenizer, load_model
from components.core.tokenizers import Tokenizer, load_tokenizer
from components.evaluate import generation
from components.evaluate.config import EvalConfig
from components.evaluate.gate import Gate, decide
from components.evaluate.measures import PolicyOutputs, ends_with_eos, gold_scores, summarize
from components.evaluate.report import json_ready, select_samples, write_report

log = logging.getLogger(__name__)
METRICS_JSON_FILE = "metrics.json"
ROLES = ("policy", "reference", "reward")


class Inputs(NamedTuple):
    """The checked inputs: the shards' manifest and the gold reward's name ('' for none)."""

    manifest: dict[str, Any]
    gold_name: str


class PolicyResult(NamedTuple):
    """One policy's responses on the eval prompts and their scores."""

    responses: generation.Responses
    texts: list[str]  # [P * S], row order
    rewards: np.ndarray  # [P, S] raw reward-model scores
    gold: np.ndarray | None  # [P, S]


def check_inputs(config: EvalConfig, shards_dir: str, dirs: dict[str, str]) -> Inputs:
    """Refuse missing artifacts, foreign tokenizers and models in the wrong role, before loading."""
    manifest = read_manifest(shards_dir)
    if not manifest.get("splits", {}).get("eval", {}).get("unique_prompts"):
        raise DataError(
            f"the eval split of {shards_dir} has no prompts; re-shard with eval_fraction > 0"
        )
    infos = {role: read_model_config(dirs[role]) for role in ROLES}
    for role in ROLES:
        check_tokenizer(infos[role], manifest, dirs[role])
        check_vocab(manifest, int(infos[role]["model"]["vocab_size"]))
    if not infos["reward"].get("scalar_head"):
        raise ModelMismatchError(
            f"{dirs['reward']} has no reward head (stage {infos['reward'].get('stage')!r}); "
            "pass the reward stage's model as --reward"
        )
    for role in ("policy", "reference"):
        if infos[role].get("stage") == "reward":
            raise ModelMismatchError(
                f"{dirs[role]} is a reward model; pass a policy (sft or ppo output) as --{role}"
            )
    return Inputs(manifest, gold_reward_name(config, manifest))


def gold_reward_name(config: EvalConfig, manifest: dict[str, Any]) -> str:
    """The gold reward to score with: the config's, else the manifest's if it is known."""
    if config.gold_reward:
        return config.gold_reward
    name = manifest.get("gold_reward") or ""
    try:
        if name:
            builtin_task.gold_reward_fn(name)
    except KeyError as error:
        log.warning("%s: gold measures skipped", error.args[0])
        return ""
    return name


def sequence_lengths(
    config: EvalConfig, manifest: dict[str, Any], models: dict[str, generation.LoadedModel]
) -> tuple[int, int]:
    """Prompt length for sampling, and pair length for scoring the eval pairs, in tokens."""
    limit = min(model.config.max_seq_len for model in models.values())
    room = limit - config.max_new_tokens
    if room < 1:
        raise ValueError(
            f"max_new_tokens: {config.max_new_tokens} leaves no room for a prompt within "
            f"the models' max_seq_len of {limit}; lower max_new_tokens"
        )
    lengths = manifest["splits"]["eval"].get("token_lengths", {})
    longest_prompt = int(lengths.get("prompt", {}).get("max", room))
    if longest_prompt > room:
        log.warning("eval prompts over %d tokens are cut from the left", room)
    longest_response = max(int(lengths.get(k, {}).get("max", 0)) for k in ("chosen", "rejected"))
    pair_len = min(models["reward"].config.max_seq_len, longest_prompt + longest_response)
    return max(min(longest_prompt, room), 1), max(pair_len, 2)


def load_models(
    dirs: dict[str, str], seed: int, *, sharded: bool = False
) -> dict[str, generation.LoadedModel]:
    """Every model, split and placed on the local devices (in chunks when ``sharded``)."""
    heads = {"policy": False, "reference": False, "reward": True}
    return {
        role: generation.prepare(
            load_model(dirs[role], scalar_head=heads[role], seed=seed)[0], sharded=sharded
        )
        for role in ROLES
    }


def decode(tokenizer: Tokenizer, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """Text of every row of [..., T] tokens, keeping only the masked-in ones."""
    length = tokens.shape[-1]
    rows = zip(tokens.reshape(-1, length), mask.reshape(-1, length), strict=True)
    return [tokenizer.decode(row[row_mask != 0].tolist()) for row, row_mask in rows]


def run_policy(
    role: str,
    models: dict[str, generation.LoadedModel],
    prompts: generation.Prompts,
    prompt_texts: list[str],
    *,
    config: EvalConfig,
    settings: generation.SamplingSettings,
    tokenizer: Tokenizer,
    gold_name: str,
) -> PolicyResult:
    """Sample ``role``'s responses and score them with the reward model and the gold reward."""
    responses = generation.sample_responses(
        models[role], prompts, settings=settings, samples_per_prompt=config.samples_per_prompt,
        seed=config.seed, batch_size=config.batch_size,
    )  # fmt: skip
    rewards = generation.response_rewards(
        models["reward"], prompts, responses, batch_size=config.batch_size
    )
    texts = decode(tokenizer, responses.tokens, responses.mask)
    gold = None
    if gold_name:
        repeated = [p for p in prompt_texts for _ in range(config.samples_per_prompt)]
        gold = gold_scores(gold_name, repeated, texts).reshape(rewards.shape)
    return PolicyResult(responses, texts, rewards, gold)


def _outputs(result: PolicyResult, eos_id: int) -> PolicyOutputs:
    """What ``summarize`` reads of one policy."""
    tokens, mask = result.responses
    ended = ends_with_eos(tokens, mask, eos_id).reshape(mask.shape[:2])
    return PolicyOutputs(result.rewards, mask, ended, result.gold)


def flat_figures(summary: dict[str, Any], gate: Gate) -> dict[str, float]:
    """Every finite figure of the summary by dotted path (KFP Metrics), plus blessed as 0/1."""
    flat: dict[str, float] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else key)
        elif isinstance(node, int | float) and not isinstance(node, bool):
            flat[path] = float(node)

    # Histogram counts are a plot's data, not figures; None (not measured, non-finite) drops out.
    skip = ("reward_histogram", "schema_version")
    walk({k: v for k, v in json_ready(summary).items() if k not in skip}, "")
    flat["blessed"] = 1.0 if gate.blessed else 0.0
    return flat


def write_outputs(
    output: str,
    summary: dict[str, Any],
    gate: Gate,
    *,
    dirs: dict[str, str],
    samples: list[dict[str, Any]],
) -> None:
    """report.html, eval.json and metrics.json into ``output`` (process 0 only)."""
    if not is_primary():
        return
    write_report(
        output, summary, gate, ppo_metrics=read_metrics(dirs["policy"]) or None,
        reward_metrics=read_metrics(dirs["reward"]) or None, samples=samples,
    )  # fmt: skip
    figures = json.dumps(flat_figures(summary, gate), indent=2, sort_keys=True)
    fileio.write_text(fileio.join(output, METRICS_JSON_FILE), figures + "\n")


def report_samples(
    prompt_texts: list[str], aligned: PolicyResult, reference: PolicyResult, config: EvalConfig
) -> list[dict[str, Any]]:
    """The report's sample rows, one per (prompt, sample) pair drawn."""
    repeated = [p for p in prompt_texts for _ in range(config.samples_per_prompt)]
    has_gold = aligned.gold is not None and reference.gold is not None
    return select_samples(
        repeated, aligned.texts, reference.texts, aligned.rewards.reshape(-1),
        reference.rewards.reshape(-1), num=config.num_report_samples, seed=config.seed,
        aligned_gold=aligned.gold.reshape(-1) if has_gold else None,
        reference_gold=reference.gold.reshape(-1) if has_gold else None,
    )  # fmt: skip


def measure(
    config: EvalConfig,
    shards_dir: str,
    manifest: dict[str, Any],
    models: dict[str, generation.LoadedModel],
    *,
    tokenizer: Tokenizer,
    gold_name: str,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Sample both policies on the eval prompts and measure them: the summary and report samples."""
    prompt_len, pair_len = sequence_lengths(config, manifest, models)
    prompts = generation.load_prompts(
        shards_dir, max_prompts=config.max_eval_prompts, prompt_len=prompt_len
    )
    prompt_texts = decode(tokenizer, prompts.tokens, prompts.mask)
    settings = generation.SamplingSettings(
        max_new_tokens=config.max_new_tokens, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
        temperature=0.0 if config.greedy else config.temperature,
    )  # fmt: skip
    aligned, reference = (
        run_policy(
            role,
            models,
            prompts,
            prompt_texts,
            config=config,
            settings=settings,
            tokenizer=tokenizer,
            gold_name=gold_name,
        )  # fmt: skip
        for role in ("policy", "reference")
    )
    # Both log-probs of the aligned samples by the same forward pass: identical policies give 0.
    logprobs = {
        role: generation.response_logprobs(
            models[role], prompts, aligned.responses, batch_size=config.batch_size
        )
        for role in ("policy", "reference")
    }
    chosen, rejected = generation.eval_pair_rewards(
        models["reward"], shards_dir, max_len=pair_len, batch_size=config.batch_size
    )
    summary = summarize(
        _outputs(aligned, tokenizer.eos_id), _outputs(reference, tokenizer.eos_id),
        aligned_logprobs=logprobs["policy"], reference_logprobs=logprobs["reference"],
        config=config, chosen_rewards=chosen, rejected_rewards=rejected, gold_name=gold_name,
    )  # fmt: skip
    return summary, report_samples(prompt_texts, aligned, reference, config)


def run(
    config: EvalConfig,
    shards_dir: str,
    policy_dir: str,
    reference_dir: str,
    reward_dir: str,
    output: str,
) -> dict[str, Any]:
    """Evaluate ``policy_dir`` against ``reference_dir``; write the report; return the figures.

    The result is the summary (as in eval.json) plus ``blessed``; ``output`` receives
    report.html, eval.json and metrics.json.
    """
    maybe_initialize()
    dirs = {"policy": policy_dir, "reference": reference_dir, "reward": reward_dir}
    inputs = check_inputs(config, shards_dir, dirs)
    if not config.max_new_tokens:
        config = dataclasses.replace(config, max_new_tokens=longest_lengths(inputs.manifest)[1])
    tokenizer = load_tokenizer(fileio.join(shards_dir, "tokenizer"))
    summary, samples = measure(
        config, shards_dir, inputs.manifest, load_models(dirs, config.seed, sharded=config.fsdp),
        tokenizer=tokenizer, gold_name=inputs.gold_name,
    )  # fmt: skip
    gate = decide(summary, config)
    write_outputs(output, summary, gate, dirs=dirs, samples=samples)
    _log_verdict(summary, gate, output)
    return {**json_ready(summary), "blessed": gate.blessed}


def _log_verdict(summary: dict[str, Any], gate: Gate, output: str) -> None:
    """One line with the headline figures, then the gate's reasons."""
    win = summary["win_rate"]
    log.info(
        "%d prompts: win rate %.3f [%.3f, %.3f], KL %.4f nats/token: %s; report in %s",
        summary["num_prompts"], win["value"], win["low"], win["high"],
        summary["kl"]["per_token"], "blessed" if gate.blessed else "not blessed", output,
    )  # fmt: skip
    for reason in gate.reasons:
        log.info("gate: %s", reason)
