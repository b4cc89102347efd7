"""The evaluate stage on a verifiable task: reward functions check each answer, no reward model.

On the eval split's prompts (at most ``max_eval_prompts``) each policy, the aligned one and
its reference, gives a greedy response (temperature 0) and ``pass_samples`` responses sampled
at ``temperature`` (the two policies share keys: common random numbers). Each response is
decoded up to its stop token and scored by the reward functions (``reward_functions``, TRL's
``reward_funcs``, called as the ppo stage calls them). A response is *correct* when the FIRST
function, the verifier (e.g. ``builtin/exact-match``), gives it full marks: a reward >= 1.0;
a response it does not judge (None) is not correct.

The figures (``verifiable.verifiable_summary``): accuracy of the greedy responses, pass@k of
the samples, length and stop figures, and the accuracy gain over the reference with a paired
bootstrap interval; beside them each function's mean on both policies' greedy responses and
KL(aligned ‖ reference) per token, k3 on the aligned samples (k1 on the greedy responses
without samples), both log-probs recomputed, so two identical policies give exactly 0.

The gate (verifiable_report.decide) blesses iff the accuracy gain's lower interval bound >
``min_accuracy_gain``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Any, NamedTuple

import numpy as np

from components.core import fileio
from components.core.data.input_pipeline import (
    DataError,
    check_vocab,
    longest_response,
    read_manifest,
)
from components.core.data.prompts import prompt_dataset
from components.core.data.tokenizers import Tokenizer, load_tokenizer
from components.core.model import eval_sampling
from components.core.model.artifact import check_tokenizer, load_model, require_policy
from components.core.rewards.completions import (
    as_completion,
    columns_of,
    completion,
    is_conversational,
)
from components.core.rewards.functions import load_reward_functions
from components.core.rewards.scoring import RewardScorer
from components.core.training.checkpoint import read_model_config
from components.core.training.distributed import maybe_initialize
from components.evaluate import generation, run_info, verifiable_report
from components.evaluate.config import EvalConfig
from components.evaluate.kl import sequence_kl
from components.evaluate.measures import ends_with_eos
from components.evaluate.report import eval_record, json_ready
from components.evaluate.verifiable import verifiable_summary
from components.hf.importer import resolve_base

log = logging.getLogger(__name__)

ROLES = ("policy", "reference")
FULL_MARKS = 1.0  # the verifier's reward at or above which a response is correct


class EvalPrompts(NamedTuple):
    """The eval prompts, left-padded, with each one's text and record columns."""

    prompts: eval_sampling.Prompts
    texts: list[str]
    columns: list[dict[str, Any]]


class Answers(NamedTuple):
    """One policy's responses and their rewards [prompts, samples, functions] (NaN = not
    judged); ``sampled`` and ``sampled_rewards`` are None without pass samples."""

    greedy: eval_sampling.Responses  # [P, 1, N]
    greedy_texts: list[str]  # [P]
    greedy_rewards: np.ndarray  # [P, 1, F]
    sampled: eval_sampling.Responses | None  # [P, S, N]
    sampled_rewards: np.ndarray | None  # [P, S, F]


def read_prompts(shards_dir: str, *, prompt_len: int, max_prompts: int) -> EvalPrompts:
    """The first ``max_prompts`` unique eval prompts, in shard order (as eval_sampling's)."""
    batches = prompt_dataset(
        shards_dir, "eval", batch_size=1, prompt_len=prompt_len, seed=0, host_index=0,
        host_count=1, shuffle=False, repeat=False, with_text=True,
    )  # fmt: skip
    texts = batches.texts[:max_prompts]
    return EvalPrompts(
        eval_sampling.Prompts(batches.tokens[:max_prompts], batches.masks[:max_prompts]),
        [str(text) for text in texts[:, 0]],
        [json.loads(columns) for columns in texts[:, 1]],
    )


class Scoring(NamedTuple):
    """The reward functions and what they are called with (as the ppo stage calls them)."""

    scorer: RewardScorer
    tokenizer: Tokenizer
    conversational: bool  # completions as one assistant message each, as TRL passes them
    max_new_tokens: int

    def __call__(
        self, prompts: EvalPrompts, responses: eval_sampling.Responses
    ) -> tuple[np.ndarray, list[str]]:
        """Each function's reward [P, S, F] of every response (NaN = not judged), and the
        responses' texts [P * S]."""
        count, samples, length = responses.tokens.shape
        flat = zip(
            responses.tokens.reshape(-1, length), responses.mask.reshape(-1, length), strict=True
        )
        texts, ids = zip(*(completion(self.tokenizer, t, m) for t, m in flat), strict=True)
        completions = [as_completion(text, self.conversational) for text in texts]
        rows = [p for p in range(count) for _ in range(samples)]
        columns = columns_of([prompts.columns[p] for p in rows])
        batch = self.scorer.score(
            [prompts.texts[p] for p in rows], completions, columns,
            completion_ids=ids, max_completion_length=self.max_new_tokens,
        )  # fmt: skip
        return batch.per_function.reshape(count, samples, -1), list(texts)


def answer(
    model: generation.LoadedModel, prompts: EvalPrompts, config: EvalConfig, scoring: Scoring
) -> Answers:
    """One policy's greedy response and ``pass_samples`` samples per prompt, scored."""

    def draw(samples: int, temperature: float) -> eval_sampling.Responses:
        settings = eval_sampling.SamplingSettings(
            max_new_tokens=config.max_new_tokens, eos_id=scoring.tokenizer.stop_ids,
            pad_id=scoring.tokenizer.pad_id, temperature=temperature,
            vocab_size=scoring.tokenizer.vocab_size,
        )  # fmt: skip
        return eval_sampling.sample_responses(
            model.graphdef, model.params, prompts.prompts, settings=settings,
            samples_per_prompt=samples, seed=config.seed, batch_size=config.batch_size,
            stage="evaluate",
        )  # fmt: skip

    greedy = draw(1, 0.0)
    greedy_rewards, greedy_texts = scoring(prompts, greedy)
    if not config.pass_samples:
        return Answers(greedy, greedy_texts, greedy_rewards, None, None)
    sampled = draw(config.pass_samples, config.temperature)
    return Answers(greedy, greedy_texts, greedy_rewards, sampled, scoring(prompts, sampled)[0])


def correct(rewards: np.ndarray) -> np.ndarray:
    """Whether the verifier (the first function) gave each response full marks; NaN is not."""
    return rewards[..., 0] >= FULL_MARKS  # NaN compares False


def summary_arrays(answers: Answers, stop_ids: tuple[int, ...]) -> dict[str, Any]:
    """What ``verifiable_summary`` reads of one policy."""
    tokens, mask = answers.greedy
    return {
        "greedy_correct": correct(answers.greedy_rewards)[:, 0],
        "sampled_correct": None if answers.sampled is None else correct(answers.sampled_rewards),
        "lengths": (mask[:, 0] != 0).sum(axis=-1),
        "ended": ends_with_eos(tokens, mask, stop_ids),
    }


def pass_ks(samples: int) -> tuple[int, ...]:
    """The k of pass@k: 1, 2, 4, ... up to ``samples``, and ``samples`` itself."""
    powers = {2**i for i in range(samples.bit_length())}
    return tuple(sorted({*powers, samples})) if samples else ()


def kl_figures(
    models: dict[str, generation.LoadedModel],
    prompts: EvalPrompts,
    aligned: Answers,
    config: EvalConfig,
) -> dict[str, Any]:
    """KL(aligned ‖ reference): k3 on the aligned samples at their temperature, else k1 on
    the greedy responses (no sample of the policy: the mean log-ratio, untempered)."""
    responses = aligned.sampled if aligned.sampled is not None else aligned.greedy
    temperature = config.temperature if aligned.sampled is not None else 1.0
    estimator = "k3" if aligned.sampled is not None else "k1"
    logprobs = [
        generation.policy_logprobs(models[role], prompts.prompts, responses,
                                   temperature=temperature, batch_size=config.batch_size)
        for role in ROLES
    ]  # fmt: skip
    return {**sequence_kl(*logprobs, responses.mask, estimator), "estimator": estimator}


def function_means(scorer: RewardScorer, answers: dict[str, Answers]) -> dict[str, Any]:
    """Each function's mean reward on each policy's greedy responses (over those it judged)."""
    means = {}
    for i, function in enumerate(scorer.functions):
        means[function.name] = {"spec": function.spec, "weight": function.weight}
        for role, answered in answers.items():
            column = answered.greedy_rewards[:, 0, i]
            judged = column[~np.isnan(column)]
            means[function.name][role] = float(judged.mean()) if judged.size else math.nan
    return means


def check_inputs(shards_dir: str, dirs: dict[str, str]) -> dict[str, Any]:
    """The shards' manifest, once the eval split has prompts and both models are policies
    with the shards' tokenizer; before any model loads."""
    manifest = read_manifest(shards_dir)
    if not manifest.get("splits", {}).get("eval", {}).get("unique_prompts"):
        raise DataError(
            f"the eval split of {shards_dir} has no prompts; re-shard with eval_fraction > 0"
        )
    for role, folder in dirs.items():
        info = read_model_config(folder)
        check_tokenizer(info, manifest, folder)
        check_vocab(manifest, int(info["model"]["vocab_size"]))
        require_policy(info, folder, f"--{role}")
    return manifest


def measure(
    config: EvalConfig,
    shards_dir: str,
    manifest: dict[str, Any],
    models: dict[str, generation.LoadedModel],
    scoring: Scoring,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Both policies' answers on the eval prompts: the summary, and one row per prompt."""
    prompts = read_prompts(
        shards_dir, prompt_len=generation.prompt_length(config.max_new_tokens, manifest, models),
        max_prompts=config.max_eval_prompts,
    )  # fmt: skip
    answers = {role: answer(models[role], prompts, config, scoring) for role in ROLES}
    arrays = {role: summary_arrays(answers[role], scoring.tokenizer.stop_ids) for role in ROLES}
    summary = verifiable_summary(
        **arrays["policy"], ks=pass_ks(config.pass_samples), n_resamples=config.bootstrap_samples,
        confidence=config.confidence, seed=config.seed, reference=arrays["reference"],
    )  # fmt: skip
    verifier = scoring.scorer.functions[0]
    if np.isnan(answers["reference"].greedy_rewards[..., 0]).all():
        log.warning(
            "the verifier %s judged none of the reference's responses (it returned None): "
            "do the prompt records carry the columns it reads (e.g. answer)?",
            verifier.spec,
        )
    summary.update(
        kind="verifiable", judge=f"reward function {verifier.name}",
        verifier={"name": verifier.name, "spec": verifier.spec, "full_marks": FULL_MARKS},
        reward_functions=function_means(scoring.scorer, answers),
        kl=kl_figures(models, prompts, answers["policy"], config),
        confidence=config.confidence, temperature=config.temperature,
        max_new_tokens=config.max_new_tokens,
    )  # fmt: skip
    texts = {role: answers[role].greedy_texts for role in ROLES}
    return summary, verifiable_report.sample_rows(prompts.texts, prompts.columns, texts, arrays)


def run(
    config: EvalConfig,
    shards_dir: str,
    policy_dir: str,
    reference_dir: str,
    output: str,
    *,
    run_id: str = "",
) -> dict[str, Any]:
    """Evaluate ``policy_dir`` against ``reference_dir`` on the verifiable task; write the
    report; return the summary (as in eval.json: ``kind`` "verifiable", ``judge`` "reward
    function <name>") plus ``blessed``. ``output`` receives report.html, eval.json,
    metrics.json and samples.jsonl (verifiable_report.py)."""
    maybe_initialize()
    dirs = {"policy": policy_dir, "reference": reference_dir}
    if fileio.exists(output) and not fileio.isdir(output):
        raise NotADirectoryError(f"--output {output} is a file; pass a folder for the report")
    # Loaded before any model: a function that does not load fails now.
    functions = load_reward_functions(config.reward_functions, config.reward_weights)
    work = fileio.join(output, "work")  # a Hugging Face folder is imported here, then removed
    loaded = {role: resolve_base(d, fileio.join(work, role)) for role, d in dirs.items()}
    manifest = check_inputs(shards_dir, loaded)
    fileio.makedirs(output)
    if not config.max_new_tokens:
        longest = longest_response(manifest, shards_dir, "evaluate")
        config = dataclasses.replace(config, max_new_tokens=longest)
    tokenizer = load_tokenizer(fileio.join(shards_dir, "tokenizer"))
    models = {
        role: generation.prepare(load_model(folder, scalar_head=False, seed=config.seed)[0],
                                 sharded=config.fsdp)
        for role, folder in loaded.items()
    }  # fmt: skip
    with RewardScorer(functions) as scorer:
        conversational = is_conversational(manifest)
        scoring = Scoring(scorer, tokenizer, conversational, config.max_new_tokens)
        summary, rows = measure(config, shards_dir, manifest, models, scoring)
    summary["run"] = run_info.describe(read_model_config(loaded["policy"]), run_id)
    fileio.remove_tree(work)
    gate = verifiable_report.decide(summary, config.min_accuracy_gain)
    # The training log lives with the trained policy (not with an import of it).
    verifiable_report.write_outputs(
        output, eval_record(summary, gate), rows, policy_dir=policy_dir, config=config
    )
    log.info("%s; report in %s", "blessed" if gate.blessed else "not blessed", output)
    for reason in gate.reasons:
        log.info("gate: %s", reason)
    return {**json_ready(summary), "blessed": gate.blessed}
