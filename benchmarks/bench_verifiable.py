"""Verifiable rewards on the built-in reasoning task: alignpipe's GRPO against TRL's
GRPOTrainer, side by side, over seeds.

Per seed, both start from the same policy: the task's data (``alignpipe run --task
arithmetic``'s: 450 max/min problems, a quarter held out by prompt hash, 128 formatted
solutions) is sharded and alignpipe's sft stage trains the demo preset on the solutions;
TRL gets that policy exported to a Hugging Face folder (``alignpipe export``). Both then run
GRPO on the same train prompts with ``builtin/exact-match`` alone and the task's settings
(pipelines/dag/tasks.py): 500 rollouts of 16 prompts x 8 completions, 2 minibatches x 4
epochs each (TRL: generation_batch_size 128, per-device batch 64, num_iterations 4), learning
rate 1e-4 after 10 warm-up steps, beta 0, DAPO's loss, group-std scaling, 6 new tokens.

Printed per seed and framework: greedy accuracy on the held-out problems before (the sft
policy) and after, the gain with its 95% bootstrap interval (paired over prompts), the
GRPO wall time (alignpipe: the whole stage, its start and compiles included; TRL:
``trainer.train()``) and the sampled tokens per second of it; for alignpipe also the share
of rollout time its host spent in the reward function. Then the targets, judged over every
seed: gain >= 0.20 with the interval's low bound > 0; host scoring <= 15% of rollout time.

TRL runs in a fresh process per seed (torch and JAX do not share 2 cores well), for the
seeds ``--trl-seeds`` names (seed 0: on 2 cores its run takes several times alignpipe's),
and needs the ``[bench]`` extra (trl==1.12.0); ``--skip-trl`` prints alignpipe's alone.

    python benchmarks/bench_verifiable.py [--seeds 0,1,2] [--skip-trl] [--json FILE]

``BENCH_ITERATIONS=4`` shortens both runs (a check that the benchmark runs, not a figure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from components.core.entry import start_process  # noqa: E402

start_process()

import numpy as np  # noqa: E402

from components.core.data import reasoning_task  # noqa: E402
from components.core.data.prompts import prompt_dataset  # noqa: E402
from components.core.rewards.builtin import BUILTIN  # noqa: E402
from components.core.training.metrics import read_metrics  # noqa: E402
from components.evaluate.verifiable import verifiable_summary  # noqa: E402
from pipelines.dag.tasks import ARITHMETIC  # noqa: E402

VERIFIER = ARITHMETIC["reward_functions"]
ITERATIONS = int(os.environ.get("BENCH_ITERATIONS", ARITHMETIC["ppo_iterations"]))
BATCH, GROUP = ARITHMETIC["ppo_rollout_batch_size"], ARITHMETIC["group_size"]
MINIBATCHES, EPOCHS = 2, 4  # PPOConfig's defaults, which the task keeps
LEARNING_RATE, NEW_TOKENS = ARITHMETIC["ppo_learning_rate"], ARITHMETIC["max_new_tokens"]
WARMUP = 10  # PPOConfig's warmup_steps


def prepare(root: Path, seed: int) -> dict[str, str]:
    """The task's shards and the sft policy of ``seed``, as the pipeline makes them."""
    import components.sft as sft
    from components.shard import ShardConfig
    from components.shard import run as shard_run

    paths = {name: str(root / name) for name in ("prompts", "sft_shards", "sft")}
    reasoning_task.write_task(str(root), seed=seed)
    shard = ShardConfig(
        num_shards=1, tokenizer="builtin-arithmetic", eval_fraction=ARITHMETIC["eval_fraction"],
        min_eval_pairs=ARITHMETIC["min_eval_pairs"],
    )  # fmt: skip
    shard_run(shard, [str(root / reasoning_task.PROMPTS_FILE)], paths["prompts"])
    shard_run(shard, [str(root / reasoning_task.SFT_FILE)], paths["sft_shards"])
    config = sft.SFTConfig(
        preset="demo", steps=ARITHMETIC["sft_steps"], batch_size=ARITHMETIC["sft_batch_size"],
        learning_rate=ARITHMETIC["sft_learning_rate"], max_len=0, seed=seed, report_to="none",
    )  # fmt: skip
    sft.run(config, paths["sft_shards"], paths["sft"])
    return paths


def texts(shards: str, split: str) -> tuple[list[str], list[str]]:
    """A split's unique prompts and their answers, in shard order."""
    batches = prompt_dataset(
        shards, split, batch_size=1, prompt_len=16, seed=0, host_index=0, host_count=1,
        shuffle=False, repeat=False, with_text=True,
    )  # fmt: skip
    prompts = [str(text) for text in batches.texts[:, 0]]
    answers = [json.loads(columns)["answer"] for columns in batches.texts[:, 1]]
    return prompts, answers


def ours(paths: dict[str, str], root: Path, seed: int) -> dict[str, Any]:
    """alignpipe's GRPO from the sft policy, and the evaluate stage's verifiable figures."""
    from components.evaluate.config import EvalConfig
    from components.evaluate.stage import run as evaluate
    from components.ppo import PPOConfig
    from components.ppo import run as train

    output = str(root / "grpo")
    config = PPOConfig(
        algorithm="grpo", group_size=GROUP, iterations=ITERATIONS, rollout_batch_size=BATCH,
        minibatches=MINIBATCHES, ppo_epochs=EPOCHS, learning_rate=LEARNING_RATE,
        max_new_tokens=NEW_TOKENS, adaptive_kl=False, kl_coef=0.0, kl_stop=ARITHMETIC["kl_stop"],
        reward_functions=VERIFIER, seed=seed, save_every=ITERATIONS, report_to="none",
    )  # fmt: skip
    start = time.perf_counter()
    train(config, paths["prompts"], paths["sft"], "", output)
    seconds = time.perf_counter() - start
    rows = [row for row in read_metrics(output) if "time/rollout_s" in row]
    rollout_s = sum(row["time/rollout_s"] for row in rows)
    scoring_s = sum(row["time/reward_functions_s"] for row in rows)
    tokens = sum(BATCH * row["response_length"] for row in rows)  # sampled, EOS included
    evaluation = EvalConfig(
        reward_functions=VERIFIER, max_new_tokens=NEW_TOKENS, max_eval_prompts=1000,
        pass_samples=0, seed=seed, report_to="none",
    )  # fmt: skip
    summary = evaluate(evaluation, paths["prompts"], output, paths["sft"], "", str(root / "eval"))
    gain = summary["accuracy_gain"]
    return {
        "before": summary["reference"]["accuracy"],
        "after": summary["accuracy"],
        "gain": gain["value"],
        "interval": gain["interval"],
        "prompts": summary["prompts"],
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "scoring_share": scoring_s / rollout_s,
    }


def trl_run(paths: dict[str, str], root: Path, seed: int) -> dict[str, Any] | None:
    """TRL's GRPOTrainer from the exported sft policy (in this process; None without TRL)."""
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        return None
    from components.hf.export import export_hf

    torch.manual_seed(seed)
    torch.set_num_threads(os.cpu_count() or 1)
    folder = str(root / "sft_hf")
    export_hf(paths["sft"], folder, dtype="float32")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    # alignpipe's prompts start with bos (Tokenizer.encode_prompt); TRL's tokenization of
    # plain text adds none with this tokenizer, so the text carries it.
    train_prompts, train_answers = texts(paths["prompts"], "train")
    held_prompts, held_answers = texts(paths["prompts"], "eval")
    dataset = Dataset.from_dict(
        {"prompt": [f"<s> {p}" for p in train_prompts], "answer": train_answers}
    )
    generated = [0]  # completion tokens TRL sampled (EOS included, as alignpipe counts them)

    def exact_match(prompts, completions, answer, completion_ids=None, **kwargs):
        generated[0] += sum(len(ids) for ids in completion_ids or ())
        return BUILTIN[VERIFIER](prompts, completions, answer=answer)

    def greedy(model) -> np.ndarray:
        model.eval()
        batch = tokenizer([f"<s> {p}" for p in held_prompts], return_tensors="pt", padding=True,
                          padding_side="left")  # fmt: skip
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
        decoded = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :],
                                         skip_special_tokens=True)  # fmt: skip
        return np.array(BUILTIN[VERIFIER](held_prompts, decoded, answer=held_answers)) >= 1.0

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    before = greedy(model)
    args = GRPOConfig(
        output_dir=str(root / "trl"), per_device_train_batch_size=BATCH // MINIBATCHES,
        generation_batch_size=BATCH, num_generations=GROUP, num_iterations=EPOCHS,
        max_steps=ITERATIONS * MINIBATCHES * EPOCHS, learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant_with_warmup", warmup_steps=WARMUP, beta=0.0,
        loss_type="dapo", scale_rewards="group", max_completion_length=NEW_TOKENS,
        temperature=1.0, use_cpu=True, report_to=[], save_strategy="no", logging_steps=10**6,
        seed=seed, bf16=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=exact_match, args=args, train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = greedy(trainer.model)
    return _figures(before, after, seconds, generated[0], seed)


def _figures(before, after, seconds: float, tokens: int, seed: int) -> dict[str, Any]:
    ones = np.ones(len(after))
    summary = verifiable_summary(
        after, None, ones, ones > 0, ks=(), n_resamples=1000, confidence=0.95, seed=seed,
        reference={"greedy_correct": before, "sampled_correct": None, "lengths": ones,
                   "ended": ones > 0},
    )  # fmt: skip
    gain = summary["accuracy_gain"]
    return {
        "before": float(np.mean(before)), "after": float(np.mean(after)), "gain": gain["value"],
        "interval": gain["interval"], "prompts": len(after), "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }  # fmt: skip


def trl_in_subprocess(paths: dict[str, str], root: Path, seed: int) -> dict[str, Any] | None:
    command = [sys.executable, os.path.abspath(__file__), "--trl-only", json.dumps(
        {"paths": paths, "root": str(root), "seed": seed})]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        print(result.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(result.stdout.strip().splitlines()[-1])


def _row(seed: int, name: str, figures: dict[str, Any] | None) -> str:
    if figures is None:
        return f"{seed:>4}  {name:<9} (not run: install the [bench] extra for TRL)"
    low, high = figures["interval"]
    share = figures.get("scoring_share")
    return (
        f"{seed:>4}  {name:<9} {figures['before']:>6.3f} {figures['after']:>6.3f} "
        f"{figures['gain']:>+6.3f} [{low:+.3f}, {high:+.3f}] {figures['seconds']:>7.1f} "
        f"{figures['tokens_per_s']:>9.0f} " + (f"{share:>7.1%}" if share is not None else "      -")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (0,1,2)")
    parser.add_argument("--skip-trl", action="store_true", help="alignpipe's figures alone")
    parser.add_argument(
        "--trl-seeds", default="0",
        help="the seeds TRL also runs (0: one more GRPO run per seed)",
    )  # fmt: skip
    parser.add_argument("--json", default="", help="also write every figure to this file")
    parser.add_argument("--trl-only", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_only:  # the child process of trl_in_subprocess: one JSON line
        job = json.loads(args.trl_only)
        print(json.dumps(trl_run(job["paths"], Path(job["root"]), job["seed"])))
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for seed in seeds:
            root = Path(folder) / f"seed{seed}"
            paths = prepare(root, seed)
            results[seed] = {"alignpipe": ours(paths, root, seed)}
            if not args.skip_trl and str(seed) in args.trl_seeds.split(","):
                results[seed]["trl"] = trl_in_subprocess(paths, root, seed)
    task = reasoning_task.UNSPLIT
    print(
        f"\nbuilt-in reasoning task ({'/'.join(task.operations)}, operands 0..{task.max_operand}"
        f"), demo preset, {ITERATIONS} GRPO rollouts of {BATCH // GROUP} prompts x {GROUP}; "
        "held-out greedy accuracy (exact match)"
    )
    print("seed  framework  before  after   gain  [95% interval]    GRPO s  tokens/s scoring")
    for seed, row in results.items():
        for name in ("alignpipe", "trl"):
            if name in row:
                print(_row(seed, name, row[name]))
    ok = [r["alignpipe"] for r in results.values()]
    gain_met = all(r["gain"] >= 0.20 and r["interval"][0] > 0 for r in ok)
    share = max(r["scoring_share"] for r in ok)
    print(
        f"target: alignpipe's gain >= 0.20 with its low bound > 0 on every seed: "
        f"{'met' if gain_met else 'NOT met'} (gains {[round(r['gain'], 3) for r in ok]})"
    )
    print(f"target: host scoring <= 15% of rollout time: {'met' if share <= 0.15 else 'NOT met'}"
          f" (at most {share:.2%})")  # fmt: skip
    trl = [r["trl"] for r in results.values() if r.get("trl")]
    if trl:
        ratio = np.mean([o["tokens_per_s"] for o in ok]) / np.mean([t["tokens_per_s"] for t in trl])
        print(
            f"alignpipe / TRL rollout tokens per second: {ratio:.2f}x; accuracy after: "
            f"{np.mean([o['after'] for o in ok]):.3f} / {np.mean([t['after'] for t in trl]):.3f}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
