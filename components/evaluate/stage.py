"""The evaluate stage: sample both policies on the eval prompts, measure, gate and report.

The judge scores the responses: the reward model when one is given, else the gold reward
(a DPO run has no reward model). Rewards are the judge's raw scores (no normalization): the
win rate and the EOS and length figures do not depend on it, and raw scores stay comparable
with the reward stage's own figures. With the gold reward as the judge, the win rate, the
reward figures and the best-of-n selection are all by gold (best-of-n then is the oracle
baseline: what a perfect reward model's selection would gain), and the reward model's
accuracy on held-out pairs is not measured.

KL(aligned ‖ reference) is the k3 estimate on the aligned policy's samples (unbiased, never
below 0, a fifth of k1's spread: measures.log_ratio_sums), both log-probs recomputed by one
forward pass each (not the sampler's cached ones), so two identical policies give exactly 0.
Both log-probs are at the sampling temperature T, as the samples are drawn: the figure is
KL(aligned_T ‖ reference_T), in the units of the best-of-n baseline drawn from reference_T.
With greedy decoding the log-probs are untempered and the figure is the mean log-ratio (k1)
on the greedy responses.

The best-of-n baseline draws max(n) samples per prompt from the reference (its first
``samples_per_prompt`` are the ones the win rate compares); the judge keeps the best
of the first n. Its KL is computed exactly from the judge's scores of the draws
(best_of_n.py), beside the analytic bound log n − (n − 1)/n nats per sequence.

Every host reads every eval shard; sampling is split over the devices of every host and
gathered back (core.model.eval_sampling), scoring runs whole on each host, so every host computes
the same figures and process 0 writes the outputs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from components.core import fileio
from components.core.data import builtin_task
from components.core.data.gold import GoldReward, is_builtin, resolve_gold_reward
from components.core.data.input_pipeline import (
    DataError,
    check_vocab,
    longest_response,
    read_manifest,
)
from components.core.data.tokenizers import Tokenizer, load_tokenizer
from components.core.model import eval_sampling
from components.core.model.artifact import (
    ModelMismatchError,
    check_tokenizer,
    load_model,
    require_policy,
)
from components.core.rewards.members import Members, read_stats, reward_members
from components.core.training.checkpoint import read_model_config
from components.core.training.distributed import maybe_initialize
from components.evaluate import anchor, generation, run_info, verifiable_stage
from components.evaluate.config import EvalConfig
from components.evaluate.gate import Gate, decide
from components.evaluate.measures import (
    JUDGE_GOLD,
    JUDGE_REWARD_MODEL,
    BestOfNDraws,
    PolicyOutputs,
    ends_with_eos,
    gold_scores,
    kl_estimator,
    log_ratio_sums,
    summarize,
)
from components.evaluate.outputs import sample_rows, write_outputs
from components.evaluate.overoptimisation import measure_overoptimisation
from components.evaluate.report import json_ready, select_samples
from components.hf.importer import resolve_base

log = logging.getLogger(__name__)


class Inputs(NamedTuple):
    """The checked inputs: the shards' manifest and the gold reward's spec ('' for none)."""

    manifest: dict[str, Any]
    gold_name: str


class PolicyResult(NamedTuple):
    """One policy's responses on the eval prompts and their scores."""

    responses: eval_sampling.Responses
    texts: list[str]  # [P * S], row order
    rewards: np.ndarray  # [P, S] the judge's raw scores (reward model, else gold)
    gold: np.ndarray | None  # [P, S]

    def first(self, count: int) -> PolicyResult:
        """The first ``count`` samples of every prompt."""
        prompts, samples = self.rewards.shape
        texts = [self.texts[p * samples + s] for p in range(prompts) for s in range(count)]
        responses = eval_sampling.Responses(*(part[:, :count] for part in self.responses))
        gold = None if self.gold is None else self.gold[:, :count]
        return PolicyResult(responses, texts, self.rewards[:, :count], gold)


class Measured(NamedTuple):
    """What ``measure`` found: the summary, the report's sample rows and every sample's row."""

    summary: dict[str, Any]
    report_samples: list[dict[str, Any]]
    sample_rows: list[dict[str, Any]]


def model_dirs(
    policy_dir: str, reference_dir: str, reward_dir: str, anchor_dir: str = ""
) -> dict[str, str]:
    """Each model's folder by role; no "reward" role when ``reward_dir`` is empty, no
    "anchor" role when ``anchor_dir`` is empty or the reference (its figures are the
    reference's then)."""
    dirs = {"policy": policy_dir, "reference": reference_dir}
    if reward_dir:
        dirs["reward"] = reward_dir
    if anchor_dir and anchor_dir.rstrip("/") != reference_dir.rstrip("/"):
        dirs["anchor"] = anchor_dir
    return dirs


def judge_of(roles: Collection[str]) -> str:
    """Who scores the responses: the reward model when it is among ``roles``, else gold."""
    return JUDGE_REWARD_MODEL if "reward" in roles else JUDGE_GOLD


def check_inputs(config: EvalConfig, shards_dir: str, dirs: dict[str, str]) -> Inputs:
    """Refuse missing artifacts, foreign tokenizers, models in the wrong role and a run with
    no judge (neither a reward model nor a gold reward), before loading."""
    manifest = read_manifest(shards_dir)
    if not manifest.get("splits", {}).get("eval", {}).get("unique_prompts"):
        raise DataError(
            f"the eval split of {shards_dir} has no prompts; re-shard with eval_fraction > 0"
        )
    gold_name = gold_reward_name(config, manifest)
    if "reward" not in dirs and not gold_name:
        raise ValueError(
            f"nothing to judge the responses with: no reward model (reward_dir is empty) and "
            f"no gold reward (gold_reward is empty and the manifest of {shards_dir} names no "
            "built-in one); pass --reward-model (a reward model folder) or --gold-reward (a "
            f"built-in name such as {builtin_task.GOLD_REWARD_NAME}, PATH.py:FUNCTION or "
            "MODULE:FUNCTION)"
        )
    infos = {role: read_model_config(folder) for role, folder in dirs.items()}
    for role, info in infos.items():
        check_tokenizer(info, manifest, dirs[role])
        check_vocab(manifest, int(info["model"]["vocab_size"]))
    if "reward" in infos and not infos["reward"].get("scalar_head"):
        raise ModelMismatchError(
            f"{dirs['reward']} has no reward head (stage {infos['reward'].get('stage')!r}); "
            "pass the reward stage's model as --reward-model"
        )
    for role in ("policy", "reference", "anchor"):
        if role in infos:
            require_policy(infos[role], dirs[role], f"--{role}")
    return Inputs(manifest, gold_name)


def gold_reward_name(config: EvalConfig, manifest: dict[str, Any]) -> str:
    """The gold reward to score with: the config's, else the manifest's if it is built in.

    A spec that runs code (``PATH.py:FUNCTION``, ``MODULE:FUNCTION``) is taken only from the
    user's config, never from the data.
    """
    if config.gold_reward:
        return config.gold_reward
    name = manifest.get("gold_reward") or ""
    if name and not is_builtin(name):
        log.warning(
            "the data names gold reward %r, which is not built in: gold measures skipped "
            "(pass --gold-reward to score with your own)",
            name,
        )
        return ""
    return name


def sequence_lengths(
    config: EvalConfig, manifest: dict[str, Any], models: dict[str, generation.LoadedModel]
) -> tuple[int, int | None]:
    """Prompt length for sampling, and pair length for scoring the eval pairs, in tokens.

    The pair length is None without a reward model: no eval pairs are scored then.
    """
    prompt_len = generation.prompt_length(config.max_new_tokens, manifest, models)
    if "reward" not in models:
        return prompt_len, None
    lengths = manifest["splits"]["eval"].get("token_lengths", {})
    longest_prompt = int(lengths.get("prompt", {}).get("max", prompt_len))
    longest_response = max(int(lengths.get(k, {}).get("max", 0)) for k in ("chosen", "rejected"))
    pair_len = min(models["reward"].config.max_seq_len, longest_prompt + longest_response)
    return prompt_len, max(pair_len, 2)


def load_models(
    dirs: dict[str, str], seed: int, *, sharded: bool = False
) -> dict[str, generation.LoadedModel]:
    """Every model of ``dirs``, split and placed on the local devices (in chunks when
    ``sharded``); only the reward model has a scalar head."""
    return {
        role: generation.prepare(
            load_model(folder, scalar_head=role == "reward", seed=seed)[0], sharded=sharded
        )
        for role, folder in dirs.items()
    }


def decode(tokenizer: Tokenizer, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """Text of every row of [..., T] tokens, keeping only the masked-in ones."""
    length = tokens.shape[-1]
    rows = zip(tokens.reshape(-1, length), mask.reshape(-1, length), strict=True)
    return [tokenizer.decode(row[row_mask != 0].tolist()) for row, row_mask in rows]


def run_policy(
    role: str,
    models: dict[str, generation.LoadedModel],
    prompts: eval_sampling.Prompts,
    prompt_texts: list[str],
    *,
    samples: int,
    config: EvalConfig,
    settings: eval_sampling.SamplingSettings,
    tokenizer: Tokenizer,
    gold: GoldReward | None,
) -> PolicyResult:
    """Sample ``samples`` responses per prompt of ``role``; score them (reward model, gold).

    Without a reward model the gold scores are the rewards too: the gold reward judges.
    """
    policy = models[role]
    responses = eval_sampling.sample_responses(
        policy.graphdef, policy.params, prompts, settings=settings, samples_per_prompt=samples,
        seed=config.seed, batch_size=config.batch_size, stage="evaluate",
    )  # fmt: skip
    texts = decode(tokenizer, responses.tokens, responses.mask)
    gold_rewards = None
    if gold is not None:
        repeated = [p for p in prompt_texts for _ in range(samples)]
        gold_rewards = gold_scores(gold, repeated, texts).reshape(responses.mask.shape[:2])
    if "reward" not in models:
        if gold_rewards is None:
            raise ValueError("no reward model and no gold reward: nothing scores the responses")
        return PolicyResult(responses, texts, gold_rewards, gold_rewards)
    rewards = generation.response_rewards(
        models["reward"], prompts, responses, batch_size=config.batch_size
    )
    return PolicyResult(responses, texts, rewards, gold_rewards)


def _outputs(result: PolicyResult, eos_id: int | tuple[int, ...]) -> PolicyOutputs:
    """What ``summarize`` reads of one policy."""
    tokens, mask = result.responses
    ended = ends_with_eos(tokens, mask, eos_id).reshape(mask.shape[:2])
    return PolicyOutputs(result.rewards, mask, ended, result.gold)


def report_samples(
    prompt_texts: list[str], aligned: PolicyResult, reference: PolicyResult, config: EvalConfig
) -> list[dict[str, Any]]:
    """The report's sample rows, drawn from every (prompt, sample) pair."""
    repeated = [p for p in prompt_texts for _ in range(config.samples_per_prompt)]
    has_gold = aligned.gold is not None and reference.gold is not None
    return select_samples(
        repeated, aligned.texts, reference.texts, aligned.rewards.reshape(-1),
        reference.rewards.reshape(-1), num=config.num_report_samples, seed=config.seed,
        aligned_gold=aligned.gold.reshape(-1) if has_gold else None,
        reference_gold=reference.gold.reshape(-1) if has_gold else None,
    )  # fmt: skip


def _sampling(config: EvalConfig, tokenizer: Tokenizer) -> eval_sampling.SamplingSettings:
    return eval_sampling.SamplingSettings(
        max_new_tokens=config.max_new_tokens, eos_id=tokenizer.stop_ids, pad_id=tokenizer.pad_id,
        temperature=0.0 if config.greedy else config.temperature,
        vocab_size=tokenizer.vocab_size,
    )  # fmt: skip


def sample_both(
    config: EvalConfig,
    models: dict[str, generation.LoadedModel],
    prompts: eval_sampling.Prompts,
    prompt_texts: list[str],
    *,
    tokenizer: Tokenizer,
    gold: GoldReward | None,
) -> tuple[PolicyResult, PolicyResult]:
    """Aligned samples, and the reference's: as many as the win rate or best-of-n needs."""
    settings = _sampling(config, tokenizer)
    common = dict(config=config, settings=settings, tokenizer=tokenizer, gold=gold)
    aligned = run_policy(
        "policy", models, prompts, prompt_texts, samples=config.samples_per_prompt, **common
    )
    # Sampled at least twice: sample 0 of both policies shares its key, so one draw each
    # would leave no independent pair for the win rate.
    draws = max(config.samples_per_prompt, *config.best_of_n_sizes(), 1 if config.greedy else 2)
    reference = run_policy("reference", models, prompts, prompt_texts, samples=draws, **common)
    return aligned, reference


def measure(
    config: EvalConfig,
    shards_dir: str,
    manifest: dict[str, Any],
    models: dict[str, generation.LoadedModel],
    *,
    tokenizer: Tokenizer,
    gold_name: str,
    members: Members | None = None,
    proxy_stats: dict[str, Any] | None = None,
) -> Measured:
    """Sample both policies on the eval prompts and measure them: summary and sample rows.
    ``members``: the judge's held-out model and ensemble (core/rewards/members.py), scored beside
    it with ``proxy_stats`` (its own eval statistics): overoptimisation.py."""
    prompt_len, pair_len = sequence_lengths(config, manifest, models)
    prompts = eval_sampling.eval_prompts(
        shards_dir, prompt_len=prompt_len, max_prompts=config.max_eval_prompts
    )
    prompt_texts = decode(tokenizer, prompts.tokens, prompts.mask)
    gold = resolve_gold_reward(gold_name) if gold_name else None
    aligned, drawn = sample_both(
        config, models, prompts, prompt_texts, tokenizer=tokenizer, gold=gold
    )
    reference = drawn.first(config.samples_per_prompt)
    # Both log-probs of the aligned samples by the same forward pass: identical policies give 0.
    temperature = 1.0 if config.greedy else config.temperature
    logprobs = {
        role: generation.policy_logprobs(
            models[role],
            prompts,
            aligned.responses,
            temperature=temperature,
            batch_size=config.batch_size,
        )  # fmt: skip
        for role in ("policy", "reference", "anchor")
        if role in models
    }
    chosen, rejected = None, None  # the reward model's accuracy needs a reward model
    if pair_len is not None:
        chosen, rejected = generation.eval_pair_rewards(
            models["reward"], shards_dir, max_len=pair_len, batch_size=config.batch_size
        )
    summary = summarize(
        _outputs(aligned, tokenizer.stop_ids), _outputs(reference, tokenizer.stop_ids),
        aligned_logprobs=logprobs["policy"], reference_logprobs=logprobs["reference"],
        config=config, chosen_rewards=chosen, rejected_rewards=rejected, gold_name=gold_name,
        best_of_n_draws=BestOfNDraws(drawn.rewards, drawn.gold), judge=judge_of(models),
    )  # fmt: skip
    summary["overoptimisation"] = measure_overoptimisation(
        config, models, prompts, (aligned, reference), members or Members(), proxy_stats
    )
    summary["anchor"] = measure_anchor(
        config, models, prompts, prompt_texts, aligned, logprobs, summary,
        tokenizer=tokenizer, gold=gold,
    )  # fmt: skip
    rows = sample_rows(
        prompt_texts,
        (aligned.texts, aligned.rewards, aligned.gold),
        (reference.texts, reference.rewards, reference.gold),
    )
    # Each aligned sample's KL to the reference (nats, the summary's estimator) and tokens:
    # intervals and paired comparisons of KL per token can be drawn from samples.jsonl.
    kl, tokens = log_ratio_sums(
        logprobs["policy"], logprobs["reference"], aligned.responses[1], kl_estimator(config)
    )
    for row, row_kl, row_tokens in zip(rows, kl.reshape(-1), tokens.reshape(-1), strict=True):
        row["aligned_kl"], row["aligned_tokens"] = float(row_kl), int(row_tokens)
    return Measured(summary, report_samples(prompt_texts, aligned, reference, config), rows)


def measure_anchor(
    config: EvalConfig,
    models: dict[str, generation.LoadedModel],
    prompts: eval_sampling.Prompts,
    prompt_texts: list[str],
    aligned: PolicyResult,
    logprobs: dict[str, np.ndarray],
    summary: dict[str, Any],
    *,
    tokenizer: Tokenizer,
    gold: GoldReward | None,
) -> dict[str, Any]:
    """The summary's anchor part: KL to the anchor from its log-probs of the aligned samples,
    the win rate against one anchor sample per prompt; the reference's figures when the
    anchor is the reference (no "anchor" model loaded)."""
    if "anchor" not in models:
        return anchor.from_reference(summary, "")
    drawn = run_policy(
        "anchor", models, prompts, prompt_texts, samples=anchor.anchor_draws(config),
        config=config, settings=_sampling(config, tokenizer), tokenizer=tokenizer, gold=gold,
    )  # fmt: skip
    return anchor.anchor_summary(
        _outputs(aligned, tokenizer.stop_ids), drawn.rewards, drawn.gold,
        aligned_logprobs=logprobs["policy"], anchor_logprobs=logprobs["anchor"],
        config=config, uri="",
    )  # fmt: skip


def run(
    config: EvalConfig,
    shards_dir: str,
    policy_dir: str,
    reference_dir: str,
    reward_dir: str,
    output: str,
    *,
    anchor_dir: str = "",
    past: Sequence[Mapping[str, Any]] = (),
    run_id: str = "",
) -> dict[str, Any]:
    """Evaluate ``policy_dir`` against ``reference_dir``; write the report; return the figures.

    ``reward_dir`` is the reward model that judges the responses, or '' for none: the gold
    reward (``config.gold_reward``, else the shards' built-in one) then judges them, so the
    win rate, the reward figures and the best-of-n selection are by gold (best-of-n becomes
    the oracle baseline) and the reward model's accuracy is None. With neither, a ValueError
    says so before any model loads. The result is the summary (as in eval.json, ``judge``
    "reward_model" or "gold") plus ``blessed``; ``output`` receives report.html, eval.json,
    metrics.json and samples.jsonl.

    ``anchor_dir``: the policy drift is measured from (``summary["anchor"]``: KL to it, win
    rate and gold gain against it; '' = the reference); ``past``: earlier promotions' drift
    rows (``anchor.drift_row``) for the report's drift table. ``run_id``: the pipeline run's,
    for the report's header (``summary["run"]``, run_info.py).

    With ``config.reward_functions`` the evaluation is the verifiable one instead
    (verifiable_stage.py: accuracy and pass@k by the first reward function); ``reward_dir``,
    ``anchor_dir`` and ``past`` are then not used.
    """
    if config.reward_functions:
        for name, given in (("reward_dir", reward_dir), ("anchor_dir", anchor_dir)):
            if given:
                log.info("%s %s is not used: reward functions judge the evaluation", name, given)
        return verifiable_stage.run(
            config, shards_dir, policy_dir, reference_dir, output, run_id=run_id
        )
    maybe_initialize()
    dirs = model_dirs(policy_dir, reference_dir, reward_dir, anchor_dir)
    # Checked before any model loads: an output that cannot be written fails now, not after
    # the sampling and scoring.
    if fileio.exists(output) and not fileio.isdir(output):
        raise NotADirectoryError(f"--output {output} is a file; pass a folder for the report")
    # A Hugging Face folder (the reference or anchor of a run that aligned one as given) is
    # imported into the output's work folder for the evaluation and removed after it.
    work = fileio.join(output, "work")
    loaded = {role: resolve_base(d, fileio.join(work, role)) for role, d in dirs.items()}
    inputs = check_inputs(config, shards_dir, loaded)
    fileio.makedirs(output)
    if not config.max_new_tokens:
        longest = longest_response(inputs.manifest, shards_dir, "evaluate")
        config = dataclasses.replace(config, max_new_tokens=longest)
    tokenizer = load_tokenizer(fileio.join(shards_dir, "tokenizer"))
    members = reward_members(loaded.get("reward", ""))
    measured = measure(
        config, shards_dir, inputs.manifest, load_models(loaded, config.seed, sharded=config.fsdp),
        tokenizer=tokenizer, gold_name=inputs.gold_name, members=members,
        proxy_stats=read_stats(loaded["reward"]) if "reward" in loaded else None,
    )  # fmt: skip
    summary = measured.summary
    summary["run"] = run_info.describe(read_model_config(loaded["policy"]), run_id)
    fileio.remove_tree(work)
    summary["anchor"].update(uri=anchor_dir or reference_dir, past=[dict(row) for row in past])
    summary["judge_model"] = reward_dir or None  # which reward model judged, when one did
    gate = decide(summary, config)
    write_outputs(
        output, summary, gate, dirs=dirs, samples=measured.report_samples,
        all_samples=measured.sample_rows, config=config,
    )  # fmt: skip
    _log_verdict(summary, gate, output)
    return {**json_ready(summary), "blessed": gate.blessed}


def _log_verdict(summary: dict[str, Any], gate: Gate, output: str) -> None:
    """One line with the headline figures, then the gate's reasons."""
    win = summary["win_rate"]
    log.info(
        "%d prompts: win rate %.3f [%.3f, %.3f] (judge: %s), KL %.4f nats/token: %s; "
        "report in %s",
        summary["num_prompts"], win["value"], win["low"], win["high"], summary["judge"],
        summary["kl"]["per_token"], "blessed" if gate.blessed else "not blessed", output,
    )  # fmt: skip
    if summary.get("ppo_vs_best_of_n") is not None:
        log.info(
            "gold gain %.1f%% of best-of-n's at the same KL per sequence%s",
            100 * summary["ppo_vs_best_of_n"],
            " (capped at the largest n)" if summary["ppo_vs_best_of_n_capped"] else "",
        )
    for reason in gate.reasons:
        log.info("gate: %s", reason)
