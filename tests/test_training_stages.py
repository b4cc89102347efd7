"""The sft and reward stages end to end on the built-in task (tiny models, 8 CPU devices)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from components.core.data.builtin_task import write_jsonl
from components.core.data.input_pipeline import DataError
from components.core.model.artifact import ModelMismatchError, is_pretrained, load_model
from components.core.training import parallel
from components.core.training.checkpoint import (
    CheckpointRestoreError,
    ModelArtifactError,
    input_fingerprint,
    read_model_config,
)
from components.core.training.config import FROM_SCRATCH_LEARNING_RATE, PRETRAINED_LEARNING_RATE
from components.core.training.metrics import read_metrics
from components.reward import RewardConfig
from components.reward import run as run_reward
from components.reward.stage import RewardAccuracyError
from components.reward.train import make_reward_eval_sums, make_reward_loss, summarize_eval
from components.sft import SFTConfig
from components.sft import run as run_sft
from components.shard import ShardConfig
from components.shard import run as run_shard

SMALL = dict(preset="tiny", max_len=24, batch_size=32, eval_every=20, save_every=20, seed=0)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    write_jsonl(str(folder / "pairs.jsonl"), 4000, seed=0)
    out = str(folder / "shards")
    config = ShardConfig(num_shards=4, tokenizer="builtin-words")
    run_shard(config, [str(folder / "pairs.jsonl")], out)
    return out


@pytest.fixture(scope="module")
def sft_model(shards, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sft"))
    summary = run_sft(SFTConfig(**SMALL, steps=40, learning_rate=3e-3, warmup_steps=5), shards, out)
    return out, summary


def test_sft_writes_model_artifact_and_lowers_eval_loss(sft_model):
    out, summary = sft_model
    info = read_model_config(out)
    assert info["stage"] == "sft" and info["step"] == 40 and not info["scalar_head"]
    assert info["tokenizer"]["kind"] == "hf" and os.path.isdir(os.path.join(out, "params"))
    evals = [r["eval/loss"] for r in read_metrics(out) if "eval/loss" in r]
    assert len(evals) == 2 and evals[-1] < evals[0]
    vocab = info["tokenizer"]["vocab_size"]
    assert summary["eval/loss"] < np.log(vocab) - 1.0  # well below a uniform guess


# Slow tier: a sharded train step against the replicated one is in make test (test_fsdp.py).
@pytest.mark.slow
def test_sft_with_fsdp_trains_like_replicated(sft_model, shards, tmp_path, sharded_placements):
    """The same 40 steps with state in chunks: the same model (float32 summation order aside)."""
    out = str(tmp_path / "sft")
    config = SFTConfig(**SMALL, steps=40, learning_rate=3e-3, warmup_steps=5, fsdp=True)
    summary = run_sft(config, shards, out)
    assert sharded_placements and all(sharded_placements)  # train state, and the final eval
    replicated, _ = load_model(sft_model[0])
    sharded, _ = load_model(out)
    leaves = [jax.tree.leaves(nnx.state(m)) for m in (replicated, sharded)]
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    assert summary["eval/loss"] == pytest.approx(sft_model[1]["eval/loss"], rel=1e-4)


def test_reward_model_learns_the_builtin_task(shards, tmp_path, monkeypatch):
    # Labels agree with the gold ordering on ~95% of pairs (builtin_task's noise), so
    # 0.9 eval accuracy means the model ranks nearly every pair as the gold reward does.
    import mlflow

    store = (tmp_path / "mlruns").as_uri()  # report_to mlflow: a local file store
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow.set_tracking_uri(store)
    out = str(tmp_path / "run-1" / "reward" / "rm")
    config = RewardConfig(
        **{**SMALL, "batch_size": 64, "eval_every": 100, "save_every": 300},
        steps=300, learning_rate=3e-3, report_to="tensorboard,mlflow",
    )  # fmt: skip
    try:
        summary = run_reward(config, shards, out)
    finally:
        mlflow.set_tracking_uri(None)
    assert summary["eval/accuracy"] >= 0.9
    assert summary["eval/pairs"] >= 300
    stats = json.loads(open(os.path.join(out, "reward_stats.json")).read())
    assert stats["std"] > 0 and stats["accuracy"] == summary["eval/accuracy"]
    assert os.listdir(os.path.join(out, "tensorboard"))
    # The same figures in MLflow, under the Hugging Face trainers' names, one run named
    # after the pipeline run.
    client = mlflow.tracking.MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("alignpipe").experiment_id])
    assert run.info.run_name == "run-1-reward" and run.data.params["steps"] == "300"
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in losses) == list(range(1, 301))
    assert run.data.metrics["eval/accuracy"] == summary["eval/accuracy"]


def test_reward_from_base_policy_keeps_backbone_and_adds_head(sft_model, shards, tmp_path):
    policy_dir, _ = sft_model
    policy, _ = load_model(policy_dir)
    reward, _ = load_model(policy_dir, scalar_head=True, seed=3)
    assert reward.scalar_head is not None
    np.testing.assert_array_equal(policy.embed.embedding[...], reward.embed.embedding[...])
    out = str(tmp_path / "rm")
    config = RewardConfig(**SMALL, steps=2, eval_batches=1, base_policy=policy_dir)
    run_reward(config, shards, out)
    info = read_model_config(out)
    assert info["scalar_head"] is True
    # The sft policy was trained from scratch: the auto learning rate is the from-scratch one.
    assert info["pretrained"] is False and not is_pretrained(out)
    assert info["training"]["learning_rate"] == FROM_SCRATCH_LEARNING_RATE == 1e-3


def _pretrained_copy(model_dir: str, folder) -> str:
    """``model_dir`` with its config.json marked as descending from pretrained weights."""
    info = json.loads(open(os.path.join(model_dir, "config.json")).read())
    folder.mkdir()
    os.symlink(os.path.join(model_dir, "params"), folder / "params")
    (folder / "config.json").write_text(json.dumps({**info, "pretrained": True}))
    return str(folder)


@pytest.mark.parametrize("stage", ["sft", pytest.param("reward", marks=pytest.mark.slow)])
def test_pretrained_start_gets_the_pretrained_learning_rate_and_passes_it_on(
    stage, sft_model, shards, tmp_path
):
    base = _pretrained_copy(sft_model[0], tmp_path / "base")
    assert is_pretrained(base)
    out = str(tmp_path / stage)
    if stage == "sft":
        run_sft(SFTConfig(**SMALL, steps=2, eval_batches=1, base_policy=base), shards, out)
    else:
        run_reward(RewardConfig(**SMALL, steps=2, eval_batches=1, base_policy=base), shards, out)
    info = read_model_config(out)
    assert info["training"]["learning_rate"] == PRETRAINED_LEARNING_RATE == 1e-5
    assert info["pretrained"] is True and is_pretrained(out) and is_pretrained(info)
    assert max(r["learning_rate"] for r in read_metrics(out) if "learning_rate" in r) <= 1e-5


def test_is_pretrained_knows_hf_folders_imports_and_their_descendants(sft_model):
    assert is_pretrained(os.path.join(os.path.dirname(__file__), "fixtures", "hf", "llama"))
    assert is_pretrained({"stage": "import"}) and is_pretrained(
        {"stage": "sft", "pretrained": True}
    )
    assert not is_pretrained({"stage": "sft", "pretrained": False})
    assert not is_pretrained({"stage": "ppo"})  # no record: an artifact of an older release
    assert not is_pretrained(sft_model[0])


def test_auto_learning_rate_is_resolved_before_training():
    config = SFTConfig()
    assert config.learning_rate == 0.0  # auto
    assert config.resolved(pretrained=False).optim().learning_rate == 1e-3
    assert config.resolved(pretrained=True).optim().learning_rate == 1e-5
    given = SFTConfig(learning_rate=3e-4)
    assert given.resolved(pretrained=True).learning_rate == 3e-4  # a given rate is kept
    with pytest.raises(ValueError, match="call resolved"):
        config.optim()
    with pytest.raises(ValueError, match="learning_rate: -1.0 must be > 0, or 0 for auto"):
        RewardConfig(learning_rate=-1.0)


def test_reward_gate_fails_after_writing_the_model_and_names_the_fix(shards, tmp_path):
    out = tmp_path / "rm"
    config = RewardConfig(**SMALL, steps=2, eval_batches=1, min_reward_accuracy=0.99)
    with pytest.raises(RewardAccuracyError) as error:
        run_reward(config, shards, str(out))
    stats = json.loads((out / "reward_stats.json").read_text())
    message = str(error.value)
    assert f"eval accuracy {stats['accuracy']:.3f}" in message
    assert "below min_reward_accuracy 0.99" in message
    assert "more preference data or for more steps" in message
    assert "lower min_reward_accuracy" in message
    assert read_model_config(str(out))["stage"] == "reward"  # kept for inspection
    with pytest.raises(ValueError, match="min_reward_accuracy: 1.5 must be in"):
        RewardConfig(min_reward_accuracy=1.5)


def test_reward_eval_loss_is_the_training_loss_with_margins(shards):
    from components.core.model.artifact import create_model
    from components.core.training.trainer import preference_streams

    vocab = json.loads(open(os.path.join(shards, "manifest.json")).read())["tokenizer"][
        "vocab_size"
    ]
    graphdef, params = nnx.split(create_model("tiny", vocab, scalar_head=True, seed=0), nnx.Param)
    config = RewardConfig(**SMALL, steps=1)
    batch = next(preference_streams(shards, "eval", config, shuffle=False, repeat=False))
    batch["margin"] = np.linspace(-2.0, 3.0, len(batch["margin"]), dtype=np.float32)
    terms = {"center_coef": 0.01, "use_margin": True}
    train_loss, _ = make_reward_loss(graphdef, **terms)(params, batch, jax.random.PRNGKey(0))
    totals = jax.tree.map(float, make_reward_eval_sums(graphdef, **terms)(params, batch))
    assert summarize_eval(totals)["loss"] == pytest.approx(float(train_loss), rel=1e-5)
    no_margin = {"center_coef": 0.01, "use_margin": False}
    unmargined = jax.tree.map(float, make_reward_eval_sums(graphdef, **no_margin)(params, batch))
    assert abs(unmargined["loss"] - totals["loss"]) > 1e-3  # the margins did count


def test_base_policy_with_other_tokenizer_is_refused(sft_model, shards, tmp_path):
    policy_dir, _ = sft_model
    info_path = os.path.join(policy_dir, "config.json")
    info = json.loads(open(info_path).read())
    copy = tmp_path / "policy"
    copy.mkdir()
    os.symlink(os.path.join(policy_dir, "params"), copy / "params")
    info["tokenizer"]["fingerprint"] = "0000000000000000"
    (copy / "config.json").write_text(json.dumps(info))
    with pytest.raises(ModelMismatchError, match="tokenizer"):
        run_reward(
            RewardConfig(**SMALL, steps=1, base_policy=str(copy)), shards, str(tmp_path / "o")
        )


def test_bad_inputs_get_clear_errors(shards, tmp_path):
    with pytest.raises(ValueError, match="batch_size: 12 does not split over 8 devices"):
        run_reward(
            RewardConfig(**{**SMALL, "batch_size": 12}, steps=1), shards, str(tmp_path / "a")
        )
    with pytest.raises(DataError, match="manifest.json not found"):
        run_reward(RewardConfig(**SMALL, steps=1), str(tmp_path), str(tmp_path / "b"))
    with pytest.raises(ModelArtifactError, match="not a complete model artifact"):
        run_reward(
            RewardConfig(**SMALL, steps=1, base_policy=str(tmp_path)), shards, str(tmp_path / "c")
        )
    old = tmp_path / "old_shards"
    old.mkdir()
    manifest = json.loads(open(os.path.join(shards, "manifest.json")).read())
    (old / "manifest.json").write_text(json.dumps({**manifest, "schema_version": 99}))
    with pytest.raises(DataError, match="schema_version 99"):
        run_sft(SFTConfig(**SMALL, steps=1), str(old), str(tmp_path / "d"))


def test_resuming_with_fewer_steps_another_stage_or_batch_is_refused(sft_model, shards, tmp_path):
    """An --output holding a finished 40-step sft run: continued only as what it is."""
    output = str(tmp_path / "sft")
    shutil.copytree(sft_model[0], output)
    with pytest.raises(ValueError, match="steps: 10, but the checkpoint in .* is at step 40; "
                       "pass --steps 40 or more"):  # fmt: skip
        run_sft(SFTConfig(**SMALL, steps=10), shards, output)
    with pytest.raises(CheckpointRestoreError, match=r"holds the sft stage's checkpoint \(step "
                       r"40\), not the reward stage's"):  # fmt: skip
        run_reward(RewardConfig(**SMALL, steps=41), shards, output)
    with pytest.raises(CheckpointRestoreError, match=r"written with batch_size 32 \(now 16\), "
                       r"seed 0 \(now 3\)"):  # fmt: skip
        run_sft(SFTConfig(**{**SMALL, "batch_size": 16, "seed": 3}, steps=41), shards, output)
    # Another base model than the one it started from (none): refused, naming the flag.
    with pytest.raises(CheckpointRestoreError, match="written with another --base-policy than "
                       r"now \(then none; now files with fingerprint [0-9a-f]{16}\)"):  # fmt: skip
        run_sft(SFTConfig(**SMALL, steps=41, base_policy=sft_model[0]), shards, output)
    # Nothing was lost: the sft artifact is as it was.
    assert read_model_config(output)["stage"] == "sft" and read_model_config(output)["step"] == 40
    # Run again as it was run, it trains nothing and keeps its files: the fingerprint a next
    # stage's checkpoints hold of it stays.
    fingerprint = input_fingerprint(output)
    run_sft(SFTConfig(**SMALL, steps=40, learning_rate=3e-3, warmup_steps=5), shards, output)
    assert input_fingerprint(output) == fingerprint


def test_non_finite_loss_aborts_after_limit_and_keeps_last_good_checkpoint(shards, tmp_path):
    out = str(tmp_path / "blowup")
    config = RewardConfig(
        **{**SMALL, "save_every": 1}, steps=30, learning_rate=1e30, warmup_steps=0,
        max_grad_norm=1e30, max_nonfinite_steps=3,
    )  # fmt: skip
    with pytest.raises(FloatingPointError, match="not finite for 3 steps in a row"):
        run_reward(config, shards, out)
    from components.core.training.checkpoint import work_checkpoint_dir

    steps = sorted(int(s) for s in os.listdir(work_checkpoint_dir(out)) if s.isdigit())
    assert steps and steps[-1] < 30
    assert not os.path.exists(os.path.join(out, "config.json"))  # no model exported


def test_reward_step_on_8_devices_equals_single_device(shards):
    from components.core.model.artifact import create_model
    from components.core.training.trainer import preference_streams

    vocab = json.loads(open(os.path.join(shards, "manifest.json")).read())["tokenizer"][
        "vocab_size"
    ]
    model = create_model("tiny", vocab, scalar_head=True, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    # Plain SGD: the update is linear in the gradient, so the comparison checks the pmean of
    # gradients itself; Adam's first step (about lr * sign(g)) would magnify fp noise near g=0.
    optimizer = optax.sgd(0.5)
    loss_fn = make_reward_loss(graphdef, center_coef=0.01, use_margin=True)
    config = RewardConfig(**SMALL, steps=2)
    batches = preference_streams(shards, "train", config, shuffle=True, repeat=True)
    batch = next(batches)
    results = []
    for devices in (jax.devices()[:1], jax.devices()):
        step = parallel.make_train_step(loss_fn, optimizer, devices=devices)
        state = parallel.replicate(parallel.TrainState.create(params, optimizer), devices)
        state, _ = step(state, parallel.shard_batch(batch, devices), jax.random.PRNGKey(1))
        results.append(parallel.unreplicate(state).params)
    for one, eight in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1]), strict=True):
        np.testing.assert_allclose(one, eight, rtol=2e-5, atol=2e-6)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="steps"):
        RewardConfig(steps=0)
    with pytest.raises(ValueError, match="center_rewards_coef"):
        RewardConfig(center_rewards_coef=-1.0)
    with pytest.raises(ValueError, match="data_streams"):
        SFTConfig(batch_size=32, data_streams=3)
    assert dataclasses.asdict(SFTConfig())["preset"] == "demo"
