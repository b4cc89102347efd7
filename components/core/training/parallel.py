"""Data parallelism with ``jax.pmap``: place state, shard batches, one compiled train step.

Every per-device array carries a leading axis of the local device count. The
train step averages gradients and metrics over the ``data`` axis with
``lax.pmean`` and skips the update when the loss or the gradients are not
finite, so one bad batch cannot poison the parameters. State is replicated,
or with ``place(..., sharded=True)`` split into chunks over the devices and
gathered where it is used (fsdp.py); the step works on either.

A stage splits its model once, ``graphdef, params = nnx.split(model, nnx.Param)``,
keeps ``params`` (an ``nnx.State``) in a :class:`TrainState`, and its loss merges
``nnx.merge(graphdef, params)`` inside the step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax

from components.core.training import fsdp
from components.core.training.host import on_host
from components.core.training.optim import OptimConfig, adamw_step, make_optimizer

PyTree = Any
LossFn = Callable[[PyTree, Mapping[str, jax.Array], jax.Array], tuple[jax.Array, dict]]


@flax.struct.dataclass
class TrainState:
    """What one optimizer step changes: the step count, the parameters and the optimizer state."""

    step: jax.Array
    params: PyTree
    opt_state: PyTree

    @classmethod
    def create(
        cls, params: PyTree, optimizer: OptimConfig | optax.GradientTransformation
    ) -> TrainState:
        """A fresh state at step 0 for ``params`` (e.g. an ``nnx.State``), in host memory;
        ``optimizer`` as :func:`make_train_step` takes it."""
        if isinstance(optimizer, OptimConfig):
            optimizer = make_optimizer(optimizer)
        with on_host():
            return cls(
                step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
            )


def local_device_count() -> int:
    """Devices this process feeds (the length of every leading device axis)."""
    return jax.local_device_count()


def _devices(devices: Sequence[jax.Device] | None) -> list[jax.Device]:
    return list(devices) if devices is not None else jax.local_devices()


def replicate(tree: PyTree, devices: Sequence[jax.Device] | None = None) -> PyTree:
    """``tree`` with a leading device axis, one copy placed on each local device."""
    devices = _devices(devices)
    return jax.tree.map(lambda leaf: fsdp.put_rows([leaf] * len(devices), devices), tree)


def place(
    tree: PyTree, *, sharded: bool = False, devices: Sequence[jax.Device] | None = None
) -> PyTree:
    """``tree`` on the devices: replicated, or split into chunks (``sharded``, see fsdp.py)."""
    return fsdp.shard(tree, devices) if sharded else replicate(tree, devices)


def unreplicate(tree: PyTree) -> PyTree:
    """The host copy of a placed tree: the first local device's copy, or the gathered chunks."""

    def take(leaf: Any) -> np.ndarray:
        if isinstance(leaf, fsdp.Sharded):
            return fsdp.unshard(leaf)
        if isinstance(leaf, jax.Array):
            # addressable_shards works for multi-host outputs, where leaf[0] may not be local.
            return np.asarray(np.asarray(leaf.addressable_shards[0].data)[0])
        return np.asarray(np.asarray(leaf)[0])

    return jax.tree.map(take, tree, is_leaf=lambda n: isinstance(n, fsdp.Sharded))


def checkpoint_view(tree: PyTree) -> PyTree:
    """A placed tree as a checkpoint stores it, without gathering chunks to any host.

    Chunks stay the device arrays ``[devices, *lead, chunk]`` they are (Orbax has each
    host write its own); replicated leaves become one host copy. Save it with
    ``chunks=`` the device count; the checkpoint restores whole tensors (checkpoint.py).
    """

    def take(leaf: Any) -> Any:
        if isinstance(leaf, fsdp.Sharded):
            return fsdp.global_chunks(leaf.chunk)
        return unreplicate(leaf)

    return jax.tree.map(take, tree, is_leaf=lambda n: isinstance(n, fsdp.Sharded))


def shard_batch(
    batch: Mapping[str, np.ndarray], devices: Sequence[jax.Device] | None = None
) -> dict[str, np.ndarray]:
    """Reshape a host batch ``[B, ...]`` to ``[devices, B / devices, ...]``."""
    count = len(_devices(devices))
    sharded = {}
    for name, array in batch.items():
        array = np.asarray(array)
        if array.ndim == 0 or array.shape[0] % count:
            size = array.shape[0] if array.ndim else "a scalar"
            raise ValueError(
                f"batch field {name!r} has batch size {size}, which does not split over "
                f"{count} local devices; set the per-host batch size to a multiple of {count}"
            )
        sharded[name] = array.reshape(count, array.shape[0] // count, *array.shape[1:])
    return sharded


def make_train_step(
    loss_fn: LossFn,
    optimizer: OptimConfig | optax.GradientTransformation,
    *,
    axis_name: str = "data",
    devices: Sequence[jax.Device] | None = None,
) -> Callable[..., tuple[TrainState, dict]]:
    """A pmapped ``step(state, batch, rng, frozen=None) -> (state, metrics)`` that donates
    ``state``; ``step.lower`` takes the same arguments and lowers it without running.

    ``loss_fn(params, batch, rng) -> (loss, aux_metrics)`` sees one device's slice
    of the batch. ``optimizer`` is the stages' AdamW as an ``OptimConfig`` (the state is
    ``make_optimizer(config)``'s, and ``optim.adamw_step`` applies it) or any optax
    transformation. ``rng`` is one key for all devices; each folds in its index.
    ``frozen`` (placed like the state, never donated) holds parameters the loss reads but
    the step does not train, e.g. a base model under LoRA adapters (lora.py): the loss
    sees them joined with ``state.params``, and no gradient or optimizer state exists for
    them. Metrics come back replicated; ``skipped`` is 1.0 where the update was dropped.
    """

    def step(state: TrainState, batch: Mapping[str, Any], rng: jax.Array, frozen: PyTree):
        rng = jax.random.fold_in(rng, lax.axis_index(axis_name))
        whole = fsdp.gather_outer(frozen)

        def joined_loss(params: PyTree, *args: Any):
            params = fsdp.gather_outer(params)
            return loss_fn(params if whole is None else nnx.merge_state(whole, params), *args)

        grad_fn = jax.value_and_grad(joined_loss, has_aux=True)
        (loss, aux), grads = grad_fn(state.params, batch, rng)
        loss, aux, grads = fsdp.mean_over_devices((loss, aux, grads), axis_name)
        grad_norm = fsdp.global_norm(grads)
        # Checked after pmean, so every device takes the same branch.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        new_state = _apply_if(finite, optimizer, state, grads, grad_norm)
        metrics = dict(aux)
        metrics.update(loss=loss, grad_norm=grad_norm, skipped=1.0 - finite.astype(jnp.float32))
        return new_state, metrics

    pmapped = jax.pmap(
        step,
        axis_name=axis_name,
        in_axes=(0, 0, None, 0),
        donate_argnums=0,
        devices=None if devices is None else list(devices),
    )

    def call(state: TrainState, batch: Mapping[str, Any], rng: jax.Array, frozen: PyTree = None):
        return pmapped(state, batch, rng, frozen)

    # The compiled program without running it (memory_analysis: benchmarks/bench_*_memory).
    call.lower = lambda state, batch, rng, frozen=None: pmapped.lower(state, batch, rng, frozen)
    return call


def apply_adamw(
    state: TrainState,
    optim: OptimConfig,
    grads: PyTree,
    finite: jax.Array,
    *,
    lr_scale: jax.Array | float = 1.0,
    grad_norm: jax.Array | None = None,
) -> TrainState:
    """``optim.adamw_step`` on ``state``: applied, and the step counted, only where ``finite``."""
    params, opt_state = adamw_step(
        optim, state.params, grads, state.opt_state, finite,
        lr_scale=lr_scale, grad_norm=grad_norm,
    )  # fmt: skip
    step = jnp.where(finite, state.step + 1, state.step)
    return state.replace(step=step, params=params, opt_state=opt_state)


def _apply_if(
    finite: jax.Array,
    optimizer: OptimConfig | optax.GradientTransformation,
    state: TrainState,
    grads: PyTree,
    grad_norm: jax.Array,
) -> TrainState:
    """One optimizer step where ``finite``, else ``state`` as it was (every device agrees)."""
    if isinstance(optimizer, OptimConfig):
        return apply_adamw(state, optimizer, grads, finite, grad_norm=grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    updated = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    return jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, state)


class NonFiniteGuard:
    """Counts skipped (non-finite) steps in a row and aborts after ``max_in_a_row``."""

    def __init__(self, max_in_a_row: int) -> None:
        if max_in_a_row < 1:
            raise ValueError(f"max_in_a_row must be at least 1, got {max_in_a_row}")
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0

    def update(self, step: int, skipped: float) -> None:
        """Record one step's ``skipped`` metric; raise when too many came in a row."""
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.max_in_a_row:
            raise FloatingPointError(
                f"the loss or gradients were not finite for {self.in_a_row} steps in a row "
                f"(up to step {step}); training stopped. Lower the learning rate, raise "
                "warmup_steps or max_grad_norm, or check the data for empty sequences"
            )
