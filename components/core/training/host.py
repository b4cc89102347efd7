"""Host memory for models before placement: JAX's CPU backend, never an accelerator.

A stage builds or loads its models and optimizer state whole, then places them
on the devices (replicated or in chunks, ``parallel.place``). Built on the default
device, that whole copy would sit on accelerator 0 for as long as a reference to
it lives (a 1B model's float32 parameters and AdamW moments are 15 GB: a v5e chip
holds 16), outside every per-chip memory estimate. Under :func:`on_host` arrays
are created in host memory instead, which the CPU backend (present on every TPU
or GPU VM unless ``JAX_PLATFORMS`` leaves it out) addresses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

PyTree = Any


def host_device() -> jax.Device:
    """This process's CPU device: its memory is this host's."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError as error:
        raise RuntimeError(
            "JAX has no CPU backend here, so models would be built on an accelerator; "
            "include cpu in JAX_PLATFORMS (e.g. JAX_PLATFORMS=tpu,cpu)"
        ) from error


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """New arrays (initialisers, ``optimizer.init``, restores) go to host memory."""
    with jax.default_device(host_device()):
        yield


def host_abstract(abstract: PyTree) -> PyTree:
    """``ShapeDtypeStruct`` leaves placed on the host device (an Orbax restore target)."""
    sharding = jax.sharding.SingleDeviceSharding(host_device())

    def place(leaf: Any) -> Any:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
        return leaf

    return jax.tree.map(place, abstract)
