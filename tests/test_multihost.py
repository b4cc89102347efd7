"""Multi-host on loopback: 2 processes x 4 CPU devices train like 1 process x 8 devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from components.core import distributed

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
GLOBAL_BATCH, STEPS = 16, 3


def worker(shards: str, out: str, local_devices: int) -> None:
    """Train a few pmapped steps; with 1 process it plays both hosts' data side by side."""
    import jax

    jax.config.update("jax_num_cpu_devices", local_devices)
    jax.config.update("jax_platforms", "cpu")
    cluster = distributed.maybe_initialize(timeout_s=60)

    import jax.numpy as jnp
    from flax import nnx
    from test_parallel import TinyLM, lm_loss_fn

    from components.core import checkpoint, input_pipeline, parallel
    from components.core.optim import OptimConfig, make_optimizer

    assert jax.device_count() == 8 and jax.process_count() == cluster.num_processes
    hosts = range(2) if jax.process_count() == 1 else [jax.process_index()]
    per_host = GLOBAL_BATCH // 2
    readers = [
        input_pipeline.preference_dataset(
            shards, "train", batch_size=per_host, max_len=8, seed=3, host_index=h, host_count=2
        )
        for h in hosts
    ]
    graphdef, params = nnx.split(TinyLM(vocab=259, rngs=nnx.Rngs(0)), nnx.Param)
    optimizer = make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=STEPS))
    base_loss = lm_loss_fn(graphdef)

    def loss_fn(p, batch, rng):
        keep = jax.random.bernoulli(rng, 0.7, batch["loss_mask"].shape)
        return base_loss(
            p, {"tokens": batch["chosen_tokens"], "loss_mask": batch["loss_mask"] & keep}, rng
        )

    step = parallel.make_train_step(loss_fn, optimizer)
    state = parallel.replicate(parallel.TrainState.create(params, optimizer))
    rng = jax.random.PRNGKey(0)
    for _ in range(STEPS):
        batches = [next(reader) for reader in readers]
        batch = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
        rng, step_rng = jax.random.split(rng)
        state, metrics = step(state, parallel.shard_batch(batch), step_rng)
    final = parallel.unreplicate(state)
    assert jnp.isfinite(parallel.unreplicate(metrics)["loss"])
    # Every process takes part in the save; Orbax writes from the primary one.
    checkpoint.export_model(
        os.path.join(out, "model"),
        model_config={},
        params=final.params,
        extra_config={"step": int(final.step)},
    )
    with checkpoint.TrainCheckpointer(
        os.path.join(out, "ckpt"), checkpoint.CheckpointConfig(save_every=100)
    ) as manager:
        manager.save(STEPS, state=final, rng=rng, data_position=readers[0].position(), force=True)
    with checkpoint.TrainCheckpointer(
        os.path.join(out, "ckpt"), checkpoint.CheckpointConfig(save_every=100)
    ) as manager:
        restored = manager.restore_latest(final, rng)
    assert restored.step == STEPS and restored.data_position == readers[0].position()
    for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(final), strict=True):
        np.testing.assert_array_equal(a, b)
    if distributed.is_primary():
        np.savez(os.path.join(out, "final.npz"), *jax.tree.leaves(final.params))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(shards: str, out: str, local_devices: int, extra_env: dict) -> subprocess.Popen:
    code = (
        f"import sys; sys.path[:0] = [{TESTS_DIR!r}, {REPO!r}]; import test_multihost; "
        f"test_multihost.worker({shards!r}, {out!r}, {local_devices})"
    )
    # A clean environment: no XLA_FLAGS forcing 8 devices into each process.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", JAX_PLATFORMS="cpu", **extra_env)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _wait_all(processes: list[subprocess.Popen], timeout: float = 180) -> None:
    try:
        outputs = [p.communicate(timeout=timeout)[0].decode() for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    for p, output in zip(processes, outputs, strict=True):
        assert p.returncode == 0, output[-4000:]


@pytest.mark.slow
def test_two_hosts_match_one_host(tmp_path):
    from test_input_pipeline import numbered_shards

    shards = numbered_shards(tmp_path / "shards", num_shards=4, per_shard=12)
    single, multi = tmp_path / "single", tmp_path / "multi"
    single.mkdir(), multi.mkdir()
    address = f"127.0.0.1:{_free_port()}"
    hosts = [
        _spawn(
            shards,
            str(multi),
            4,
            {
                distributed.ENV_COORDINATOR: address,
                distributed.ENV_NUM_PROCESSES: "2",
                distributed.ENV_PROCESS_ID: str(i),
            },
        )
        for i in range(2)
    ]
    _wait_all(hosts)
    _wait_all([_spawn(shards, str(single), 8, {})])
    want, got = np.load(single / "final.npz"), np.load(multi / "final.npz")
    assert len(want.files) == len(got.files) > 3
    for name in want.files:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)
    assert os.path.exists(multi / "model" / "config.json")


def test_detect_cluster():
    assert distributed.detect_cluster({}).kind == "single"
    explicit = distributed.detect_cluster(
        {
            "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
            "JAX_NUM_PROCESSES": "4",
            "JAX_PROCESS_ID": "2",
        }
    )
    assert (explicit.kind, explicit.num_processes, explicit.process_id) == ("explicit", 4, 2)
    assert distributed.detect_cluster({"TPU_WORKER_HOSTNAMES": "a,b"}).kind == "tpu"
    assert distributed.detect_cluster({"TPU_WORKER_HOSTNAMES": "a"}).kind == "single"
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        distributed.detect_cluster({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"})
    with pytest.raises(ValueError, match="JAX_PROCESS_ID=3 must be in"):
        distributed.detect_cluster(
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "3"}
        )
    # On this single host, maybe_initialize does nothing.
    assert distributed.maybe_initialize(env={}).kind == "single"
