"""Multi-host start-up: ``jax.distributed.initialize()`` when the environment names a slice.

Call :func:`maybe_initialize` first thing in a stage, before any JAX computation.

How a multi-host run is named, in order:

- ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES``
  and ``JAX_PROCESS_ID``: set these for any multi-process run (several CPU
  processes on one machine, or hosts wired by hand). JAX itself reads
  ``JAX_COORDINATOR_ADDRESS``; the other two are ours.
- A multi-host Cloud TPU slice (TPU VM, GKE TPU node pool): ``TPU_WORKER_HOSTNAMES``
  or ``TPU_PROCESS_ADDRESSES`` lists more than one host, and JAX detects the rest.
- ``ALIGNPIPE_TPU_HOSTS`` > 1: the pipeline's placement of a multi-host slice, for
  platforms that set neither list (a Vertex TPU custom job runs the container on every
  VM of the slice; JAX reads the worker addresses from the TPU VM metadata).

Otherwise (one host, however many local devices) nothing happens. With several
CPU processes, collectives go over gloo. ``JAX_NUM_CPU_DEVICES`` (read by JAX)
sets the virtual CPU devices per process.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

import jax

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
TPU_HOST_LISTS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
# Set by the pipeline's placement (pipelines/targets/placement.py) on a multi-host slice's tasks.
ENV_TPU_HOSTS = "ALIGNPIPE_TPU_HOSTS"


@dataclasses.dataclass(frozen=True, slots=True)
class Cluster:
    """What the environment says about the processes of this run."""

    kind: str  # "single", "explicit" or "tpu"
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0


def _int_env(env: Mapping[str, str], name: str) -> int:
    text = env.get(name, "")
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"{name}={text!r} is not an integer; with {ENV_COORDINATOR} set, give "
            f"{ENV_NUM_PROCESSES} (the number of processes) and {ENV_PROCESS_ID} (0-based)"
        ) from None


def detect_cluster(env: Mapping[str, str] | None = None) -> Cluster:
    """Read the multi-host description from ``env`` (default: ``os.environ``)."""
    env = os.environ if env is None else env
    if env.get(ENV_COORDINATOR):
        num_processes = _int_env(env, ENV_NUM_PROCESSES)
        process_id = _int_env(env, ENV_PROCESS_ID)
        if not 0 <= process_id < num_processes:
            raise ValueError(
                f"{ENV_PROCESS_ID}={process_id} must be in [0, {ENV_NUM_PROCESSES}={num_processes})"
            )
        kind = "explicit" if num_processes > 1 else "single"
        return Cluster(kind, env[ENV_COORDINATOR], num_processes, process_id)
    for name in TPU_HOST_LISTS:
        hosts = [h for h in env.get(name, "").split(",") if h.strip()]
        if len(hosts) > 1:
            return Cluster("tpu", num_processes=len(hosts))
    hosts = env.get(ENV_TPU_HOSTS, "").strip() or "1"
    if not re.fullmatch("[0-9]+", hosts) or int(hosts) < 1:  # ASCII: isdigit takes "²"
        raise ValueError(f"{ENV_TPU_HOSTS}={hosts!r} must be the slice's host count (1 or more)")
    if int(hosts) > 1:
        return Cluster("tpu", num_processes=int(hosts))
    return Cluster("single")


def maybe_initialize(*, timeout_s: int = 300, env: Mapping[str, str] | None = None) -> Cluster:
    """Join the multi-host run the environment names (no-op on a single host)."""
    cluster = detect_cluster(env)
    if cluster.kind == "single" or jax.distributed.is_initialized():
        return cluster
    if cluster.kind == "tpu":
        jax.distributed.initialize(initialization_timeout=timeout_s)
        if jax.process_count() != cluster.num_processes:
            raise RuntimeError(
                f"the slice has {cluster.num_processes} hosts, but JAX joined "
                f"{jax.process_count()} process(es); check the TPU topology the task was placed "
                "on (--tpu-topology) against the slice its VMs form"
            )
        return cluster
    # Several processes: CPU devices need a cross-process collectives backend. The
    # setting only concerns the CPU client, so it is harmless on accelerators.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=cluster.coordinator_address,
        num_processes=cluster.num_processes,
        process_id=cluster.process_id,
        initialization_timeout=timeout_s,
    )
    return cluster


def is_primary() -> bool:
    """Whether this process writes reports and artifacts (process 0)."""
    return jax.process_index() == 0
