"""PPO iteration throughput against this machine's peak, and against TRL's PPOTrainer.

Two shapes, each printed as rollout, update and total time, tokens/s and model FLOP/s as
a fraction of the peak measured at the start of the same run (benchmarks/_roofline.py):

* demo: the demo preset's widths (4 layers, width 128, 4 heads, 2 KV heads, MLP 384,
  vocabulary 259, tied embeddings) for policy, reference, critic and reward model,
  batch 32, prompt 16 + response 32 tokens, 4 PPO epochs x 2 minibatches; side by side
  with TRL at the same shapes and settings (tokens/s and the ratio);
* real: responses of 256 tokens after 64-token prompts, a model twice the demo's width
  (width 256, 2 layers, MLP 768: benchmarks/_shapes.py), same batch and PPO settings, EOS
  id 2 (random weights end some responses early); alignpipe only.

Throughput counts (prompt + response) tokens of the rollout batch per second of a whole
iteration (rollout + update), after warm-up; each side reports its FASTEST iteration, the
figure least distorted by other load on a shared machine. The two sides take turns:
``--rounds`` times, alignpipe's iterations then TRL's (in a fresh process), so load that
comes and goes hits both alike. Model FLOPs: the rollout's sampling (prefill and the
decode steps it ran, over the whole KV cache) and four scoring passes (policy and
reference log-probs, critic values, reward); the update's epochs x (policy + critic)
training steps over the whole padded batch (_roofline.py gives the formulas).
``ALIGNPIPE_CPU_DEVICES`` sets alignpipe's device count (8). TRL needs the ``[bench]``
extra (trl==1.12.0, torch, transformers); without it only alignpipe's figures print.

    python benchmarks/bench_ppo.py [--iterations 4] [--rounds 2] [--real-iterations 2] [--quick]

The whole run takes 4 to 6 min on the 2-core development machine under other load (load
average 7 to 9), most of it the real shape; ``--quick`` (2 and 1 timed iterations, one
round) about 3.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402

# Before the backend starts: the CPU device count (8 = the stage's local default).
jax.config.update("jax_num_cpu_devices", int(os.environ.get("ALIGNPIPE_CPU_DEVICES", "8")))

import _roofline  # noqa: E402
import numpy as np  # noqa: E402
from _shapes import DEMO, REAL, REAL_PROMPT, REAL_RESPONSE, Shape  # noqa: E402
from flax import nnx  # noqa: E402

from components.core.model.artifact import create_model  # noqa: E402
from components.core.model.config import ModelConfig  # noqa: E402
from components.core.training import parallel  # noqa: E402
from components.ppo import PPOConfig  # noqa: E402
from components.ppo.kl_control import init_kl_controller  # noqa: E402
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
DEMO_SHAPE = Shape("demo", DEMO, BATCH, PROMPT, RESPONSE)
REAL_SHAPE = Shape("real", REAL, BATCH, REAL_PROMPT, REAL_RESPONSE)


class Measured(NamedTuple):
    """alignpipe's fastest rollout and update at one shape, and what they computed."""

    rollout_s: float
    update_s: float
    config: ModelConfig  # the policy's (critic, reference and reward model: same shape)
    decode_steps: list[int]  # per device, in the fastest rollout (fewer if every row ended)


class Iteration(NamedTuple):
    """One timed alignpipe iteration."""

    rollout_s: float
    update_s: float
    decode_steps: list[int]  # per device: the decode loop ran until its longest row ended


class AlignpipeRun:
    """A PPO run at ``shape`` on every CPU device, timed one iteration at a time; its first
    iteration (compiling) runs here. ``run(n)`` times n more: the state carries over, so
    rounds taking turns with TRL continue one run."""

    def __init__(self, shape: Shape, remat: str) -> None:
        config = PPOConfig(
            rollout_batch_size=shape.batch, minibatches=MINIBATCHES, ppo_epochs=EPOCHS,
            prompt_len=shape.prompt, max_new_tokens=shape.response, warmup_steps=0,
        ).resolved(pretrained=False)  # fmt: skip
        policy = create_model("demo", VOCAB, scalar_head=False, seed=0, remat=remat, **shape.model)
        critic = create_model("demo", VOCAB, scalar_head=True, seed=1, remat=remat, **shape.model)
        policy_graph, policy_params = nnx.split(policy, nnx.Param)
        critic_graph, critic_params = nnx.split(critic, nnx.Param)
        models = Models(policy_graph, critic_graph, critic_graph)
        self.config = policy.config
        self.rollout = make_rollout(models, config, TokenIds(2, 0), ScoreNorm(0.0, 1.0, 1.0, 5.0))
        self.update = make_update(models, config)
        self.state = parallel.replicate(PPOState.create(policy_params, critic_params, config))
        self.reference = parallel.replicate(policy_params)
        self.reward = parallel.replicate(critic_params)
        tokens = np.random.default_rng(0).integers(3, VOCAB, (shape.batch, shape.prompt))
        tokens = tokens.astype(np.int32)
        self.prompts = parallel.shard_batch(
            {"prompt_tokens": tokens, "prompt_mask": np.ones_like(tokens)}
        )
        self.done = 0
        self.iteration()  # compiles

    def iteration(self) -> Iteration:
        """One rollout and update, timed."""
        key = jax.random.PRNGKey(self.done)
        self.done += 1
        start = time.perf_counter()
        policy, critic = self.state.policy.params, self.state.critic.params
        params = RolloutParams(policy, self.reference, critic, self.reward)
        fixed = init_kl_controller("fixed", 0.01)
        batch, metrics, _ = self.rollout(params, self.prompts, key, fixed)
        host_floats(metrics)
        middle = time.perf_counter()
        self.state, metrics = self.update(self.state, batch, key, np.float32(1.0), np.float32(0.0))
        host_floats(metrics)
        end = time.perf_counter()
        # A device's decode loop ran until its longest response ended: length - 1 steps.
        lengths = np.asarray(batch["response_mask"]).sum(axis=-1).max(axis=-1)
        return Iteration(middle - start, end - middle, [int(n) - 1 for n in lengths])

    def __call__(self, iterations: int) -> list[Iteration]:
        return [self.iteration() for _ in range(iterations)]


def fastest(iterations: list[Iteration], config: ModelConfig) -> Measured:
    """The fastest rollout (with its decode steps) and the fastest update of ``iterations``."""
    quickest = min(iterations, key=lambda it: it.rollout_s)
    update_s = min(it.update_s for it in iterations)
    return Measured(quickest.rollout_s, update_s, config, quickest.decode_steps)


def rollout_flops(measured: Measured, shape: Shape) -> tuple[int, int]:
    """Model FLOPs of one rollout: sampling on every device (prefill and decode steps), and
    the four scoring passes (policy and reference log-probs, critic values, reward)."""
    config, rows = measured.config, shape.batch // len(measured.decode_steps)
    sampling = sum(
        _roofline.generate_flops(config, rows, shape.prompt, shape.response, steps)
        for steps in measured.decode_steps
    )
    length = shape.prompt + shape.response
    log_probs = _roofline.forward_flops(config, shape.batch, length, shape.response)
    values_and_reward = _roofline.forward_flops(config, shape.batch, length)
    return sampling, 2 * log_probs + 2 * values_and_reward


def update_flops(measured: Measured, shape: Shape) -> int:
    """Model FLOPs of one update: every epoch trains policy and critic on the whole batch."""
    config, length = measured.config, shape.prompt + shape.response
    policy = _roofline.train_flops(config, shape.batch, length, shape.response)
    return EPOCHS * (policy + _roofline.train_flops(config, shape.batch, length))


def report(measured: Measured, shape: Shape, peak: _roofline.Peak, remat: str) -> float:
    """Print rollout, update and total figures; return the iteration's tokens/s."""
    tokens = shape.batch * (shape.prompt + shape.response)
    dtype = measured.config.dtype
    sampling, scoring = rollout_flops(measured, shape)
    phases = {
        "rollout": (measured.rollout_s, sampling + scoring),
        "update": (measured.update_s, update_flops(measured, shape)),
    }
    phases["total"] = tuple(sum(values) for values in zip(*phases.values(), strict=True))
    print(
        f"alignpipe ({len(measured.decode_steps)} {jax.devices()[0].platform} devices, pmap, "
        f"remat {remat}, {dtype}; decode steps per device {measured.decode_steps}):"
    )
    for name, (seconds, flops) in phases.items():
        print(
            f"  {name:<7} {seconds * 1e3:9.1f} ms  {tokens / seconds:9,.0f} tokens/s  "
            f"{flops / 1e9:8.1f} GFLOP  {_roofline.of_peak(flops, seconds, peak, dtype)}"
        )
    print(f"  rollout FLOPs: sampling {sampling / 1e9:.1f} G, scoring {scoring / 1e9:.1f} G")
    return tokens / phases["total"][0]


def describe_shape(shape: Shape) -> str:
    """The iteration's shape in one line."""
    model = ", ".join(f"{name} {value}" for name, value in shape.model.items())
    return (
        f"PPO iteration, {shape.name} shape: batch {shape.batch}, prompt {shape.prompt} + "
        f"response {shape.response} tokens, {EPOCHS} epochs x {MINIBATCHES} minibatches, "
        f"model {model}, vocabulary {VOCAB}"
    )


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
        "--real-iterations", type=int, default=2, help="timed iterations at the real shape"
    )
    parser.add_argument(
        "--quick", action="store_true", help="2 timed iterations at the demo shape, 1 at the real"
    )
    parser.add_argument(
        "--remat", default="none", choices=["none", "full", "dots_saveable"],
        help="alignpipe's layer remat (TRL runs without gradient checkpointing)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=2, help="turns alignpipe and TRL take, side by side"
    )
    parser.add_argument("--skip-trl", action="store_true", help="only alignpipe's figures")
    parser.add_argument("--skip-real", action="store_true", help="only the demo shape")
    parser.add_argument("--trl-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_only:  # the child process of trl_in_subprocess: print seconds, nothing else
        print(json.dumps(trl_seconds(args.iterations)))
        return
    if args.quick:
        args.iterations, args.real_iterations, args.rounds = 2, 1, 1
    started = time.perf_counter()
    peak = _roofline.measure_peak()
    print(_roofline.describe(peak))
    print(describe_shape(DEMO_SHAPE))
    # Taking turns: each round times alignpipe's iterations, then TRL's in a fresh process,
    # so load on the shared machine hits both sides alike; each keeps its fastest.
    run = AlignpipeRun(DEMO_SHAPE, args.remat)
    ours_iterations, trl_times = [], []
    for _ in range(args.rounds):
        ours_iterations += run(args.iterations)
        trl_s = None if args.skip_trl else trl_in_subprocess(args.iterations)
        if trl_s is not None:
            trl_times.append(trl_s)
    ours = report(fastest(ours_iterations, run.config), DEMO_SHAPE, peak, args.remat)
    if not trl_times:
        print("TRL: skipped or not installed (pip install -e '.[bench]'); no ratio")
    else:
        import torch

        theirs = DEMO_SHAPE.batch * (DEMO_SHAPE.prompt + DEMO_SHAPE.response) / min(trl_times)
        print(
            f"TRL 1.12 PPOTrainer (torch, {torch.get_num_threads()} threads; fastest iteration "
            f"of {len(trl_times)} rounds taking turns with alignpipe's):"
        )
        print(f"  total   {min(trl_times) * 1e3:9.1f} ms  {theirs:9,.0f} tokens/s")
        print(f"ratio alignpipe / TRL: {ours / theirs:.2f}x (target >= 3x)")
    if not args.skip_real:
        print(describe_shape(REAL_SHAPE))
        run = AlignpipeRun(REAL_SHAPE, args.remat)
        report(fastest(run(args.real_iterations), run.config), REAL_SHAPE, peak, args.remat)
    print(f"benchmark wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
