"""Test set-up: 8 virtual CPU devices for pmap, before any JAX computation.

One persistent XLA compilation cache per test session (shared by pytest-xdist's workers,
and by the stage processes tests start, which inherit the environment): the same stage
compiled again in another process or run (kfp.local tasks, resumed runs) is read back
instead of recompiled. Cached executables are XLA's own output for the same program, so
results do not change; only the compile time goes. Every program is cached, however quick
its compile: a stage process runs dozens of small ones (each initialiser, each eager op),
about 2.5 s of compiling in all on 2 cores, read back in about 0.5 s.
"""

import os
import shutil
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# LLVM at -O1 instead of XLA's -O3: the tests compile far more than they run. No fast-math
# flags are set, so LLVM may not reorder float arithmetic, and the bits are the same
# (measured: the PPO update's state after 4 calls hashes alike, and `make demo` at -O1 prints
# every figure to the last digit; at -O0 the hash differed, so not -O0). test_ppo_update and
# test_fsdp took 0.78-0.86x the CPU time, two rounds each way, and the multi-process modules
# 0.80x. Stages outside the tests keep -O3: the demo gains nothing (205 vs 208 s), its time
# is running, not compiling.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=1"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {TEST_XLA_FLAGS}")
# Made by the first process of the session (pytest-xdist's controller, or a plain pytest),
# which removes it at the end; workers inherit the variable. A folder the user named is kept.
_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="alignpipe-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Weight-file digests (components/core/file_digest.py) are cached in the session's folder,
# not the user's ~/.cache.
if _OWN_CACHE is not None:
    os.environ.setdefault("ALIGNPIPE_DIGEST_CACHE", os.path.join(_OWN_CACHE, "digests.json"))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")


import pytest  # noqa: E402


@pytest.fixture
def sharded_placements(monkeypatch):
    """Counts the trees placed in chunks (fsdp): proves a run really sharded its state."""
    from components.core.training import fsdp

    calls = []
    shard = fsdp.shard

    def counting(tree, *args, **kwargs):
        calls.append(fsdp.is_sharded(placed := shard(tree, *args, **kwargs)))
        return placed

    monkeypatch.setattr(fsdp, "shard", counting)
    return calls


# The modules that take minutes, longest first: with pytest-xdist (``-n 2 --dist loadfile
# --no-loadscope-reorder``, as ``make test`` runs) each worker starts on one of them and the
# short modules fill in after, instead of two long ones ending the run on one worker.
LONG_MODULES = (
    "test_pipeline_local.py",
    "test_hf_pipeline.py",
    "test_ppo_stage.py",
    "test_ppo_multihost.py",
    "test_reward_processes.py",
    "test_realign_local.py",
    "test_training_stages.py",
    "test_ppo_update.py",
    "test_fsdp.py",
    "test_model.py",
    "test_multihost.py",
    "test_dpo.py",
    "test_eval_stage.py",
)


def pytest_unconfigure(config):
    """The session's compilation cache goes with it (tens of MB a run, left in /tmp before)."""
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """Long modules first, in LONG_MODULES order; the rest keep their order."""
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
