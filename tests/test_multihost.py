"""Multi-host on loopback: 2 processes x 4 CPU devices train like 1 process x 8 devices.

Both with replicated state and with fully sharded state (``place(..., sharded=True)``,
each device holding 1/8 of every tensor, chunks split across the two processes).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from components.core.training import distributed

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
GLOBAL_BATCH, STEPS = 16, 3


def worker(shards: str, out: str, local_devices: int, sharded: bool = False) -> None:
    """Train a few pmapped steps; with 1 process it plays both hosts' data side by side.

    ``sharded`` places the state in chunks over all 8 devices (fsdp) instead of replicating it.
    """
    import jax

    jax.config.update("jax_num_cpu_devices", local_devices)
    jax.config.update("jax_platforms", "cpu")
    cluster = distributed.maybe_initialize(timeout_s=60)

    import jax.numpy as jnp
    from flax import nnx
    from test_parallel import TinyLM, lm_loss_fn

    from components.core.data import input_pipeline
    from components.core.training import checkpoint, fsdp, parallel
    from components.core.training.optim import OptimConfig

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
    optimizer = OptimConfig(learning_rate=1e-2, warmup_steps=0, total_steps=STEPS)
    base_loss = lm_loss_fn(graphdef)

    def loss_fn(p, batch, rng):
        keep = jax.random.bernoulli(rng, 0.7, batch["loss_mask"].shape)
        return base_loss(
            p, {"tokens": batch["chosen_tokens"], "loss_mask": batch["loss_mask"] & keep}, rng
        )

    step = parallel.make_train_step(loss_fn, optimizer)
    initial = parallel.TrainState.create(params, optimizer)
    state = parallel.place(initial, sharded=sharded)
    if sharded:
        _check_sharded(state, initial)
    rng = jax.random.PRNGKey(0)
    for _ in range(STEPS):
        batches = [next(reader) for reader in readers]
        batch = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
        rng, step_rng = jax.random.split(rng)
        state, metrics = step(state, parallel.shard_batch(batch), step_rng)
    if sharded:
        assert fsdp.is_sharded(state.params) and fsdp.is_sharded(state.opt_state)
    final = parallel.unreplicate(state)
    # Every process gets the full tensors back, in the shapes it started from.
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(initial), strict=True):
        assert np.shape(a) == np.shape(b) and isinstance(a, np.ndarray)
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
    # Each process writes what it holds, so the test sees every process's host copy.
    np.savez(os.path.join(out, f"final-{jax.process_index()}.npz"), *jax.tree.leaves(final.params))


def _check_sharded(state, initial) -> None:
    """The pmap device with axis index i holds chunk i of every tensor, and the host copy is whole.

    Axis indices come from pmap itself, so a wrong chunk/device order across processes shows
    here, not just as a mismatch after training. Also checks a layer stack (``blocks``,
    chunked after its leading layer axis), which TinyLM does not have.
    """
    import jax
    from jax import lax

    from components.core.training import fsdp, parallel

    total, local = jax.device_count(), jax.local_device_count()
    index = jax.pmap(lambda x: x + lax.axis_index("i"), axis_name="i")(np.zeros(local, np.int32))
    axis_of = {s.device: int(np.asarray(s.data)[0]) for s in index.addressable_shards}
    # 3 layers of 5 x 7 = 35 values: 8 chunks of 5, the last one all padding.
    stack = {"blocks": {"w": np.arange(105, dtype=np.float32).reshape(3, 5, 7) - 50}}
    for placed, host in [(state, initial), (parallel.place(stack, sharded=True), stack)]:
        flat, _ = jax.tree_util.tree_flatten_with_path(host)
        nodes = jax.tree.leaves(placed, is_leaf=lambda n: isinstance(n, fsdp.Sharded))
        assert len(nodes) == len(flat)
        for (path, full), node in zip(flat, nodes, strict=True):
            full = np.asarray(full)
            if not isinstance(node, fsdp.Sharded):
                assert full.ndim == 0, path  # only scalars (step counts) stay replicated
                continue
            chunks = fsdp._local_chunks(full, fsdp._lead(path), total)
            assert node.chunk.shape == (local, *chunks.shape[1:]), (path, node)
            for shard in node.chunk.addressable_shards:
                np.testing.assert_array_equal(
                    np.asarray(shard.data)[0], chunks[axis_of[shard.device]], err_msg=str(path)
                )
        # unreplicate gathers the chunks of both processes back into the full tensors.
        gathered = parallel.unreplicate(placed)
        for a, b in zip(jax.tree.leaves(gathered), jax.tree.leaves(host), strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))


def clean_env() -> dict[str, str]:
    """This process's environment without its XLA/JAX settings (XLA_FLAGS forces 8 devices into
    each process), but with the session's compilation cache and the XLA flags other than the
    device count (tests/conftest.py)."""
    kept = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    env = {k: v for k, v in os.environ.items() if k in kept or not k.startswith(("XLA_", "JAX_"))}
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def _free_port() -> int:
    return _free_ports(1)[0]


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (all bound at once, so none is handed out twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _spawn(
    shards: str, out: str, local_devices: int, extra_env: dict, sharded: bool = False
) -> subprocess.Popen:
    code = (
        f"import sys; sys.path[:0] = [{TESTS_DIR!r}, {REPO!r}]; import test_multihost; "
        f"test_multihost.worker({shards!r}, {out!r}, {local_devices}, sharded={sharded})"
    )
    env = clean_env()
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


def _spawn_hosts(shards: str, out: str, port: int, sharded: bool) -> list[subprocess.Popen]:
    """Two processes of 4 CPU devices each, joined over loopback at ``port``."""
    address = f"127.0.0.1:{port}"
    return [
        _spawn(
            shards,
            out,
            4,
            {
                distributed.ENV_COORDINATOR: address,
                distributed.ENV_NUM_PROCESSES: "2",
                distributed.ENV_PROCESS_ID: str(i),
            },
            sharded=sharded,
        )
        for i in range(2)
    ]


@pytest.mark.slow
def test_two_hosts_match_one_host(tmp_path):
    """Replicated and fully sharded state on 2 x 4 devices both train like replicated 1 x 8."""
    from test_input_pipeline import numbered_shards

    shards = numbered_shards(tmp_path / "shards", num_shards=4, per_shard=12)
    runs = {name: tmp_path / name for name in ("single", "multi", "sharded")}
    for path in runs.values():
        path.mkdir()
    # All five processes at once, each pair on its own coordinator port: most of a run is
    # start-up and compilation, so together they take about as long as the two-host run alone.
    ports = _free_ports(2)
    _wait_all(
        _spawn_hosts(shards, str(runs["multi"]), ports[0], sharded=False)
        + _spawn_hosts(shards, str(runs["sharded"]), ports[1], sharded=True)
        + [_spawn(shards, str(runs["single"]), 8, {})]
    )
    want = np.load(runs["single"] / "final-0.npz")
    assert len(want.files) > 3
    for run, process in [("multi", 0), ("multi", 1), ("sharded", 0), ("sharded", 1)]:
        got = np.load(runs[run] / f"final-{process}.npz")
        assert got.files == want.files
        for name in want.files:
            np.testing.assert_allclose(
                got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=f"{run} process {process}"
            )
        assert os.path.exists(runs[run] / "model" / "config.json")


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
    # A Vertex TPU custom job sets no host list: the placement's host count names the slice.
    from pipelines.targets.placement import HOSTS_ENV

    assert HOSTS_ENV == distributed.ENV_TPU_HOSTS  # what the placement sets, the stage reads
    vertex = distributed.detect_cluster({"ALIGNPIPE_TPU_HOSTS": "4"})
    assert (vertex.kind, vertex.num_processes) == ("tpu", 4)
    assert distributed.detect_cluster({"ALIGNPIPE_TPU_HOSTS": "1"}).kind == "single"
    for raw in ("four", "²"):
        with pytest.raises(ValueError, match=f"ALIGNPIPE_TPU_HOSTS='{raw}' must be"):
            distributed.detect_cluster({"ALIGNPIPE_TPU_HOSTS": raw})
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES"):
        distributed.detect_cluster({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"})
    with pytest.raises(ValueError, match="JAX_PROCESS_ID=3 must be in"):
        distributed.detect_cluster(
            {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "3"}
        )
    # On this single host, maybe_initialize does nothing.
    assert distributed.maybe_initialize(env={}).kind == "single"


def test_only_host_0_writes_a_tasks_outputs(tmp_path, monkeypatch):
    """On a multi-host slice every host runs the task's executor: the others write no metrics
    and tell KFP's executor (CLUSTER_SPEC) not to write its output file."""
    import jax
    from kfp.dsl import Metrics

    from pipelines import stage_io

    monkeypatch.delenv("CLUSTER_SPEC", raising=False)
    metrics = Metrics(uri=str(tmp_path / "metrics"))
    metrics.path = str(tmp_path / "host0.json")
    stage_io.write_metrics(metrics, "ppo", {"loss": 1.0}, started=0.0)
    assert os.path.exists(metrics.path) and "CLUSTER_SPEC" not in os.environ
    monkeypatch.setattr(jax, "process_index", lambda: 2)
    metrics.path = str(tmp_path / "host2.json")
    try:
        stage_io.write_metrics(metrics, "ppo", {"loss": 1.0}, started=0.0)
        assert not os.path.exists(metrics.path)
        assert json.loads(os.environ["CLUSTER_SPEC"])["task"]["type"] == "workerpool1"
    finally:  # set by the code under test: later kfp.local tasks of this process inherit it
        os.environ.pop("CLUSTER_SPEC", None)
