"""Durable training state: outside the output artifact, keyed by what determines the
training (config, inputs, code); resumed by a retried attempt with a new output folder (a
real process, killed), never by a training from other inputs."""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from components.core.training import checkpoint as ckpt
from components.core.training.metrics import read_metrics
from pipelines import stage_io
from pipelines.dag import params

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
STEPS, SAVE_EVERY = 12, 4


class SlowBatches:
    """Preference batches at a set pace, so a process can be killed between checkpoints."""

    def __init__(self, reader, seconds: float) -> None:
        self.reader, self.seconds = reader, seconds

    def __next__(self) -> dict:
        time.sleep(self.seconds)
        return next(self.reader)

    def position(self) -> dict:
        return self.reader.position()

    def restore(self, position: dict) -> None:
        self.reader.restore(position)


def train(shards: str, output: str, step_sleep: float = 0.0):
    """The training loop sft, reward and dpo share (``trainer.fit``) on a tiny LM."""
    from test_parallel import TinyLM, lm_loss_fn

    from components.core.data import input_pipeline
    from components.core.training.config import TrainConfig
    from components.core.training.trainer import fit

    config = TrainConfig(
        batch_size=8, steps=STEPS, save_every=SAVE_EVERY, learning_rate=1e-2, warmup_steps=2
    )
    graphdef, params_ = nnx.split(TinyLM(vocab=259, rngs=nnx.Rngs(0)), nnx.Param)
    base_loss = lm_loss_fn(graphdef)

    def loss_fn(p, batch, rng):
        # Drop tokens from the loss at random, so the result depends on the restored RNG.
        keep = jax.random.bernoulli(rng, 0.7, batch["loss_mask"].shape)
        tokens = {"tokens": batch["chosen_tokens"], "loss_mask": batch["loss_mask"] & keep}
        return base_loss(p, tokens, rng)

    reader = input_pipeline.preference_dataset(shards, "train", batch_size=8, max_len=8, seed=5)
    return fit(
        config=config, output=output, stage="demo", params=params_, loss_fn=loss_fn,
        train_data=SlowBatches(reader, step_sleep),
    )  # fmt: skip


def _config(seed: int):
    from components.core.training.config import TrainConfig

    return TrainConfig(seed=seed)


def attempt(shards: str, output: str, root: str, seed: int = 0, step_sleep: float = 0.0):
    """One attempt of the task, as a pipeline component runs it: its state keyed by its
    config (here only the seed differs: a stand-in for any other input) and inputs."""
    with stage_io.training_state(root, "demo", _config(seed), {"shards": shards}, output):
        return train(shards, output, step_sleep)


def _state(root: str, shards: str, seed: int = 0) -> str:
    key = stage_io.state_key(_config(seed), {"shards": shards})
    return ckpt.keyed_state_dir(root, "demo", key)


def _launch(shards: str, output: str, root: str, step_sleep: float):
    code = (
        f"import sys; sys.path[:0] = [{TESTS_DIR!r}, {REPO!r}]; import test_durable_checkpoints"
        f" as t; t.attempt({shards!r}, {output!r}, {root!r}, 0, {step_sleep})"
    )
    # The session's XLA flags (8 devices: tests/conftest.py, and whatever else a developer
    # set): the resumed run continues the killed one's steps bit for bit only if both
    # compiled alike.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu")
    env.pop(ckpt.CHECKPOINT_DIR_ENV, None)
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def _logged(output: str) -> int:
    """The last step an attempt logged to its output's metrics.jsonl."""
    return max(record["step"] for record in read_metrics(output))


def _steps(folder: str) -> list[int]:
    """The finalized Orbax steps in ``folder`` (in-progress ones carry a suffix)."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(int(name) for name in names if name.isdigit())


def test_killed_task_resumes_from_its_key_in_a_new_output(tmp_path):
    from test_input_pipeline import numbered_shards

    shards = numbered_shards(tmp_path / "shards", num_shards=2, per_shard=20)
    root = str(tmp_path / "bucket")  # a folder standing in for gs://bucket/checkpoints
    first, second = str(tmp_path / "attempt-1"), str(tmp_path / "attempt-2")
    state = _state(root, shards)
    victim = _launch(shards, first, root, 0.4)
    deadline = time.time() + 120
    while not _steps(state):
        assert victim.poll() is None, victim.communicate()[0].decode()[-3000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    killed_at = _steps(state)
    assert killed_at and killed_at[-1] < STEPS
    assert not os.path.exists(os.path.join(first, "metrics.jsonl")) or _logged(first) < STEPS
    # The killed attempt's artifact never held its state: the launcher would not upload it.
    assert not os.path.exists(ckpt.work_checkpoint_dir(first))

    # The uninterrupted run: the same training in a root of its own. Then the retry: the
    # same config and inputs (so the same key), a new output folder.
    fresh = attempt(shards, str(tmp_path / "fresh"), str(tmp_path / "other-bucket"))
    assert fresh.resumed_from is None and fresh.step == STEPS
    resumed = attempt(shards, second, root)
    assert resumed.resumed_from == killed_at[-1] > 0 and resumed.step == STEPS
    steps = [record["step"] for record in read_metrics(second)]
    assert steps == list(range(killed_at[-1] + 1, STEPS + 1))
    got, want = jax.tree.leaves(resumed.params), jax.tree.leaves(fresh.params)
    assert len(got) == len(want) > 3
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _steps(state)[-1] == STEPS
    assert not os.path.exists(ckpt.work_checkpoint_dir(second))
    # Another config (another seed) is another training: it starts from step 0 beside it.
    other = attempt(shards, str(tmp_path / "seed-1"), root, seed=1)
    assert other.resumed_from is None and _steps(_state(root, shards, seed=1))[-1] == STEPS


def test_training_state_sets_the_folder_for_the_stage_and_restores_it(tmp_path, monkeypatch):
    monkeypatch.delenv(ckpt.CHECKPOINT_DIR_ENV, raising=False)
    artifact = str(tmp_path / "model")
    config, inputs = _config(0), {"shards": "gs://b/shards", "policy": '{"uri": "gs://b/p"}'}
    key = stage_io.state_key(config, inputs)
    with stage_io.training_state(str(tmp_path / "ckpt"), "ppo", config, inputs, artifact) as folder:
        assert folder == str(tmp_path / "ckpt" / "ppo" / key)
        assert ckpt.training_state_dir(artifact) == folder
    assert ckpt.training_state_dir(artifact) == ckpt.work_checkpoint_dir(artifact)
    # No root: today's place, inside a local artifact; refused for an artifact on the cloud.
    with stage_io.training_state("", "ppo", config, inputs, artifact) as folder:
        assert folder == "" and ckpt.training_state_dir(artifact).startswith(artifact)
    with pytest.raises(ValueError, match="checkpoint_root: '' keeps training state inside"):
        with stage_io.training_state("", "ppo", config, inputs, "gs://b/root/ppo_1/model"):
            pass
    assert os.environ.get(ckpt.CHECKPOINT_DIR_ENV) is None


def test_the_key_follows_what_determines_the_training(monkeypatch):
    """Same config, inputs and code: the same key (a retry, a resubmitted run, another run
    whose upstream came from the cache); any of them changed: another key."""
    config, inputs = _config(0), {"shards": "gs://b/run1/shards"}
    key = stage_io.state_key(config, inputs)
    assert stage_io.state_key(_config(0), dict(inputs)) == key and len(key) == 24
    assert stage_io.state_key(_config(1), inputs) != key
    assert stage_io.state_key(config, {"shards": "gs://b/run2/shards"}) != key
    monkeypatch.setattr(stage_io, "code_fingerprint", lambda: "other code")
    assert stage_io.state_key(config, inputs) != key


def test_checkpoint_root_parameter_checks():
    assert params.validate({"checkpoint_root": "gs://b/ckpt"}, chips=8)["checkpoint_root"]
    for root, message in (
        ("/gcs/b/ckpt", r"FUSE mount.*use the gs:// URI of the same folder \(gs://b/ckpt\)"),
        ("s3://b/ckpt", "neither a gs:// URI nor a local folder"),
        ("gs:///ckpt", "names no bucket"),
    ):
        with pytest.raises(params.ParamError, match=message):
            params.validate({"checkpoint_root": root}, chips=8)
    cloud = params.with_cloud_checkpoint_root({"seed": 1}, "gs://b/root/")
    assert cloud == {"seed": 1, "checkpoint_root": "gs://b/root/checkpoints"}
    given = {"checkpoint_root": "gs://other/state"}
    assert params.with_cloud_checkpoint_root(given, "gs://b/root") == given
    with pytest.raises(params.ParamError, match="not on Cloud Storage"):
        params.with_cloud_checkpoint_root({"checkpoint_root": "/tmp/state"}, "gs://b/root")
