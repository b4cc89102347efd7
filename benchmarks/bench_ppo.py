"""PPO iteration throughput: alignpipe (JAX, pmap over 8 CPU devices) vs TRL's PPOTrainer.

Same shapes on both sides: the demo preset's widths (4 layers, width 128, 4 heads,
2 KV heads, MLP 384, vocabulary 259, tied embeddings) for policy, reference,
critic and reward model; the same rollout batch, prompt and response lengths,
PPO epochs and minibatches. Throughput counts (prompt + response) tokens of the
rollout batch per second of a whole iteration (rollout + update), after warm-up;
each side reports its FASTEST iteration, the figure least distorted by other load
on a shared machine. ``ALIGNPIPE_CPU_DEVICES`` sets alignpipe's device count (8).
TRL needs the ``[bench]`` extra (trl==1.12.0, torch, transformers); without it
only alignpipe's figures print.

    python benchmarks/bench_ppo.py [--iterations 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

# Before the backend starts: the CPU device count (8 = the stage's local default).
jax.config.update("jax_num_cpu_devices", int(os.environ.get("ALIGNPIPE_CPU_DEVICES", "8")))

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from components.core import parallel  # noqa: E402
from components.core.model_io import create_model  # noqa: E402
from components.ppo import PPOConfig  # noqa: E402
from components.ppo.loop import host_floats  # noqa: E402
from components.ppo.rollout import (  # noqa: E402
    Models,
    RolloutParams,
    ScoreNorm,
    TokenIds,
    make_rollout,
)
from components.ppo.update import PPOState, make_update  # noqa: E402

VOCAB, BATCH, PROMPT, RESPONSE, EPOCHS, MINIBATCHES = 259, 32, 16, 32, 4, 2
DEMO = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=384)


def alignpipe_seconds(iterations: int, remat: str) -> tuple[float, float]:
    """Fastest rollout and update seconds (demo model, every CPU device), after compiling."""
    config = PPOConfig(
        rollout_batch_size=BATCH, minibatches=MINIBATCHES, ppo_epochs=EPOCHS,
        prompt_len=PROMPT, max_new_tokens=RESPONSE, warmup_steps=0,
    ).resolved(pretrained=False)  # fmt: skip
    policy = create_model("demo", VOCAB, scalar_head=False, seed=0, remat=remat)
    critic = create_model("demo", VOCAB, scalar_head=True, seed=1, remat=remat)
    policy_graph, policy_params = nnx.split(policy, nnx.Param)
    critic_graph, critic_params = nnx.split(critic, nnx.Param)
    models = Models(policy_graph, critic_graph, critic_graph)
    rollout = make_rollout(models, config, TokenIds(2, 0), ScoreNorm(0.0, 1.0, 1.0, 5.0))
    update = make_update(models, config)
    state = parallel.replicate(PPOState.create(policy_params, critic_params, config))
    reference, reward = parallel.replicate(policy_params), parallel.replicate(critic_params)
    rng = np.random.default_rng(0)
    prompts = parallel.shard_batch(
        {
            "prompt_tokens": rng.integers(3, VOCAB, (BATCH, PROMPT)).astype(np.int32),
            "prompt_mask": np.ones((BATCH, PROMPT), np.int32),
        }
    )
    rollout_times, update_times = [], []
    for step in range(iterations + 1):  # the first iteration compiles
        key = jax.random.PRNGKey(step)
        start = time.perf_counter()
        params = RolloutParams(state.policy.params, reference, state.critic.params, reward)
        batch, metrics = rollout(params, prompts, key, np.float32(0.01))
        host_floats(metrics)
        middle = time.perf_counter()
        state, metrics = update(state, batch, key, np.float32(1.0), np.float32(0.0))
        host_floats(metrics)
        end = time.perf_counter()
        if step:
            rollout_times.append(middle - start)
            update_times.append(end - middle)
    return min(rollout_times), min(update_times)


def trl_seconds(iterations: int) -> float | None:
    """Fastest TRL PPO iteration in seconds, or None without the [bench] extra."""
    try:
        import torch
        from datasets import Dataset
        from tokenizers import Tokenizer, models
        from transformers import (
            LlamaConfig,
            LlamaForCausalLM,
            LlamaForSequenceClassification,
            PreTrainedTokenizerFast,
            TrainerCallback,
        )
        from trl.experimental.ppo import PPOConfig as TRLConfig
        from trl.experimental.ppo import PPOTrainer
    except ImportError:
        return None
    torch.manual_seed(0)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"b{i}": i + 3 for i in range(VOCAB - 3)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>", bos_token="<s>", eos_token="</s>",
    )  # fmt: skip
    shape = LlamaConfig(
        vocab_size=VOCAB, hidden_size=DEMO["dim"], num_hidden_layers=DEMO["n_layers"],
        num_attention_heads=DEMO["n_heads"], num_key_value_heads=DEMO["n_kv_heads"],
        intermediate_size=DEMO["hidden_dim"], tie_word_embeddings=True, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, num_labels=1,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    rows = rng.integers(3, VOCAB, (BATCH * (iterations + 1), PROMPT)).tolist()
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = TRLConfig(
            # TRL's rollout batch is per_device x accumulation; each minibatch one micro-batch.
            output_dir=out, per_device_train_batch_size=BATCH // MINIBATCHES,
            gradient_accumulation_steps=MINIBATCHES, num_mini_batches=MINIBATCHES,
            num_ppo_epochs=EPOCHS, response_length=RESPONSE,
            total_episodes=BATCH * (iterations + 1), local_rollout_forward_batch_size=BATCH,
            report_to=[], save_strategy="no", use_cpu=True, num_sample_generations=0,
            learning_rate=1e-5, logging_steps=1000,
        )  # fmt: skip
        trainer = PPOTrainer(
            args=args, processing_class=tokenizer, model=LlamaForCausalLM(shape),
            ref_model=LlamaForCausalLM(shape), reward_model=LlamaForSequenceClassification(shape),
            value_model=LlamaForSequenceClassification(shape),
            train_dataset=Dataset.from_dict({"input_ids": rows}), callbacks=[Stamp()],
        )  # fmt: skip
        start = time.perf_counter()
        trainer.train()
    times = np.diff([start, *stamps])[1:]  # the first iteration warms up
    return float(np.min(times))


def trl_in_subprocess(iterations: int) -> float | None:
    """TRL's figure from a fresh process: JAX's idle CPU threads never share torch's cores."""
    command = [sys.executable, os.path.abspath(__file__), "--trl-only"]
    result = subprocess.run(
        [*command, "--iterations", str(iterations)], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4, help="timed iterations per side")
    parser.add_argument(
        "--remat", default="none", choices=["none", "full", "dots_saveable"],
        help="alignpipe's layer remat (TRL runs without gradient checkpointing)",
    )  # fmt: skip
    parser.add_argument("--skip-trl", action="store_true", help="only alignpipe's figures")
    parser.add_argument("--trl-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_only:  # the child process of trl_in_subprocess: print seconds, nothing else
        print(json.dumps(trl_seconds(args.iterations)))
        return
    tokens = BATCH * (PROMPT + RESPONSE)
    print(
        f"PPO iteration: batch {BATCH}, prompt {PROMPT} + response {RESPONSE} tokens, "
        f"{EPOCHS} epochs x {MINIBATCHES} minibatches, demo-size model, CPU"
    )
    rollout_s, update_s = alignpipe_seconds(args.iterations, args.remat)
    ours = tokens / (rollout_s + update_s)
    print(f"alignpipe ({jax.local_device_count()} CPU devices, pmap, remat {args.remat}):")
    print(f"  rollout {rollout_s * 1e3:8.1f} ms  {tokens / rollout_s:10,.0f} tokens/s")
    print(f"  update  {update_s * 1e3:8.1f} ms  {tokens / update_s:10,.0f} tokens/s")
    print(f"  total   {(rollout_s + update_s) * 1e3:8.1f} ms  {ours:10,.0f} tokens/s")
    trl_s = None if args.skip_trl else trl_in_subprocess(args.iterations)
    if trl_s is None:
        print("TRL: skipped or not installed (pip install -e '.[bench]'); no ratio")
        return
    import torch

    theirs = tokens / trl_s
    print(f"TRL 1.12 PPOTrainer (torch, {torch.get_num_threads()} threads):")
    print(f"  total   {trl_s * 1e3:8.1f} ms  {theirs:10,.0f} tokens/s")
    print(f"ratio alignpipe / TRL: {ours / theirs:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()
