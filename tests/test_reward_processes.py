"""The reward stage as real processes: SIGKILL and resume, and 2 hosts x 4 devices vs 1 x 8."""

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
from test_multihost import _free_port, _wait_all, clean_env

from components.core.data.builtin_task import write_jsonl
from components.core.model.transformer import ModelConfig, Transformer
from components.core.training.checkpoint import (
    load_model_params,
    read_model_config,
    work_checkpoint_dir,
)
from components.core.training.metrics import read_metrics
from components.shard import ShardConfig
from components.shard import run as run_shard

# Slow tier: a killed process resumes bit for bit in make test through
# test_durable_checkpoints.py; these two start reward stages as processes.
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--preset", "tiny", "--max-len", "24", "--batch-size", "32", "--eval-every", "1000"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    write_jsonl(str(folder / "pairs.jsonl"), 1200, seed=4)
    out = str(folder / "shards")
    run_shard(
        ShardConfig(num_shards=4, tokenizer="builtin-words"), [str(folder / "pairs.jsonl")], out
    )
    return out


def _reward(shards: str, out: str, *flags: str, devices: int = 8, env: dict | None = None):
    clean = clean_env()
    clean.update(JAX_PLATFORMS="cpu", ALIGNPIPE_CPU_DEVICES=str(devices), **(env or {}))
    command = [sys.executable, "-m", "components.reward", "--shards", shards, "--output", out]
    return subprocess.Popen(
        command + FLAGS + list(flags),
        env=clean,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _params(model_dir: str) -> list[np.ndarray]:
    config = ModelConfig.from_dict(read_model_config(model_dir)["model"])
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), scalar_head=True))
    return jax.tree.leaves(load_model_params(model_dir, nnx.state(abstract, nnx.Param)))


def test_killed_reward_stage_resumes_to_identical_params(shards, tmp_path):
    flags = ["--steps", "60", "--save-every", "10", "--seed", "7"]
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    _wait_all([_reward(shards, whole, *flags)])
    victim = _reward(shards, killed, *flags)
    first = os.path.join(work_checkpoint_dir(killed), "10")
    deadline = time.time() + 120
    while not os.path.isdir(first) and time.time() < deadline and victim.poll() is None:
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not os.path.exists(os.path.join(killed, "config.json")), "killed after it finished"
    assert os.path.isdir(first)
    _wait_all([_reward(shards, killed, *flags)])
    for a, b in zip(_params(whole), _params(killed), strict=True):
        np.testing.assert_array_equal(a, b)
    # Steps the killed run logged after its last checkpoint are dropped on resume.
    resumed = read_metrics(killed)
    assert [r["step"] for r in resumed] == list(range(1, 61))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in read_metrics(whole)]


def test_two_hosts_of_four_devices_match_one_host_of_eight(shards, tmp_path):
    flags = ["--steps", "6", "--save-every", "3", "--data-streams", "2", "--eval-batches", "2"]
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    address = f"127.0.0.1:{_free_port()}"
    hosts = [
        _reward(
            shards,
            multi,
            *flags,
            devices=4,
            env={
                "JAX_COORDINATOR_ADDRESS": address,
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i),
            },
        )  # fmt: skip
        for i in range(2)
    ]
    _wait_all(hosts, timeout=600)
    _wait_all([_reward(shards, single, *flags)], timeout=600)
    for a, b in zip(_params(single), _params(multi), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    want, got = read_metrics(single)[-1], read_metrics(multi)[-1]
    assert got["eval/accuracy"] == pytest.approx(want["eval/accuracy"], abs=1e-6)
    assert got["eval/pairs"] == want["eval/pairs"] == 2 * 32
