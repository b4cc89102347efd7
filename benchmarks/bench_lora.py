"""LoRA against full fine-tuning, side by side: update memory, update time, and quality.

Three parts, each printed beside what it is compared to (8 virtual CPU devices, as the demo):

1. Memory: XLA's ``memory_analysis()`` of ONE compiled PPO update, per device (arguments +
   outputs + temporaries − donated aliases, plus the frozen parameters resident meanwhile:
   reference and reward model, and under LoRA the frozen bases;
   _update_memory.networks_update_memory), LoRA (rank 8, all-linear, alpha 16) against
   full fine-tuning, at (a) the demo's shapes (demo preset, fp32 compute, the demo's ppo
   settings and the built-in task's lengths) and (b) Llama-3.2-1B's (preset "1b": bf16
   compute, full remat, vocab 128256 kept) with --big-prompt-len / --big-response-len /
   --big-rollout-batch (defaults 256 / 256 / 64: a shorter sequence than the 1b run
   preset's 512 + 512, to bound the rollout's shapes). Compiled only, never run: the
   networks are shapes (fresh preset weights, laid out as ppo.stage.build_networks lays out
   artifacts). LoRA's frozen bases are stored in the compute dtype: fp32 at the demo's size,
   bf16 at 1B; full fine-tuning's reference and reward model stay fp32. Target: LoRA/full
   <= 0.35x.

       python benchmarks/bench_lora.py --parts memory [--big-prompt-len 256] ...

2. Step time: the demo-size PPO update (all epochs and minibatches of one rollout batch),
   LoRA and full on the same batch (a rollout of the fresh full policy), timed alternately
   (A B A B ...), the median of --repeats (default 7) each after 2 warm-ups.

       python benchmarks/bench_lora.py --parts step [--repeats 7]

3. Quality on the built-in task, each stage in its own process with the demo's settings, from
   ONE shard + sft + reward preparation (bench_algorithms.prepare): PPO full and PPO LoRA
   (rank 8, auto rates = 10x full's) from the sft policy, each evaluated against it
   (gold gain and KL per token with 95% bootstrap intervals, paired differences on the same
   prompts); the reward stage warm-started from the sft policy (``--base-policy``), full and
   LoRA, their eval accuracies; and LoRA PPO at explicit rates factor x full's from-scratch
   auto rates (--lora-lr-factors; factor 10 is the auto LoRA run itself: the same resolved
   config). Targets: LoRA's gold gain >= 0.8x full's at a KL per token at most full's
   interval high end; |reward accuracy difference| <= 0.02.

       python benchmarks/bench_lora.py --parts quality [--lora-lr-factors 3,10,30]

All three (the default, --parts memory,step,quality) with ``--work-dir DIR --json PATH``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("ALIGNPIPE_CPU_DEVICES", "8")  # the demo's; the stage processes inherit it
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_algorithms as algorithms  # noqa: E402  (configures the CPU devices first)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from _timing import interleaved_median_seconds  # noqa: E402
from _update_memory import networks_update_memory, rl_update_memory  # noqa: E402
from flax import nnx  # noqa: E402

from components.core.config import LORA_LEARNING_RATE_FACTOR  # noqa: E402
from components.core.data.input_pipeline import longest_lengths, read_manifest  # noqa: E402
from components.core.model import lora  # noqa: E402
from components.core.model.transformer import ModelConfig, Transformer, model_config  # noqa: E402
from components.core.training import parallel  # noqa: E402
from components.evaluate.measures import paired_difference  # noqa: E402
from components.ppo.config import FROM_SCRATCH_LEARNING_RATES, PPOConfig  # noqa: E402
from components.ppo.kl_control import init_kl_controller  # noqa: E402
from components.ppo.loop import compiled_phases  # noqa: E402
from components.ppo.networks import Networks  # noqa: E402
from components.ppo.rollout import Frozen, Models, RolloutParams, ScoreNorm, TokenIds  # noqa: E402
from components.ppo.stage import prompt_streams  # noqa: E402
from components.ppo.update import PPOState  # noqa: E402
from pipelines.dag import params

LORA_RANK = 8
MIB = 2**20
TARGET_MEMORY_RATIO = 0.35
TARGET_GAIN_FRACTION = 0.8
TARGET_ACCURACY_GAP = 0.02


def ppo_config(values: dict[str, Any], rank: int, **overrides: Any) -> PPOConfig:
    """The demo's ppo config with adapters of ``rank`` (0: full), auto rates resolved."""
    settings = {**params.stage_values("ppo", values), "lora_rank": rank, **overrides}
    return PPOConfig(**settings).resolved(pretrained=False)


def preset_networks(
    config: PPOConfig, model: ModelConfig, tokenizer: dict, *, abstract: bool
) -> Networks:
    """Fresh networks of ``model``, laid out as ppo.stage.build_networks lays out artifacts
    (LoRA: trainable adapters and heads, one frozen base each for policy and reward/critic).
    ``abstract``: shapes only (nothing initialised)."""
    adapted = lora.with_lora(
        model, config.lora_rank, config.lora_alpha, config.lora_target_modules()
    )

    def split(cfg: ModelConfig, head: bool, seed: int) -> tuple[nnx.GraphDef, Any]:
        build = lambda: Transformer(cfg, rngs=nnx.Rngs(seed), scalar_head=head)  # noqa: E731
        return nnx.split(nnx.eval_shape(build) if abstract else build(), nnx.Param)

    policy_graph, policy = split(adapted, False, config.seed)
    reward_graph, reward = split(model, True, config.seed)
    critic_graph, critic = split(adapted, True, config.seed + 1)
    frozen = None
    if config.lora_rank:
        cut = lambda tree: lora.split(tree, adapted)  # noqa: E731
        (policy, policy_base), (_, shared) = (
            (jax.eval_shape(cut, tree) if abstract else cut(tree)) for tree in (policy, reward)
        )
        reward, critic = reward.filter(lora.TRAINABLE), critic.filter(lora.TRAINABLE)
        frozen = Frozen(policy_base, shared)
    return Networks(
        models=Models(policy_graph, critic_graph, reward_graph),
        policy=policy, critic=critic, reward=reward,
        ids=TokenIds(eos_id=int(tokenizer["eos_id"]), pad_id=int(tokenizer["pad_id"])),
        norm=ScoreNorm(0.0, 1.0, config.missing_eos_penalty, config.reward_clip),
        frozen=frozen,
    )  # fmt: skip


def memory_pair(configs: dict[str, PPOConfig], model: ModelConfig, tokenizer: dict) -> dict:
    """Per-device update memory of full and LoRA at ``model``'s shapes, and LoRA/full."""
    figures = {}
    for name, config in configs.items():
        start = time.perf_counter()
        nets = preset_networks(config, model, tokenizer, abstract=True)
        figures[name] = networks_update_memory(config, nets, abstract=True)
        figures[name]["compile_seconds"] = time.perf_counter() - start
        print(f"[bench] memory {model.n_layers}x{model.dim} {name}: {figures[name]}", flush=True)
    figures["ratio"] = figures["lora"]["peak"] / figures["full"]["peak"]
    return figures


def memory_part(values: dict[str, Any], shards: str, args: argparse.Namespace) -> dict:
    """Update memory, LoRA and full, at the demo's shapes and at Llama-3.2-1B's."""
    manifest = read_manifest(shards)
    prompt_len, response_len = longest_lengths(manifest)
    tokenizer = manifest["tokenizer"]
    lengths = {"prompt_len": prompt_len, "max_new_tokens": response_len}
    demo_model = model_config(values["preset"], int(tokenizer["vocab_size"]))
    demo = {name: ppo_config(values, rank, **lengths) for name, rank in (("full", 0),
            ("lora", LORA_RANK))}  # fmt: skip
    big_lengths = {
        "prompt_len": args.big_prompt_len,
        "max_new_tokens": args.big_response_len,
        "rollout_batch_size": args.big_rollout_batch,
    }
    big = {name: dataclasses.replace(config, **big_lengths) for name, config in demo.items()}
    big_model = model_config("1b", args.big_vocab)
    return {
        "demo": {
            "model": f"preset {values['preset']}, {demo_model.dtype} compute", **lengths,
            "rollout_batch_size": demo["full"].rollout_batch_size,
            **memory_pair(demo, demo_model, tokenizer),
        },
        "1b": {
            "model": f"preset 1b, vocab {args.big_vocab}, {big_model.dtype} compute, "
            f"remat {big_model.remat}", **big_lengths,
            **memory_pair(big, big_model, tokenizer),
        },
    }  # fmt: skip


def step_part(values: dict[str, Any], shards: str, repeats: int) -> dict:
    """Median seconds of the demo-size PPO update, full and LoRA, on one batch, alternated."""
    manifest = read_manifest(shards)
    prompt_len, response_len = longest_lengths(manifest)
    lengths = {"prompt_len": prompt_len, "max_new_tokens": response_len}
    model = model_config(values["preset"], int(manifest["tokenizer"]["vocab_size"]))
    runs, batch = {}, None
    key, kl_coef, lr_scale = jax.random.PRNGKey(0), np.float32(0.2), np.float32(1.0)
    for name, rank in (("full", 0), ("lora", LORA_RANK)):
        config = ppo_config(values, rank, **lengths)
        nets = preset_networks(config, model, manifest["tokenizer"], abstract=False)
        rollout, update, _ = compiled_phases(config, nets)
        state = parallel.place(PPOState.create(nets.policy, nets.critic, config))
        frozen = None if nets.frozen is None else Frozen(*map(parallel.place, nets.frozen))
        if batch is None:  # the full policy's rollout: one batch for both
            critic = None if state.critic is None else state.critic.params
            rollout_params = RolloutParams(
                state.policy.params, parallel.place(nets.reference), critic,
                parallel.place(nets.reward), frozen,
            )  # fmt: skip
            prompts = parallel.shard_batch(next(prompt_streams(config, shards)))
            batch, _, _ = rollout(
                rollout_params, prompts, key, init_kl_controller("fixed", float(kl_coef))
            )
        runs[name] = {"update": update, "state": state, "frozen": frozen}

    def timed(name: str):
        run = runs[name]

        def step() -> Any:  # the update donates its state: each call takes the last one's
            args = (key, lr_scale, kl_coef) + (() if run["frozen"] is None else (run["frozen"],))
            run["state"], metrics = run["update"](run["state"], batch, *args)
            return metrics

        return step

    seconds = interleaved_median_seconds(
        {name: timed(name) for name in runs}, warmup=2, repeats=repeats
    )
    return {**seconds, "ratio": seconds["lora"] / seconds["full"], "repeats": repeats}


def train_quality_runs(
    values: dict[str, Any], shards: str, base: dict, root: Path, factors: list[float]
) -> dict[str, algorithms.StageRun]:
    """PPO full, PPO LoRA (auto and explicit rates) and warm-started reward models."""
    sft, reward, logs = base["sft"].output, base["reward"].output, root / "logs"
    runs = {}
    ppo = params.stage_values("ppo", values)
    variants = {"ppo-full": {}, "ppo-lora": {"lora_rank": LORA_RANK}}
    for factor in factors:
        if factor != LORA_LEARNING_RATE_FACTOR:  # that one is the auto ppo-lora run
            policy_rate, critic_rate = (factor * rate for rate in FROM_SCRATCH_LEARNING_RATES)
            variants[f"ppo-lora-lr{factor:g}"] = {
                "lora_rank": LORA_RANK, "learning_rate": policy_rate,
                "critic_learning_rate": critic_rate,
            }  # fmt: skip
    for name, changes in variants.items():
        paths = {"shards": shards, "policy": sft, "reward": reward, "output": str(root / name)}
        runs[name] = algorithms.run_stage("ppo", {**ppo, **changes}, paths, logs)
    for name, rank in (("reward-full-warm", 0), ("reward-lora-warm", LORA_RANK)):
        settings = {**params.stage_values("reward", values), "base_policy": sft, "lora_rank": rank}
        settings["min_reward_accuracy"] = 0.0  # a figure here, not a gate: the stage must finish
        paths = {"shards": shards, "output": str(root / name)}
        runs[name] = algorithms.run_stage("reward", settings, paths, logs)
    return runs


def evaluated(values: dict, shards: str, base: dict, runs: dict, root: Path, name: str) -> dict:
    """The evaluate stage's gold gain and KL of run ``name`` against the sft policy, and its
    per-prompt columns."""
    evaluation = str(root / f"eval-{name}")
    print(f"[bench] evaluating {name} against the sft policy", flush=True)
    summary = algorithms.evaluate_against_sft(values, shards, base, runs[name].output, evaluation)
    return {
        "gold_gain": summary["gold"]["difference"],
        "kl_per_token": summary["kl"]["per_token"],
        "stage_seconds": runs[name].seconds,
        "prompts": algorithms.per_prompt(evaluation),
    }


def quality_part(values: dict, shards: str, root: Path, factors: list[float]) -> dict:
    """PPO and reward models, full against LoRA, on the built-in task (see the docstring)."""
    shards, base = algorithms.prepare(values, root, shards)
    runs = train_quality_runs(values, shards, base, root, factors)
    ppo_names = [name for name in runs if name.startswith("ppo-")]
    rows = {name: evaluated(values, shards, base, runs, root, name) for name in ppo_names}
    full = rows["ppo-full"]["prompts"]
    for row in rows.values():
        prompts = row.pop("prompts")
        paired = paired_difference(
            prompts["gold"], full["gold"], n_resamples=1000, confidence=0.95, seed=0
        )
        row["paired_gold_vs_full"] = paired["difference"]
        row["kl_vs_full"] = algorithms.kl_versus(prompts, full)
    # The memory part's demo figures, again from the runs' own artifacts (build_networks).
    artifact_memory = {
        name: rl_update_memory(runs[name].output, shards, base["sft"].output, base["reward"].output)
        for name in ("ppo-full", "ppo-lora")
    }
    accuracy = {
        name: runs[name].summary.get("eval/accuracy", float("nan"))
        for name in ("reward-full-warm", "reward-lora-warm")
    }
    return {
        "ppo": rows,
        "artifact_update_memory": artifact_memory,
        "reward_accuracy": accuracy,
        "demo_reward_accuracy": base["reward"].summary.get("eval/accuracy", float("nan")),
        "stage_seconds": {name: run.seconds for name, run in {**base, **runs}.items()},
        "lr_factors": {
            f"{factor:g}": "ppo-lora" if factor == LORA_LEARNING_RATE_FACTOR
            else f"ppo-lora-lr{factor:g}" for factor in factors
        },
    }  # fmt: skip


def _interval(figure: dict, digits: int = 3) -> str:
    return (
        f"{figure['value']:+.{digits}f} [{figure['low']:+.{digits}f}, {figure['high']:+.{digits}f}]"
    )


def report_memory(memory: dict) -> list[dict]:
    """Print the memory figures; returns the targets' checks."""
    checks = []
    for size, figures in memory.items():
        full, adapted = figures["full"], figures["lora"]
        print(f"\nupdate memory per device, {size} ({figures['model']}):")
        for name, row in (("full", full), ("lora r8", adapted)):
            print(
                f"  {name:<8} program {row['program_live'] / MIB:10.1f} MiB + resident "
                f"{row['resident'] / MIB:9.1f} MiB = {row['peak'] / MIB:10.1f} MiB"
            )
        met = figures["ratio"] <= TARGET_MEMORY_RATIO
        checks.append({
            "target": f"LoRA/full update memory at {size} <= {TARGET_MEMORY_RATIO}x",
            "met": met, "figures": f"{figures['ratio']:.3f}x",
        })  # fmt: skip
    return checks


def report_quality(quality: dict, settings: str) -> list[dict]:
    """Print the quality figures; returns the targets' checks."""
    rows = quality["ppo"]
    print(f"\nPPO against the sft policy (built-in task, {settings}):")
    print(f"  {'run':<16} {'gold gain [95%]':<26} {'KL/token [95%]':<30} "
          f"{'paired gold - full':<26} {'stage s':>7}")  # fmt: skip
    for name, row in rows.items():
        kl = row["kl_vs_full"]["algorithm"]
        print(
            f"  {name:<16} {_interval(row['gold_gain']):<26} {_interval(kl, 4):<30} "
            f"{_interval(row['paired_gold_vs_full']):<26} {row['stage_seconds']:>7.1f}"
        )
    print("  LoRA learning-rate factors (x full's from-scratch auto rates "
          f"{FROM_SCRATCH_LEARNING_RATES}):")  # fmt: skip
    for factor, name in quality["lr_factors"].items():
        row = rows[name]
        print(f"    {factor:>4}x  gold gain {row['gold_gain']['value']:+.3f}  KL/token "
              f"{row['kl_per_token']:.4f}  ({name})")  # fmt: skip
    memory = quality["artifact_update_memory"]
    print(f"update memory from the runs' artifacts: full {memory['ppo-full']['peak'] / MIB:.1f} "
          f"MiB, LoRA r8 {memory['ppo-lora']['peak'] / MIB:.1f} MiB per device = "
          f"{memory['ppo-lora']['peak'] / memory['ppo-full']['peak']:.3f}x")  # fmt: skip
    accuracy = quality["reward_accuracy"]
    print(f"reward eval accuracy, warm-started from sft: full {accuracy['reward-full-warm']:.3f}, "
          f"LoRA r8 {accuracy['reward-lora-warm']:.3f} (demo's fresh reward model "
          f"{quality['demo_reward_accuracy']:.3f})")  # fmt: skip
    full, adapted = rows["ppo-full"], rows["ppo-lora"]
    gain, full_gain = adapted["gold_gain"]["value"], full["gold_gain"]["value"]
    kl, full_kl = adapted["kl_per_token"], adapted["kl_vs_full"]["ppo"]
    gap = accuracy["reward-lora-warm"] - accuracy["reward-full-warm"]
    return [
        {"target": f"LoRA PPO's gold gain >= {TARGET_GAIN_FRACTION}x full's",
         "met": gain >= TARGET_GAIN_FRACTION * full_gain,
         "figures": f"{gain:+.3f} vs full {full_gain:+.3f} (= {gain / full_gain:.2f}x); paired "
         f"LoRA - full {_interval(adapted['paired_gold_vs_full'])}"},
        {"target": "LoRA PPO's KL per token <= full's interval high end",
         "met": kl <= full_kl["high"],
         "figures": f"{kl:.4f} vs full {_interval(full_kl, 4)}; paired LoRA - full "
         f"{_interval(adapted['kl_vs_full']['difference'], 4)}"},
        {"target": f"|reward accuracy LoRA - full| <= {TARGET_ACCURACY_GAP}",
         "met": abs(gap) <= TARGET_ACCURACY_GAP, "figures": f"{gap:+.3f}"},
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="", help="folder for every artifact (default: temp)")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    parser.add_argument("--parts", default="memory,step,quality", help="comma-separated parts")
    parser.add_argument("--big-vocab", type=int, default=128256, help="1b memory: vocabulary")
    parser.add_argument("--big-prompt-len", type=int, default=256, help="1b memory: prompt")
    parser.add_argument("--big-response-len", type=int, default=256, help="1b memory: response")
    parser.add_argument("--big-rollout-batch", type=int, default=64, help="1b memory: rows")
    parser.add_argument("--repeats", type=int, default=7, help="step time: timed calls each")
    parser.add_argument("--lora-lr-factors", default="10", help="LoRA PPO rate factors")
    algorithms.add_set_argument(parser)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    started = time.perf_counter()
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-lora-"))
    root.mkdir(parents=True, exist_ok=True)
    values = algorithms.demo_values(args.set)
    print(f"[bench] {algorithms.machine()}; artifacts in {root}", flush=True)
    shards = str(root / "shards")
    if not (root / "shards").exists():
        shards = algorithms.shard_task(values, root)
    record: dict[str, Any] = {"machine": algorithms.machine(), "targets": []}
    if "memory" in parts:
        record["memory"] = memory_part(values, shards, args)
        record["targets"] += report_memory(record["memory"])
    if "step" in parts:
        record["step_seconds"] = step = step_part(values, shards, args.repeats)
        print(f"\nPPO update (demo size, one rollout batch, all epochs), median of "
              f"{step['repeats']} alternated: full {step['full']:.3f} s, LoRA r8 "
              f"{step['lora']:.3f} s = {step['ratio']:.2f}x")  # fmt: skip
    if "quality" in parts:
        factors = [float(f) for f in args.lora_lr_factors.split(",")]
        record["quality"] = quality_part(values, shards, root, factors)
        settings = "settings " + " ".join(args.set) if args.set else "demo settings"
        record["targets"] += report_quality(record["quality"], settings)
    for check in record["targets"]:
        print(f"{'PASS' if check['met'] else 'FAIL'}  {check['target']}: {check['figures']}")
    record["seconds"] = time.perf_counter() - started
    print(f"benchmark wall time {record['seconds']:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2, default=float) + "\n")
    return 0  # a missed target is a figure (FAIL above, "met" in the JSON), not an error


if __name__ == "__main__":
    sys.exit(main())
