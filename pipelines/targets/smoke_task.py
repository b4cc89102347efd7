"""What the smoke task runs inside the training image: the devices JAX sees, one pmap step.

Imported by the smoke component's body at run time, so it imports no kfp: under the KFP
executor, ``kfp.dsl`` lacks the pipeline-building names that ``pipelines.targets.placement`` needs.
The pipeline around it is ``pipelines/targets/smoke.py``.
"""

from __future__ import annotations

from typing import Any

PLATFORMS = ("tpu", "gpu", "cpu")
_SIDE = 128  # of each device's square matrix: one MXU tile on TPU, instant on CPU


class SmokeError(RuntimeError):
    """The task's devices are not the ones the placement asked for, or the step is wrong."""


def _print_devices(jax: Any) -> None:
    """What JAX sees, as the task's log shows it."""
    devices = jax.devices()
    print(
        f"JAX {jax.__version__}, process {jax.process_index()} of {jax.process_count()}: "
        f"{len(devices)} {devices[0].platform} device(s), {jax.local_device_count()} local, "
        f"kind {devices[0].device_kind!r}"
    )
    for device in jax.local_devices():
        print(f"  {device!r}")


def _device_problems(jax: Any, expected_platform: str, expected_devices: int) -> list[str]:
    """Each way the devices differ from the expected ones, with what to check."""
    platform, count = jax.devices()[0].platform, jax.device_count()
    problems = []
    if platform != expected_platform:
        problems.append(
            f"JAX sees {platform} devices, not {expected_platform}: the image's JAX did not "
            f"find the accelerator. For tpu, the image needs jax[tpu] (libtpu; "
            "containers/Dockerfile.train installs it) and JAX_PLATFORMS unset, and the task "
            "must run on a TPU VM (vertex: the custom job's machine type; gke: a TPU node pool)"
        )
    if count != expected_devices:
        problems.append(
            f"JAX sees {count} devices, the placement asked for {expected_devices}: the "
            "topology (--tpu-topology) and the machine type (vertex) or the node pool's "
            "topology (gke) disagree, or another process holds some of the chips"
        )
    return problems


def _pmap_step(jax: Any) -> tuple[float, float]:
    """One pmap step over every device: (its psum, the exact value it must have)."""
    import numpy as np
    from jax import lax
    from jax import numpy as jnp

    def step(_: Any) -> Any:
        block = jnp.full((_SIDE, _SIDE), lax.axis_index("data") + 1, jnp.float32)
        return lax.psum(jnp.sum(block @ block.T), "data")

    total = jax.pmap(step, axis_name="data")(np.zeros(jax.local_device_count()))
    # Device i's block has entries i+1, so its matmul sums to SIDE**3 * (i+1)**2: exact in
    # float32 (small integers times a power of two), also with TPU's bf16 matmul passes.
    expected = _SIDE**3 * sum((i + 1) ** 2 for i in range(jax.device_count()))
    return float(np.asarray(total)[0]), float(expected)


def check_devices(expected_platform: str, expected_devices: int) -> dict[str, Any]:
    """Print the devices JAX sees, refuse unexpected ones, run one pmap step; a summary.

    Runs on one host or, when the environment names a multi-host slice, on each of its
    hosts (``components.core.training.distributed``). On CPU it gets virtual devices
    (``ALIGNPIPE_CPU_DEVICES``, default 8), as the local pipeline does.
    """
    import time

    if expected_platform not in PLATFORMS:
        raise ValueError(f"expected_platform: {expected_platform!r} is not one of {PLATFORMS}")
    if expected_devices < 1:
        raise ValueError(f"expected_devices: {expected_devices} must be at least 1")
    import jax

    from components.core.entry import configure_cpu_devices
    from components.core.training.distributed import maybe_initialize

    configure_cpu_devices()  # the CPU backend only: accelerators are their own devices
    maybe_initialize()
    _print_devices(jax)
    problems = _device_problems(jax, expected_platform, expected_devices)
    if problems:
        raise SmokeError("smoke check failed: " + "; ".join(problems))
    started = time.perf_counter()
    value, expected = _pmap_step(jax)
    seconds = time.perf_counter() - started
    if abs(value - expected) > 1e-6 * expected:
        raise SmokeError(
            f"smoke check failed: the pmap step's psum is {value:g}, not {expected:g}: a "
            "device computes wrongly or the collective does not reach every device"
        )
    summary = {
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "local_devices": jax.local_device_count(),
        "processes": jax.process_count(),
        "process": jax.process_index(),
        "jax": jax.__version__,
        "pmap_psum": value,
        "pmap_seconds": round(seconds, 3),
    }
    print(f"smoke check passed: one pmap step on {summary['devices']} devices in {seconds:.2f} s")
    return summary
