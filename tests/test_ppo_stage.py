"""PPO stage end to end on the built-in task (tiny models, 8 CPU devices).

One module fixture trains the sft policy and the reward model; one PPO run
(``RUN``, 20 iterations) serves the gold-reward, artifact and resume
tests, so the rollout and update compile once for all of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

import components.reward as reward
import components.sft as sft
from components.core.data.builtin_task import write_jsonl
from components.core.data.input_pipeline import read_manifest
from components.core.data.tokenizers import BUILTIN_WORDS
from components.core.model.artifact import ModelMismatchError, load_model
from components.core.training.checkpoint import CheckpointRestoreError, read_model_config
from components.core.training.metrics import read_events, read_metrics
from components.ppo import PPOConfig, run
from components.ppo.__main__ import main as ppo_main
from components.ppo.stage import build_networks
from components.shard import ShardConfig
from components.shard import run as shard_run

pytestmark = pytest.mark.slow

# The built-in task in its own word-level tokenizer, as the pipeline and the demo shard it:
# sequences of at most 17 tokens (max_len 0: the longest pair in the data), where bytes
# took 84, so every step below costs a fraction of what it did.
TRAIN = dict(preset="tiny", batch_size=64, max_len=0, warmup_steps=20, eval_every=1000)
# The PPO run every test below shares (compiled once): small, but long enough to learn. Six
# response tokens (median), not bytes' 22, take a higher rate than the demo's auto 2e-5 to move in
# 20 iterations: measured gold +0.190 at KL 0.035 per token (3e-5: +0.051 at 0.004).
RUN = dict(
    iterations=20,
    rollout_batch_size=64,
    minibatches=2,
    learning_rate=1e-4,
    critic_learning_rate=3e-4,
    save_every=10,
)
TRL_NAMES = (
    "objective/kl",
    "objective/entropy",
    "objective/scores",
    "objective/rlhf_reward",
    "objective/non_score_reward",
    "policy/approxkl",
    "policy/clipfrac",
    "val/clipfrac",
    "loss/policy",
    "loss/value",
    "lr",
)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ppo_inputs")
    write_jsonl(str(root / "pairs.jsonl"), 2000)
    paths = {name: str(root / name) for name in ("shards", "sft", "reward")}
    config = ShardConfig(num_shards=8, tokenizer=BUILTIN_WORDS)
    shard_run(config, [str(root / "pairs.jsonl")], paths["shards"])
    # A policy that writes lexicon words, and a reward model warm-started from it (0.93 eval
    # accuracy).
    sft.run(
        sft.SFTConfig(steps=400, learning_rate=1e-2, save_every=1000, **TRAIN),
        paths["shards"],
        paths["sft"],
    )
    reward.run(
        reward.RewardConfig(
            steps=300, learning_rate=3e-3, base_policy=paths["sft"], save_every=1000, **TRAIN
        ),
        paths["shards"],
        paths["reward"],
    )
    return paths


def _run(artifacts: dict[str, str], output: str, **overrides) -> dict[str, float]:
    config = PPOConfig(**{**RUN, **overrides})
    return run(config, artifacts["shards"], artifacts["sft"], artifacts["reward"], output)


def _status(output: str) -> dict:
    with open(os.path.join(output, "ppo_status.json")) as handle:
        return json.load(handle)


def _params(model_dir: str) -> dict:
    model, _ = load_model(model_dir)
    return nnx.state(model, nnx.Param).to_pure_dict()


@pytest.fixture(scope="module")
def aligned(artifacts, tmp_path_factory) -> tuple[dict[str, float], str]:
    output = str(tmp_path_factory.mktemp("ppo_run") / "policy")
    return _run(artifacts, output), output


def test_ppo_raises_gold_reward_within_kl_stop(aligned) -> None:
    metrics, output = aligned
    status = _status(output)
    assert status["status"] == "completed", status["guard_events"]
    gold = status["gold_reward"]
    margin = gold["final"] - gold["initial"]
    print(
        f"gold reward on eval prompts: {gold['initial']:.3f} -> {gold['final']:.3f} (+{margin:.3f})"
    )
    assert margin > 0.1
    assert status["final_kl_per_token"] < PPOConfig().kl_stop
    # The stage's figures are those of the policy it outputs (its final check rollout).
    assert metrics["objective/kl_per_token"] == pytest.approx(status["final_kl_per_token"])
    assert metrics["gold/final"] == pytest.approx(gold["final"])
    # Rollout and update score with one function: the first minibatch's ratio is 1.
    assert max(r["policy/logprob_mismatch"] for r in read_metrics(output)) < 1e-4


def test_a_policy_and_a_reward_model_swapped_are_refused(artifacts) -> None:
    manifest = read_manifest(artifacts["shards"])
    reward_model, policy = artifacts["reward"], artifacts["sft"]
    with pytest.raises(ModelMismatchError, match="is a reward model .* pass a policy as --policy"):
        build_networks(PPOConfig(), manifest, reward_model, reward_model)
    with pytest.raises(ModelMismatchError, match="it is a policy, not a reward model"):
        build_networks(PPOConfig(), manifest, policy, policy)


def test_output_is_a_ppo_model_artifact(aligned) -> None:
    _, output = aligned
    model, info = load_model(output)
    assert info["stage"] == "ppo" and info["step"] == RUN["iterations"]
    assert model.scalar_head is None
    records = read_metrics(output)
    assert [r["step"] for r in records] == list(range(1, RUN["iterations"] + 1))
    for name in TRL_NAMES + ("time/rollout_tokens_per_s", "time/update_tokens_per_s"):
        assert all(np.isfinite(r[name]) for r in records), name
    assert os.listdir(os.path.join(output, "tensorboard"))
    # Length drift: each rollout's mean length against the first's, whose policy is the
    # reference.
    first = records[0]["response_length"]
    assert records[0]["response_length_ratio"] == 1.0
    for record in records:
        assert record["response_length_ratio"] == pytest.approx(record["response_length"] / first)


def _checkpoint_steps(output: str) -> list[int]:
    folder = os.path.join(output, "work", "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(name) for name in names if name.isdigit())


def test_sigkill_and_resume_ends_with_identical_parameters(artifacts, aligned, tmp_path) -> None:
    _, uninterrupted = aligned
    output = str(tmp_path / "policy")
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in RUN.items()]
    paths = ["--shards", artifacts["shards"], "--policy", artifacts["sft"]]
    paths += ["--reward-model", artifacts["reward"], "--output", output]
    imports = tmp_path / "imports.txt"  # -X importtime's lines: every module it imported
    with open(imports, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-X", "importtime", "-m", "components.ppo", *paths, *flags],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        deadline = time.time() + 300
        while _checkpoint_steps(output)[-1:] < [RUN["save_every"]] and time.time() < deadline:
            assert process.poll() is None, "the PPO process ended before it could be killed"
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert _checkpoint_steps(output), "no checkpoint was written before the kill"
    # Prompts read and TensorBoard events written (core's own TFRecord and event encoding):
    # the PPO process never imported TensorFlow.
    assert os.listdir(os.path.join(output, "tensorboard"))
    imported = [line.split("|")[-1].strip() for line in imports.read_text().splitlines()]
    assert "jax" in imported and not [m for m in imported if m.startswith("tensorflow")]
    assert not os.path.exists(os.path.join(output, "config.json"))
    _run(artifacts, output)
    expected, resumed = _params(uninterrupted), _params(output)
    jax.tree.map(np.testing.assert_array_equal, resumed, expected)
    # The reference's length came back with the checkpoint: the same drift figures.
    ratios = [r["response_length_ratio"] for r in read_metrics(output)]
    assert ratios == [r["response_length_ratio"] for r in read_metrics(uninterrupted)]


def test_sharded_resume_of_a_replicated_checkpoint_ends_alike(
    artifacts, aligned, tmp_path, sharded_placements
) -> None:
    """fsdp: checkpoints hold whole tensors, so a replicated run's checkpoint resumes in chunks;
    the sharded rollouts (layers gathered in the sampler's scans) and updates then reach the
    replicated run's parameters."""
    _, uninterrupted = aligned
    output = str(tmp_path / "policy")
    shutil.copytree(os.path.join(uninterrupted, "work"), os.path.join(output, "work"))
    for step in _checkpoint_steps(output):
        if step > RUN["save_every"]:
            shutil.rmtree(os.path.join(output, "work", "checkpoints", str(step)))
    metrics = _run(artifacts, output, fsdp=True)
    # State and reference (placed, then again on resume), reward model, gold before and after.
    assert len(sharded_placements) >= 4 and all(sharded_placements)
    assert _status(output)["status"] == "completed"
    assert [r["step"] for r in read_metrics(output)] == list(range(11, RUN["iterations"] + 1))
    expected, resumed = _params(uninterrupted), _params(output)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), resumed, expected
    )
    assert metrics["gold/final"] == pytest.approx(_status(uninterrupted)["gold_reward"]["final"])


def test_resuming_past_iterations_is_refused(artifacts, aligned, tmp_path) -> None:
    """A checkpoint at iteration 20 is not silently trained on (and on) to --iterations 10."""
    output = str(tmp_path / "policy")
    shutil.copytree(os.path.join(aligned[1], "work"), os.path.join(output, "work"))
    with pytest.raises(ValueError, match="iterations: 10, but the checkpoint in .* is at "
                       "iteration 20; pass --iterations 20 or more"):  # fmt: skip
        _run(artifacts, output, iterations=10)
    # Shards of other data (here: their manifest's source digest) continue no checkpoint.
    shards = str(tmp_path / "shards")
    shutil.copytree(artifacts["shards"], shards)
    manifest = json.loads(open(os.path.join(shards, "manifest.json")).read())
    manifest["sources"][0]["sha256"] = "0" * 64
    with open(os.path.join(shards, "manifest.json"), "w") as handle:
        json.dump(manifest, handle)
    with pytest.raises(CheckpointRestoreError, match="written with another --shards than now"):
        run(PPOConfig(**RUN), shards, artifacts["sft"], artifacts["reward"], output)
    assert not os.path.exists(os.path.join(output, "config.json"))


def test_learning_rate_blowup_trips_the_guard(artifacts, tmp_path) -> None:
    """Restorations raise kl_coef, show as events, and never send the steps backwards."""
    output = str(tmp_path / "policy")
    metrics = _run(
        artifacts, output, iterations=6, save_every=2, max_restores=2, kl_stop_patience=1,
        learning_rate=RUN["learning_rate"] * 1000,
    )  # fmt: skip
    status = _status(output)
    events = status["guard_events"]
    assert events and events[0]["action"] == "restored"
    kl_coef = PPOConfig().kl_coef
    # Doubled; the controller may have lowered it by at most 8% per iteration before.
    assert events[0]["kl_coef"] >= 2 * kl_coef * 0.92 ** events[0]["iteration"] * (1 - 1e-6)
    assert status["status"] in ("completed", "stopped_kl_guard")
    # The output's step counts the updates its policy had, not the iterations the run went.
    last = events[-1]
    if status["status"] == "completed":
        assert status["iterations"] == last["policy_updates"] + 6 - last["iteration"] <= 6
    else:
        assert status["iterations"] == last["policy_updates"] <= last["restored_to"]
    with open(os.path.join(output, "config.json")) as handle:
        assert json.load(handle)["step"] == status["iterations"]
    if status["status"] == "stopped_kl_guard":
        assert events[-1]["action"] == "stopped" and len(events) == 3
        if events[-1]["restored_to"] == 0:  # the last good policy is the initial one
            jax.tree.map(np.testing.assert_array_equal, _params(output), _params(artifacts["sft"]))
    # The output's own figures, whichever way the run ended.
    assert status["final_kl_per_token"] is not None
    assert status["final_kl_per_token"] < PPOConfig().kl_stop
    assert metrics["objective/kl_per_token"] == pytest.approx(status["final_kl_per_token"])
    steps = [r["step"] for r in read_metrics(output)]
    assert steps == sorted(set(steps))  # forward only, each once
    logged = read_events(output)
    assert [e["event"] for e in logged] == [f"guard_{e['action']}" for e in events]
    assert [e["iteration"] for e in logged] == [e["iteration"] for e in events]


@pytest.fixture(scope="module")
def group_runs(artifacts, tmp_path_factory) -> dict[str, tuple[dict[str, float], str]]:
    """One grpo and one rloo run of the shared RUN settings (16 prompts x 4 responses); rloo's
    with fsdp (its state, reference and reward model in chunks over the 8 devices) and a
    fifth of the train prompts held out for validation."""
    runs = {}
    for algorithm, extra in (("grpo", {}), ("rloo", {"fsdp": True, "validation_fraction": 0.2})):
        output = str(tmp_path_factory.mktemp(algorithm) / "policy")
        runs[algorithm] = (_run(artifacts, output, algorithm=algorithm, **extra), output)
    return runs


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_critic_free_algorithms_raise_gold_reward(group_runs, algorithm) -> None:
    metrics, output = group_runs[algorithm]
    status = _status(output)
    assert status["status"] == "completed", status["guard_events"]
    gold = status["gold_reward"]
    margin = gold["final"] - gold["initial"]
    print(f"{algorithm}: gold {gold['initial']:.3f} -> {gold['final']:.3f} (+{margin:.3f})")
    assert margin > 0.1  # measured: grpo +0.197, rloo (fsdp) +0.183
    assert status["final_kl_per_token"] < PPOConfig().kl_stop
    records = read_metrics(output)
    assert "val/mean" not in records[0] and "loss/value" not in records[0]
    assert all(r["reward_std"] > 0 for r in records)  # groups whose scores differ
    assert max(r["policy/logprob_mismatch"] for r in records) < 1e-4
    if algorithm == "rloo":  # validated on train prompts it never sampled
        validation = gold["validation"]
        assert validation["final"] - validation["initial"] > 0.1
        assert metrics["gold/validation_final"] == pytest.approx(validation["final"])
    else:
        assert "validation" not in gold and "gold/validation_final" not in metrics


def _halfway_copy(uninterrupted: str, output: str) -> None:
    """``uninterrupted``'s training state as a run killed after its halfway checkpoint."""
    shutil.copytree(os.path.join(uninterrupted, "work"), os.path.join(output, "work"))
    for step in _checkpoint_steps(output):
        if step > RUN["save_every"]:
            shutil.rmtree(os.path.join(output, "work", "checkpoints", str(step)))


def test_grpo_resumes_exactly(artifacts, group_runs, tmp_path, monkeypatch) -> None:
    """A checkpoint without a critic resumes to the uninterrupted run's parameters, with the
    score statistics the checkpoint holds: nothing is sampled to compute them again."""
    import components.ppo.stage as stage

    uninterrupted = group_runs["grpo"][1]
    output = str(tmp_path / "policy")
    _halfway_copy(uninterrupted, output)

    def sampled_again(*args, **kwargs):
        pytest.fail("the score statistics were sampled again on resume")

    monkeypatch.setattr(stage, "policy_score_stats", sampled_again)
    _run(artifacts, output, algorithm="grpo")
    assert _status(output)["score_norm"] == _status(uninterrupted)["score_norm"]
    assert [r["step"] for r in read_metrics(output)] == list(range(11, RUN["iterations"] + 1))
    jax.tree.map(np.testing.assert_array_equal, _params(output), _params(uninterrupted))


def test_a_resume_honours_a_changed_kl_target(artifacts, group_runs, tmp_path) -> None:
    """The resumed run's kl_target, not the checkpoint's, steers the coefficient from there
    on (the controller's state carries over: same kind)."""
    from components.ppo.checkpoints import ppo_checkpointer

    uninterrupted = group_runs["grpo"][1]
    output = str(tmp_path / "policy")
    _halfway_copy(uninterrupted, output)
    config = PPOConfig(**RUN, algorithm="grpo")
    with ppo_checkpointer(config, output) as checkpointer:
        halfway = checkpointer.latest_extra_json()["kl_controller"]
    assert halfway["target"] == pytest.approx(config.kl_target)
    # A target below the run's KL (the default's error is clipped at -1 there: e^-1 x 0.045
    # is above it), so the same KL's error rises against it.
    _run(artifacts, output, algorithm="grpo", kl_target=0.01)
    with ppo_checkpointer(config, output) as checkpointer:
        final = checkpointer.latest_extra_json()["kl_controller"]
    assert final["target"] == pytest.approx(0.01) and final["kind"] == "pid"
    # The first resumed iteration's coefficient: the checkpoint's stepped on the error
    # against the new target (the error of the same KL is higher: so is the coefficient).
    resumed, before = read_metrics(output)[0], read_metrics(uninterrupted)[RUN["save_every"]]
    assert resumed["step"] == before["step"] == RUN["save_every"] + 1
    assert resumed["objective/kl_per_token"] == before["objective/kl_per_token"]
    assert resumed["objective/kl_coef"] > before["objective/kl_coef"]


# Adapters at 5x RUN's policy rate, a shorter run than RUN's: measured gold +0.154 at KL 0.043.
# (The auto rates' factor is 10x, LORA_LEARNING_RATE_FACTOR; on RUN's raised rate that drove
# the KL over kl_stop at iteration 9, and the guard restored.)
LORA = dict(lora_rank=8, learning_rate=5e-4, critic_learning_rate=3e-3, iterations=12, save_every=6)


@pytest.fixture(scope="module")
def lora_aligned(artifacts, tmp_path_factory) -> tuple[dict[str, float], str]:
    output = str(tmp_path_factory.mktemp("ppo_lora") / "policy")
    return _run(artifacts, output, **LORA), output


def test_lora_ppo_raises_gold_reward_training_adapters_only(artifacts, lora_aligned) -> None:
    metrics, output = lora_aligned
    status = _status(output)
    assert status["status"] == "completed", status["guard_events"]
    gold = status["gold_reward"]
    margin = gold["final"] - gold["initial"]
    print(f"lora: gold {gold['initial']:.3f} -> {gold['final']:.3f} (+{margin:.3f})")
    assert margin > 0.1
    assert status["final_kl_per_token"] < PPOConfig().kl_stop
    records = read_metrics(output)
    # The reference is the policy's base with the adapters off: at the first rollout the
    # policy's adapters are still zero, so the two compute the same log-probs exactly.
    assert records[0]["objective/kl"] == 0.0
    assert max(r["policy/logprob_mismatch"] for r in records) < 1e-4
    policy = _params(output)
    assert read_model_config(output)["model"]["lora_rank"] == 8
    base = _params(artifacts["sft"])
    frozen = {k: v for k, v in policy["blocks"]["attn"]["wq"].items() if k != "lora"}
    jax.tree.map(np.testing.assert_array_equal, frozen, base["blocks"]["attn"]["wq"])
    assert float(np.abs(policy["blocks"]["attn"]["wq"]["lora"]["lora_b"]).max()) > 0


def test_lora_networks_hold_each_base_once(artifacts) -> None:
    config = PPOConfig(**{**RUN, **LORA})
    _, nets = build_networks(config, read_manifest(artifacts["shards"]), artifacts["sft"],
                             artifacts["reward"])  # fmt: skip
    paths = lambda tree: ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(tree)]  # noqa: E731
    # Trainable trees hold adapters (and heads) only; the bases are in nets.frozen, once each.
    assert paths(nets.policy) and all("/lora/" in p for p in paths(nets.policy))
    assert all("/lora/" in p or p.startswith("scalar_head") for p in paths(nets.critic))
    assert paths(nets.reward) == ["scalar_head/bias", "scalar_head/kernel"]
    policy_base, shared_base = nets.frozen
    assert not any(
        "lora" in p or "scalar_head" in p for p in paths(policy_base) + paths(shared_base)
    )
    # The reference is the policy's adapters with B zeroed: no copy of the base.
    assert paths(nets.reference) == paths(nets.policy)
    assert all(not np.any(v) for p, v in nnx.to_flat_state(nets.reference) if "lora_b" in p)


def test_lora_ppo_resumes_exactly(artifacts, lora_aligned, tmp_path) -> None:
    """A LoRA checkpoint holds the adapters' state only (the bases come from the inputs again);
    resumed, the run ends with the uninterrupted one's parameters. (Adapters under fsdp:
    tests/test_lora.py.)"""
    _, uninterrupted = lora_aligned
    output = str(tmp_path / "policy")
    shutil.copytree(os.path.join(uninterrupted, "work"), os.path.join(output, "work"))
    for step in _checkpoint_steps(output):
        if step > LORA["save_every"]:
            shutil.rmtree(os.path.join(output, "work", "checkpoints", str(step)))
    _run(artifacts, output, **LORA)
    resumed_steps = list(range(LORA["save_every"] + 1, LORA["iterations"] + 1))
    assert [r["step"] for r in read_metrics(output)] == resumed_steps
    jax.tree.map(np.testing.assert_array_equal, _params(output), _params(uninterrupted))


def test_cli_help_lists_the_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        ppo_main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--shards", "--policy", "--reward-model", "--output", "--kl-stop", "--ppo-epochs"):
        assert flag in text


def test_scores_are_normalized_on_the_starting_policys_samples(artifacts, aligned) -> None:
    """The run's score statistics are the reward model's over the sft policy's own samples of
    train prompts (recomputed alike: a resume normalizes as the first attempt did), not the
    data's chosen and rejected responses; score_norm=data keeps the latter."""
    from components.ppo.rollout import TokenIds
    from components.ppo.score_norm import policy_score_stats

    _, output = aligned
    norm = _status(output)["score_norm"]
    with open(os.path.join(artifacts["reward"], "reward_stats.json")) as handle:
        data = json.load(handle)
    assert norm["source"] == "quantile" and norm["std"] > 0  # the default
    assert abs(norm["mean"] - data["mean"]) > 0.1 * data["std"]
    training = read_model_config(output)["training"]
    manifest = read_manifest(artifacts["shards"])
    tokenizer = manifest["tokenizer"]
    ids = TokenIds(tokenizer["eos_id"], tokenizer["pad_id"], tokenizer["vocab_size"])
    policy, _ = load_model(artifacts["sft"])
    reward_model, _ = load_model(artifacts["reward"])
    again = policy_score_stats(
        policy, reward_model, artifacts["shards"], ids, prompt_len=training["prompt_len"],
        max_new_tokens=training["max_new_tokens"], temperature=training["temperature"],
        samples=training["score_norm_samples"], seed=training["seed"],
    )  # fmt: skip
    assert again["samples"] == training["score_norm_samples"]
    assert (again["mean"], again["std"]) == pytest.approx((norm["mean"], norm["std"]), rel=1e-5)
    config = PPOConfig(**RUN, score_norm="data", prompt_len=training["prompt_len"],
                       max_new_tokens=training["max_new_tokens"])  # fmt: skip
    _, nets = build_networks(
        config, manifest, artifacts["sft"], artifacts["reward"], shards_dir=artifacts["shards"]
    )
    assert (nets.norm.mean, nets.norm.std) == pytest.approx((data["mean"], data["std"]))
    assert nets.norm.quantiles == ()  # z-scores
    # score_norm quantile: the same samples' scores, ascending, make the calibration table.
    quantile = dataclasses.replace(config, score_norm="quantile")
    _, nets = build_networks(
        quantile, manifest, artifacts["sft"], artifacts["reward"], shards_dir=artifacts["shards"]
    )
    assert len(nets.norm.quantiles) == training["score_norm_samples"]
    assert list(nets.norm.quantiles) == sorted(again["quantiles"])
    assert np.mean(nets.norm.quantiles) == pytest.approx(norm["mean"], rel=1e-5)
