"""Test set-up: 8 virtual CPU devices for pmap, before any JAX computation."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


import pytest  # noqa: E402


@pytest.fixture
def sharded_placements(monkeypatch):
    """Counts the trees placed in chunks (fsdp): proves a run really sharded its state."""
    from components.core import fsdp

    calls = []
    shard = fsdp.shard

    def counting(tree, *args, **kwargs):
        calls.append(fsdp.is_sharded(placed := shard(tree, *args, **kwargs)))
        return placed

    monkeypatch.setattr(fsdp, "shard", counting)
    return calls
