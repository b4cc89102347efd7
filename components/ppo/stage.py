"""The ppo stage: align the sft policy against the reward model and export it.

Inputs: the shard stage's prompts (train split; each host its own streams of shards), the
policy artifact (sft) and the reward artifact (with ``reward_stats.json``).
The critic starts as a copy of the reward model with the score normalization folded
into its head, so it predicts in the units of its targets; the reference is the
initial policy (or its EMA). Output: the aligned policy as a model artifact
(``config.json`` with ``"stage": "ppo"``, ``params/``), ``metrics.jsonl``,
TensorBoard events and ``ppo_status.json`` (status, guard events, gold reward
before and after when the data names a gold reward).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import jax
from flax import nnx

from components.core import fileio
from components.core.data.input_pipeline import (
    check_vocab,
    longest_lengths,
    longest_response,
    read_manifest,
)
from components.core.data.prompts import prompt_dataset
from components.core.data.tokenizers import load_tokenizer
from components.core.model import lora
from components.core.model.artifact import (
    ModelMismatchError,
    check_tokenizer,
    hf_source,
    is_pretrained,
    load_model,
    require_policy,
    save_model,
    with_adapters,
)
from components.core.model.eval_sampling import SamplingSettings
from components.core.rewards.completions import is_conversational
from components.core.rewards.functions import load_reward_functions
from components.core.rewards.members import reward_members
from components.core.rewards.scoring import RewardScorer
from components.core.training.distributed import is_primary, maybe_initialize
from components.core.training.trainer import StreamBatches
from components.hf.importer import remove_import, resolve_base
from components.ppo.checkpoints import ppo_checkpointer
from components.ppo.config import (
    STATUS_STOPPED_KL_GUARD,
    PPOConfig,
)
from components.ppo.gold import mean_gold_reward
from components.ppo.host_rewards import HostRewards
from components.ppo.loop import PPOLoop
from components.ppo.monitors import Monitors, stack
from components.ppo.networks import Networks
from components.ppo.overopt_settings import STATUS_STOPPED_OVEROPTIMISATION
from components.ppo.rollout import Frozen, Models, ScoreNorm, TokenIds
from components.ppo.score_norm import policy_score_stats, saved_score_stats
from components.ppo.selection import HeldoutSelection

log = logging.getLogger(__name__)
STATUS_FILE = "ppo_status.json"
REWARD_STATS_FILE = "reward_stats.json"


def read_reward_stats(reward_dir: str, info: dict[str, Any]) -> dict[str, float]:
    """The reward model's score statistics (``reward_stats.json``, else its config.json)."""
    path = fileio.join(reward_dir, REWARD_STATS_FILE)
    stats = json.loads(fileio.read_text(path)) if fileio.exists(path) else info.get("reward_stats")
    if not stats or "mean" not in stats or "std" not in stats:
        raise ModelMismatchError(
            f"{path} is missing: {reward_dir!r} has no reward statistics; pass the output "
            "of the reward stage (it writes reward_stats.json)"
        )
    return {"mean": float(stats["mean"]), "std": float(stats["std"])}


def _load(model_dir: str, manifest: dict, config: PPOConfig, *, scalar_head: bool | None):
    """A model artifact checked against the shards' tokenizer."""
    model, info = load_model(
        model_dir, scalar_head=scalar_head, seed=config.seed, remat=config.remat, dtype=config.dtype
    )
    check_tokenizer(info, manifest, model_dir)
    check_vocab(manifest, model.config.vocab_size)
    return model, info


def fold_normalization(critic: nnx.Module, mean: float, std: float) -> None:
    """Make the critic's head output (raw − mean) / std: kernel / std, (bias − mean) / std.

    The critic is fitted to returns built from NORMALIZED scores; a head copied as is starts
    in raw units (the demo's reward model: mean 0.2, std 9), and its first iterations are
    spent unlearning the scale with clipped value losses and garbage advantages.
    """
    head = critic.scalar_head
    scale = 1.0 / max(std, 1e-6)
    head.kernel[...] = head.kernel[...] * scale
    head.bias[...] = (head.bias[...] - mean) * scale


def build_networks(
    config: PPOConfig,
    manifest: dict,
    policy_dir: str,
    reward_dir: str,
    *,
    shards_dir: str = "",
    score_stats: dict[str, float] | None = None,
) -> tuple[nnx.Module, Networks]:
    """The policy model and every network's graph and parameters, ready for the loop.

    Adapters the artifacts were trained with are merged. With ``lora_rank`` the policy and
    the critic get fresh adapters, and the bases are frozen, one copy each: the policy's
    (the reference's too) and the reward model's (the critic's too). Scores are normalized
    as ``config.score_norm`` says, on train prompts of ``shards_dir``; without one (shape
    measurements) the reward stage's statistics stand in. ``score_stats`` (a resumed run's,
    from its checkpoint) are taken as they are, and nothing is sampled for them.

    ``reward_dir`` '' (reward functions alone): no reward model; ppo's critic starts from the
    policy with a fresh head, and scores are the functions' rewards as they return them.
    """
    policy, policy_info = _load(policy_dir, manifest, config, scalar_head=False)
    require_policy(
        policy_info, policy_dir, "--policy", " (the reward model goes as --reward-model)"
    )
    policy = with_adapters(policy, config, config.seed)
    tokenizer = manifest["tokenizer"]
    ids = TokenIds(
        eos_id=tuple(int(i) for i in tokenizer.get("stop_ids") or [tokenizer["eos_id"]]),
        pad_id=int(tokenizer["pad_id"]),
        vocab_size=int(tokenizer["vocab_size"]),
    )
    reward, stats = None, {"mean": 0.0, "std": 1.0}  # reward functions alone: scores as given
    if reward_dir:
        reward, stats = _reward_model(
            config, manifest, policy, reward_dir, ids,
            shards_dir=shards_dir, score_stats=score_stats,
        )  # fmt: skip
    policy_graph, policy_params = nnx.split(policy, nnx.Param)
    reward_graph, reward_params = None, None
    if reward is not None:
        reward_graph, reward_params = nnx.split(reward, nnx.Param)
    critic_graph, critic_params = reward_graph, None  # grpo and rloo: no critic
    if not config.uses_groups:
        # From the reward model, else (reward functions alone) the policy with a fresh head.
        critic, _ = _load(reward_dir or policy_dir, manifest, config, scalar_head=True)
        # The critic's own seed: its adapters' A differs from the policy's.
        critic = with_adapters(critic, config, config.seed + 1)
        fold_normalization(critic, stats["mean"], stats["std"])
        critic_graph, critic_params = nnx.split(critic, nnx.Param)
    policy_params, policy_base = lora.split(policy_params, policy.config)
    frozen = None
    if policy_base is not None:
        # The reward model keeps its head; its base, one copy in the compute dtype, is the
        # critic's too (the reward artifact with fresh adapters holds the very same weights).
        # Without a reward model the critic's base is its own (the policy's weights).
        dtype = policy.config.compute_dtype
        shared = None
        if reward_params is not None:
            reward_params, shared = lora.freeze(reward_params, dtype)
        if critic_params is not None and shared is None:
            critic_params, shared = lora.freeze(critic_params, dtype)
        elif critic_params is not None:
            critic_params = nnx.filter_state(critic_params, lora.TRAINABLE)
        frozen = Frozen(jax.device_get(policy_base), jax.device_get(shared))
    monitors, spec = None, None
    if reward_dir:
        monitors, spec = _monitors(config, manifest, reward_dir, reward_params)
    nets = Networks(
        models=Models(policy_graph, critic_graph, reward_graph),
        policy=jax.device_get(policy_params),
        critic=None if critic_params is None else jax.device_get(critic_params),
        reward=None if reward_params is None else jax.device_get(reward_params),
        ids=ids,
        norm=ScoreNorm(
            stats["mean"],
            stats["std"],
            config.missing_eos_penalty,
            config.reward_clip,
            quantiles=tuple(stats.get("quantiles", ())) if config.score_norm == "quantile" else (),
        ),  # fmt: skip
        frozen=frozen,
        monitors=monitors,
        monitor_spec=spec,
    )
    return policy, nets


def _monitors(
    config: PPOConfig, manifest: dict, reward_dir: str, reward_params: Any
) -> tuple[Any, Monitors | None]:
    """The reward artifact's held-out model and ensemble members (core/rewards/members.py),
    stacked whole, and their statistics; (None, None) when it has none."""
    members = reward_members(reward_dir)
    ensemble = bool(members.ensemble)
    if config.conservative_reward and not ensemble:
        raise ValueError(
            f"conservative_reward: {config.conservative_reward!r} combines a reward ensemble, "
            f"but {reward_dir} holds one reward model; train more with the reward stage's "
            "ensemble_size (pipeline: reward_ensemble), or set conservative_reward ''"
        )
    if not members.any:
        return None, None
    if config.fsdp:
        raise ValueError(
            f"{reward_dir} holds a held-out reward model or an ensemble, which ppo holds whole "
            "on every device; fsdp runs do not score them: shard with heldout_fraction 0 and no "
            "held-out data (pipeline: heldout_data_uri '') and train the reward stage with "
            "ensemble_size 1, or run without fsdp"
        )
    trees = []
    for folder in members.folders:
        model, _ = _load(folder, manifest, config, scalar_head=None)
        model = lora.merge(model)
        _, params = nnx.split(model, nnx.Param)
        # In the compute dtype, as LoRA's frozen bases: they only score (the planner counts
        # them so, pipelines/dag/phases.py); the scalar head stays float32.
        head, body = lora.freeze(params, model.config.compute_dtype)
        trees.append(jax.device_get(lora.join(head, body)))
    proxy = read_reward_stats(reward_dir, {})
    stats = [read_reward_stats(folder, {}) for folder in members.folders]
    log.info(
        "ppo: rollouts also scored by %s",
        ", ".join(
            (["the held-out reward model"] if members.heldout else [])
            + ([f"{len(members.ensemble)} more ensemble member(s)"] if ensemble else [])
        ),
    )
    spec = Monitors(
        proxy=(proxy["mean"], proxy["std"]),
        members=tuple((s["mean"], s["std"]) for s in stats),
        heldout=members.heldout is not None,
        conservative=config.conservative_reward,
        weight=config.conservative_lambda,
    )
    return stack(trees), spec


def _selection(
    config: PPOConfig, nets: Networks, shards_dir: str, heldout: bool
) -> HeldoutSelection | None:
    """What ranks the saves (selection.py): with a held-out model, ``select_checkpoint``
    heldout and ``select_prompts`` > 0; else None (the last policy, or each save's rollout)."""
    if not (heldout and config.select_checkpoint == "heldout" and config.select_prompts):
        return None
    ids = nets.ids
    settings = SamplingSettings(
        config.max_new_tokens, ids.eos_id, ids.pad_id, config.temperature, ids.vocab_size
    )
    # The held-out model is the monitors' first member (monitors.Monitors).
    return HeldoutSelection.build(
        shards_dir, (nets.models.policy, nets.models.reward),
        0, nets.monitor_spec.members[0], settings, prompts=config.select_prompts,
        samples=config.select_samples, prompt_len=config.prompt_len, seed=config.seed,
        batch_size=config.rollout_batch_size // jax.process_count(),
    )  # fmt: skip


def _reward_model(
    config: PPOConfig,
    manifest: dict,
    policy: nnx.Module,
    reward_dir: str,
    ids: TokenIds,
    *,
    shards_dir: str,
    score_stats: dict[str, float] | None,
) -> tuple[nnx.Module, dict[str, Any]]:
    """The reward model (adapters merged) and the statistics its scores are normalized by
    (:func:`build_networks` says which)."""
    reward, reward_info = _load(reward_dir, manifest, config, scalar_head=None)
    if reward.scalar_head is None:
        raise ModelMismatchError(
            f"{reward_dir} has no scalar head: it is a policy, not a reward model; "
            "pass the output of the reward stage as --reward-model"
        )
    reward = lora.merge(reward)
    stats = score_stats or read_reward_stats(reward_dir, reward_info)
    if score_stats is not None:
        log.info(
            "ppo: scores normalized by the checkpoint's statistics (score_norm %s): mean %.4g, "
            "std %.4g", config.score_norm, stats["mean"], stats["std"],
        )  # fmt: skip
    elif config.score_norm in ("policy", "quantile") and shards_dir:
        data_stats = stats
        # Fresh adapters start at zero: the policy samples as the artifact does.
        stats = policy_score_stats(
            policy, reward, shards_dir, ids, prompt_len=config.prompt_len,
            max_new_tokens=config.max_new_tokens, temperature=config.temperature,
            samples=config.score_norm_samples, seed=config.seed, sharded=config.fsdp,
            holdout=config.validation_fraction,
        )  # fmt: skip
        log.info(
            "ppo: scores normalized by the starting policy's samples (%d train prompts): "
            "mean %.4g, std %.4g (the data's chosen and rejected responses: %.4g, %.4g)",
            stats["samples"], stats["mean"], stats["std"], data_stats["mean"], data_stats["std"],
        )  # fmt: skip
    return reward, stats


def known_gold_rewards() -> set[str]:
    """Names of the gold rewards this release can compute."""
    from components.core.data import builtin_task

    return {builtin_task.GOLD_REWARD_NAME}


def _gold(
    nets: Networks, params: Any, shards_dir: str, manifest: dict, config: PPOConfig
) -> dict[str, float] | None:
    """Mean gold reward on the eval prompts, and on the validation prompts when the run holds
    some out (``validation_fraction``); None when the data names no gold reward we know."""
    name = manifest.get("gold_reward")
    if not name or name not in known_gold_rewards():
        if name:
            log.warning("ppo: gold reward %r is unknown to this release; not measured", name)
        return None
    common = dict(
        prompt_len=config.prompt_len, max_new_tokens=config.max_new_tokens,
        temperature=config.temperature, seed=config.seed, sharded=config.fsdp,
    )  # fmt: skip
    graph = nets.models.policy
    gold = {"eval": mean_gold_reward(graph, params, shards_dir, manifest, **common)}
    if config.validation_fraction > 0:
        held_out = {"split": "train", "holdout": config.validation_fraction, "held_out": True}
        gold["validation"] = mean_gold_reward(
            graph, params, shards_dir, manifest, prompt_set=held_out, **common
        )
    return gold


def _gold_figures(before: dict | None, after: dict | None) -> dict[str, Any]:
    """ppo_status's gold part: initial and final on the eval prompts (None without a gold
    reward), and the same on the validation prompts when the run held some out."""
    figures: dict[str, Any] = {
        "initial": before and before["eval"],
        "final": after and after["eval"],
    }
    if before and "validation" in before:
        figures["validation"] = {"initial": before["validation"], "final": after["validation"]}
    return figures


def prompt_streams(config: PPOConfig, shards_dir: str) -> StreamBatches:
    """This host's train prompts: one batch from each of its streams per iteration (with
    their texts and columns when reward functions score the rollouts)."""
    own, per_stream, count = config.prompt_streams()
    readers = [
        prompt_dataset(
            shards_dir,
            "train",
            batch_size=per_stream,
            prompt_len=config.prompt_len,
            seed=config.seed,
            host_index=stream,
            host_count=count,
            shuffle=True,
            repeat=True,
            holdout=config.validation_fraction,
            with_text=bool(config.reward_functions),
        )
        for stream in own
    ]
    return StreamBatches(readers)


def host_rewards(config: PPOConfig, shards_dir: str, manifest: dict) -> HostRewards | None:
    """The reward functions' scorer of the rollouts (None without reward functions)."""
    if not config.reward_functions:
        return None
    functions = load_reward_functions(config.reward_functions, config.reward_weights)
    scorer = RewardScorer(functions, workers=config.reward_workers, timeout=config.reward_timeout)
    return HostRewards(
        scorer, load_tokenizer(fileio.join(shards_dir, "tokenizer")),
        conversational=is_conversational(manifest), max_new_tokens=config.max_new_tokens,
    )  # fmt: skip


def run(
    config: PPOConfig, shards_dir: str, policy_dir: str, reward_dir: str, output: str
) -> dict[str, float]:
    """Align ``policy_dir`` against ``reward_dir`` (and/or ``config.reward_functions``; ''
    = none) on ``shards_dir``'s prompts into ``output``."""
    maybe_initialize()
    if not reward_dir and not config.reward_functions:
        raise ValueError(
            "ppo: nothing scores the rollouts: pass the reward stage's output as "
            "--reward-model, or reward functions as --reward-functions (or both)"
        )
    manifest = read_manifest(shards_dir)
    if config.validation_fraction > 0 and manifest.get("gold_reward") not in known_gold_rewards():
        raise ValueError(
            f"validation_fraction: {config.validation_fraction} holds train prompts out, but "
            f"{shards_dir} names no gold reward this release knows, so nothing would be "
            "measured on them; set it to 0, or shard data that names a gold reward"
        )
    prompt_max = longest_lengths(manifest)[0]
    pretrained = is_pretrained(policy_dir)
    given_policy = policy_dir  # fingerprinted as given: an HF folder's import is redone
    # A Hugging Face folder is imported once into the task's work folder.
    policy_dir = resolve_base(policy_dir, fileio.join(output, "work"))
    config = dataclasses.replace(
        config.resolved(pretrained=pretrained),
        prompt_len=config.prompt_len or prompt_max,
        max_new_tokens=config.max_new_tokens or longest_response(manifest, shards_dir, "ppo"),
    )
    inputs = {"--shards": shards_dir, "--policy": given_policy, "--reward-model": reward_dir}
    members = reward_members(reward_dir)
    checkpointer = ppo_checkpointer(config, output, inputs, heldout=members.heldout is not None)
    policy, nets = build_networks(
        config, manifest, policy_dir, reward_dir, shards_dir=shards_dir,
        score_stats=saved_score_stats(checkpointer, config.score_norm),
    )  # fmt: skip
    prompts = prompt_streams(config, shards_dir)
    gold_before = _gold(nets, nets.whole_policy(nets.policy), shards_dir, manifest, config)
    scorer = host_rewards(config, shards_dir, manifest)
    try:
        selection = _selection(config, nets, shards_dir, members.heldout is not None)
        loop = PPOLoop(config, nets, prompts, output, checkpointer, scorer, selection)
        result = loop.run(nets.reward)
    finally:
        if scorer is not None:
            scorer.scorer.close()
    gold_after = _gold(nets, result.policy, shards_dir, manifest, config)
    status = {
        "status": result.status,
        "iterations": result.iteration,
        "final_kl_per_token": result.final_kl,
        "kl_stop": config.kl_stop,
        "guard_events": result.guard_events,
        "gold_reward": _gold_figures(gold_before, gold_after),
        "score_norm": {"source": config.score_norm, "mean": nets.norm.mean, "std": nets.norm.std},
        "selected_checkpoint": result.selected,
    }
    save_model(
        output, policy, result.policy, tokenizer=manifest["tokenizer"], stage="ppo",
        training=dataclasses.asdict(config), step=result.iteration, status=result.status,
        base_policy=given_policy, reward_model=reward_dir, pretrained=pretrained,
        tokenizer_dir=fileio.join(shards_dir, "tokenizer"),
        hf=hf_source(policy_dir),
    )  # fmt: skip
    if is_primary():
        fileio.write_text(fileio.join(output, STATUS_FILE), json.dumps(status, indent=2) + "\n")
    remove_import(fileio.join(output, "work"))
    metrics = dict(result.metrics)
    metrics["stopped_kl_guard"] = float(result.status == STATUS_STOPPED_KL_GUARD)
    metrics["stopped_overoptimisation"] = float(result.status == STATUS_STOPPED_OVEROPTIMISATION)
    if result.selected is not None:
        metrics["selected_iteration"] = result.selected["iteration"]
    if gold_before is not None:
        metrics.update({"gold/initial": gold_before["eval"], "gold/final": gold_after["eval"]})
        if "validation" in gold_before:
            metrics["gold/validation_initial"] = gold_before["validation"]
            metrics["gold/validation_final"] = gold_after["validation"]
    return metrics
