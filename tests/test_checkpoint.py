"""Orbax checkpoints: round trip, keep-last-K, model export, and kill-and-resume of a real run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from components.core import checkpoint as ckpt
from components.core import parallel
from components.core.optim import OptimConfig, make_optimizer

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.normal(size=(3, 4)).astype(np.float32), "step": np.asarray(seed, np.int32)}


def test_round_trip_with_rng_position_and_extras(tmp_path):
    directory = ckpt.work_checkpoint_dir(str(tmp_path / "artifact"))
    assert directory.endswith(os.path.join("artifact", "work", "checkpoints"))
    config = ckpt.CheckpointConfig(save_every=2, keep=5)
    with ckpt.TrainCheckpointer(directory, config) as checkpointer:
        assert checkpointer.restore_latest(_tree(0), np.zeros(2, np.uint32)) is None
        rng = np.asarray(jax.random.PRNGKey(42))
        saved = checkpointer.save(
            4,
            state=_tree(4),
            rng=rng,
            data_position={"epoch": 1, "batches_in_epoch": 3},
            extra_trees={"kl": {"coef": np.float32(0.2)}},
            extra_json={"kl_target": 6.0},
        )
        assert saved
        assert not checkpointer.save(5, state=_tree(5), rng=rng, data_position={})
    with ckpt.TrainCheckpointer(directory, config) as resumed:
        restored = resumed.restore_latest(
            _tree(0), np.zeros(2, np.uint32), {"kl": {"coef": np.float32(0)}}
        )
    assert restored.step == 4
    np.testing.assert_array_equal(restored.state["w"], _tree(4)["w"])
    np.testing.assert_array_equal(restored.rng, rng)
    assert restored.data_position == {"epoch": 1, "batches_in_epoch": 3}
    assert float(restored.extra_trees["kl"]["coef"]) == pytest.approx(0.2)
    assert restored.extra_json == {"kl_target": 6.0}


def test_keeps_last_k_and_forced_final_save(tmp_path):
    config = ckpt.CheckpointConfig(save_every=2, keep=2)
    with ckpt.TrainCheckpointer(str(tmp_path), config) as checkpointer:
        for step in range(1, 10):
            checkpointer.save(
                step,
                state=_tree(step),
                rng=np.zeros(2, np.uint32),
                data_position={},
                force=step == 9,
            )
        checkpointer.wait()
        assert checkpointer.all_steps() == [8, 9]


def test_export_and_load_model_with_nnx_params(tmp_path):
    graphdef, params = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), nnx.Param)
    model_dir = str(tmp_path / "model")
    ckpt.export_model(
        model_dir,
        model_config={"preset": "tiny", "vocab_size": 259},
        params=params,
        extra_config={"step": 12, "tokenizer": {"kind": "byte"}},
    )
    config = ckpt.read_model_config(model_dir)
    assert config["schema_version"] == 1 and config["model"]["preset"] == "tiny"
    assert config["step"] == 12
    abstract = nnx.state(nnx.eval_shape(lambda: nnx.Linear(3, 2, rngs=nnx.Rngs(1))), nnx.Param)
    loaded = ckpt.load_model_params(model_dir, abstract)
    model = nnx.merge(graphdef, loaded)
    np.testing.assert_array_equal(model.kernel[...], params["kernel"][...])
    with pytest.raises(ckpt.ModelArtifactError, match="config.json not found"):
        ckpt.read_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="schema_version"):
        ckpt.export_model(
            model_dir, model_config={}, params=params, extra_config={"schema_version": 3}
        )


# ---- kill and resume -------------------------------------------------------------------


def train_demo(
    shards: str, workdir: str, total_steps: int, save_every: int, step_sleep: float = 0.0
) -> None:
    """A small but complete training run: data, pmap step, checkpoints, resume, export."""
    from test_parallel import TinyLM, lm_loss_fn

    from components.core import input_pipeline
    from components.core.metrics import MetricsLogger

    graphdef, params = nnx.split(TinyLM(vocab=259, rngs=nnx.Rngs(0)), nnx.Param)
    optimizer = make_optimizer(
        OptimConfig(learning_rate=1e-2, warmup_steps=2, total_steps=total_steps)
    )
    base_loss = lm_loss_fn(graphdef)

    def loss_fn(p, batch, rng):
        # Randomly drop tokens from the loss, so the run depends on the RNG stream.
        keep = jax.random.bernoulli(rng, 0.7, batch["loss_mask"].shape)
        return base_loss(
            p, {"tokens": batch["chosen_tokens"], "loss_mask": batch["loss_mask"] & keep}, rng
        )

    host_state = parallel.TrainState.create(params, optimizer)
    rng = np.asarray(jax.random.PRNGKey(0))
    data = input_pipeline.preference_dataset(shards, "train", batch_size=8, max_len=8, seed=5)
    checkpointer = ckpt.TrainCheckpointer(
        ckpt.work_checkpoint_dir(workdir), ckpt.CheckpointConfig(save_every=save_every, keep=2)
    )
    restored = checkpointer.restore_latest(
        parallel.unreplicate(parallel.replicate(host_state)), rng
    )
    if restored is not None:
        host_state, rng = restored.state, restored.rng
        data.restore(restored.data_position)
    state = parallel.replicate(host_state)
    step_fn = parallel.make_train_step(loss_fn, optimizer)
    logger = MetricsLogger(workdir, total_steps=total_steps, stage="demo", tensorboard=False)
    step = 0 if restored is None else restored.step
    while step < total_steps:
        rng, step_rng = jax.random.split(rng)
        state, metrics = step_fn(state, parallel.shard_batch(next(data)), step_rng)
        step += 1
        logger.log(step, parallel.unreplicate(metrics))
        checkpointer.save(
            step,
            state=parallel.unreplicate(state),
            rng=rng,
            data_position=data.position(),
            force=step == total_steps,
        )
        time.sleep(step_sleep)
    checkpointer.close()
    logger.close()
    final = parallel.unreplicate(state)
    np.savez(os.path.join(workdir, "final.npz"), *jax.tree.leaves(final))


def _launch(shards: str, workdir: str, step_sleep: float) -> subprocess.Popen:
    code = (
        f"import sys; sys.path[:0] = [{TESTS_DIR!r}, {REPO!r}]; import test_checkpoint; "
        f"test_checkpoint.train_demo({shards!r}, {workdir!r}, 12, 4, {step_sleep})"
    )
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "JAX_PLATFORMS": "cpu",
    }
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _finish(process: subprocess.Popen, timeout: float = 120) -> None:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output.decode()[-3000:]


@pytest.mark.slow
def test_killed_run_resumes_to_identical_params(tmp_path):
    from test_input_pipeline import numbered_shards

    shards = numbered_shards(tmp_path / "shards", num_shards=2, per_shard=20)
    straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
    reference = _launch(shards, straight, 0.0)
    victim = _launch(shards, killed, 0.4)
    _finish(reference)
    checkpoints = ckpt.work_checkpoint_dir(killed)
    deadline = time.time() + 120
    # A finalized Orbax step is a folder named by its number (in-progress ones carry a suffix).
    while not (os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints))):
        assert victim.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.1)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    assert not os.path.exists(os.path.join(killed, "final.npz"))
    first_steps = sorted(int(n) for n in os.listdir(checkpoints) if n.isdigit())
    assert first_steps and first_steps[-1] < 12
    _finish(_launch(shards, killed, 0.0))
    want, got = (
        np.load(os.path.join(straight, "final.npz")),
        np.load(os.path.join(killed, "final.npz")),
    )
    assert len(want.files) == len(got.files) > 3
    for name in want.files:
        np.testing.assert_array_equal(want[name], got[name])
