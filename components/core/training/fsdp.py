"""Fully sharded state inside ``jax.pmap`` (ZeRO-3): each device holds 1/N of every tensor.

With ``fsdp`` on, a stage places its parameters and optimizer state with
:func:`shard` instead of replicating them: every tensor is flattened after its
leading layer axis (the scanned stack keeps it, so a scan still walks the
layers), padded to a multiple of the device count N, and device *i* keeps
chunk *i*. On the device such a leaf is a :class:`Sharded` pytree node, the
chunk plus the full shape as static data, so optax, ``jnp.where`` and the EMA
see ordinary (sharded) arrays and update them elementwise.

Inside the pmapped step a tensor is all-gathered only where it is used:

* :func:`gather_outer` gathers the tensors outside the layer stack (embeddings,
  final norm, heads) once per forward;
* the model's layer scan calls :func:`gather` on one layer's parameters at a
  time, inside the rematerialised scan body, so the backward pass gathers that
  layer again instead of keeping it: one layer's full weights live at a time.

The transpose of ``all_gather`` is a reduce-scatter, so ``jax.grad`` returns each
device's chunk of the gradient summed over every device: :func:`mean_over_devices`
divides it by N (and ``pmean``s the replicated leaves), :func:`global_norm` adds
the chunks' squares over devices. Checkpoints store the chunks as the devices
hold them (:func:`global_chunks`, each host writing its own) and restore them
joined into whole tensors (:func:`join_like`); exports are whole tensors
(:func:`unshard`). So a run can resume with or without ``fsdp`` and on any
device count.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from components.core.model import layer_kinds

PyTree = Any
AXIS = "data"
LAYER_STACKS = layer_kinds.STACKS  # Transformer stacks: a leading layer axis
ROW_TABLES = ("per_layer_inputs", "table")  # read by rows only: never gathered whole


@jax.tree_util.register_pytree_node_class
class Sharded:
    """One device's chunk ``[*lead, chunk]`` of a tensor whose trailing shape is ``rest``.

    ``lead`` axes (the layer axis of the stack, and pmap's device axis outside the
    step) are kept whole; the ``rest`` axes are flattened, padded with zeros and
    split over the ``axis`` devices.
    """

    def __init__(self, chunk: Any, rest: tuple[int, ...], axis: str = AXIS) -> None:
        self.chunk, self.rest, self.axis = chunk, rest, axis

    def tree_flatten(self) -> tuple[tuple[Any], tuple[tuple[int, ...], str]]:
        return (self.chunk,), (self.rest, self.axis)

    @classmethod
    def tree_unflatten(cls, aux: tuple[tuple[int, ...], str], children: Sequence[Any]) -> Sharded:
        return cls(children[0], *aux)

    def __repr__(self) -> str:
        shape = getattr(self.chunk, "shape", None)
        return f"Sharded(chunk={shape}, rest={self.rest}, axis={self.axis!r})"


def _is_sharded(node: Any) -> bool:
    return isinstance(node, Sharded)


def is_sharded(tree: PyTree) -> bool:
    """Whether any leaf of ``tree`` is a :class:`Sharded` chunk."""
    return any(_is_sharded(n) for n in jax.tree.leaves(tree, is_leaf=_is_sharded))


# --- inside the pmapped step ------------------------------------------------------------


def _gather_one(node: Sharded) -> jax.Array:
    """The full tensor ``[*lead, *rest]`` of one chunk (an all-gather over its axis)."""
    chunk = node.chunk
    full = lax.all_gather(chunk, node.axis, axis=chunk.ndim - 1, tiled=True)
    full = full[..., : math.prod(node.rest)]
    return full.reshape(*chunk.shape[:-1], *node.rest)


def gather(tree: PyTree) -> PyTree:
    """``tree`` with every chunk all-gathered to its full tensor (identity without chunks)."""
    return jax.tree.map(
        lambda n: _gather_one(n) if _is_sharded(n) else n, tree, is_leaf=_is_sharded
    )


def _row_table(path: tuple) -> bool:
    """Whether ``path`` leads to a table only ever read by rows (:func:`sharded_rows`)."""
    keys = [getattr(key, "key", None) for key in path]
    return any(keys[i : i + 2] == list(ROW_TABLES) for i in range(len(keys) - 1))


def gather_outer(tree: PyTree) -> PyTree:
    """Gather the chunks without a leading layer axis; the layer stack stays sharded, and so
    does a table read by rows (Gemma 4's per-layer inputs: :func:`sharded_rows`).

    The model's layer scan gathers each layer's chunks itself (:func:`gather`).
    """

    def one(path: tuple, node: Any) -> Any:
        whole = _is_sharded(node) and node.chunk.ndim == 1 and not _row_table(path)
        return _gather_one(node) if whole else node

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_sharded)


def sharded_rows(node: Sharded, ids: jax.Array) -> jax.Array:
    """Rows ``ids`` [...] of a [V, W] table held as chunks (``node``), without gathering it.

    Every device looks up, for every device's ids (an all-gather of the ids), the elements
    of their rows that lie in its own chunk, zeros elsewhere; a reduce-scatter sums the
    pieces and hands each device its own rows [..., W]. A device holds the rows of every
    device's ids ([N, ..., W]), not the table: Gemma 4 E4B's [262144, 10752] would be 11 GiB
    in float32. The gradient flows back to each device's chunk alone.
    """
    chunk, (_, width) = node.chunk, node.rest
    size = chunk.shape[-1]
    me = lax.axis_index(node.axis)
    every = lax.all_gather(ids.astype(jnp.int32), node.axis)  # [N, ...]
    # This chunk starts at element me·size = row·width + col; in int32 without overflow
    # (the table may hold more than 2**31 elements) from size = rows·width + cols.
    rows, cols = divmod(size, width)
    start_row = me * rows + (me * cols) // width
    start_col = (me * cols) % width
    step = every[..., None] - start_row  # rows after the chunk's first
    inside_rows = (step >= 0) & (step <= rows + 1)
    local = jnp.clip(step, 0, rows + 1) * width + jnp.arange(width) - start_col
    inside = inside_rows & (local >= 0) & (local < size)
    pieces = jnp.where(inside, chunk[jnp.clip(local, 0, size - 1)], 0)
    return lax.psum_scatter(pieces, node.axis, scatter_dimension=0)


def after(tree: PyTree, done: Any) -> PyTree:
    """``tree``'s chunks made to depend on ``done``: nothing gathers them before ``done`` exists.

    Scoring one network after another, each pass's gathered tensors are then dead
    before the next network's are gathered. A data dependency, because
    ``lax.optimization_barrier`` did not stop XLA (CPU, measured) from gathering four
    networks' embeddings at once. The added term is exactly 0 whatever ``done`` holds
    (NaN included) and costs one pass over this device's chunks; a tree without
    chunks is returned as it is.
    """
    if not is_sharded(tree):
        return tree
    signal = sum(jnp.sum(leaf) for leaf in jax.tree.leaves(done) if jnp.size(leaf))
    zero = (signal > 0).astype(jnp.float32) * 0.0  # a 0 XLA cannot fold away

    def one(node: Any) -> Any:
        if not _is_sharded(node):
            return node
        return Sharded(node.chunk + zero.astype(node.chunk.dtype), node.rest, node.axis)

    return jax.tree.map(one, tree, is_leaf=_is_sharded)


def mean_over_devices(tree: PyTree, axis_name: str = AXIS) -> PyTree:
    """The mean over devices: chunks (gradients already summed by the reduce-scatter) / N,
    every other leaf ``pmean``-ed as ONE all-reduce of the leaves raveled into a vector.

    Each collective is a rendezvous of every device thread; on CPU one per leaf costs
    more than the arithmetic it averages. On one device the tree is its own mean: returned
    as it is, without the all-reduce and the copies into and out of its vector (on one CPU
    device 5% of the PPO update's thunk time, ``benchmarks/bench_ppo_update.py --profile``).
    """
    if lax.psum(1, axis_name) == 1:  # the axis size, known when tracing
        return tree
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_sharded)
    plain = [i for i, leaf in enumerate(leaves) if not _is_sharded(leaf)]
    if plain:
        flat, unravel = ravel_pytree([leaves[i] for i in plain])
        for i, value in zip(plain, unravel(lax.pmean(flat, axis_name)), strict=True):
            leaves[i] = value
    count = lax.psum(1, axis_name)
    for i, leaf in enumerate(leaves):
        if _is_sharded(leaf):
            leaves[i] = Sharded(leaf.chunk / count, leaf.rest, leaf.axis)
    return jax.tree.unflatten(treedef, leaves)


def global_norm(tree: PyTree) -> jax.Array:
    """L2 norm of the whole (unsharded) tree: chunks' squares are summed over devices.

    Padding is zero, so it adds nothing. Equals ``optax.tree.norm`` on a tree without chunks.
    """
    squares = jnp.zeros((), jnp.float32)
    sharded: dict[str, jax.Array] = {}
    for leaf in jax.tree.leaves(tree, is_leaf=_is_sharded):
        if _is_sharded(leaf):
            part = jnp.sum(jnp.square(leaf.chunk.astype(jnp.float32)))
            sharded[leaf.axis] = sharded.get(leaf.axis, 0.0) + part
        else:
            squares = squares + jnp.sum(jnp.square(jnp.asarray(leaf, jnp.float32)))
    for axis, part in sharded.items():
        squares = squares + lax.psum(part, axis)
    return jnp.sqrt(squares)


# --- on the host ---------------------------------------------------------------------------


def _lead(path: tuple) -> int:
    """1 for tensors of the scanned layer stack (their first axis is the layer), else 0."""
    return int(any(getattr(key, "key", None) in LAYER_STACKS for key in path))


def _local_chunks(full: np.ndarray, lead: int, devices: int) -> np.ndarray:
    """``[devices, *lead, chunk]``: the padded, flattened tensor split into equal chunks."""
    flat = full.reshape(*full.shape[:lead], -1)
    size = flat.shape[-1]
    chunk = -(-size // devices)
    padding = [(0, 0)] * lead + [(0, devices * chunk - size)]
    flat = np.pad(flat, padding)
    return np.moveaxis(flat.reshape(*flat.shape[:lead], devices, chunk), lead, 0)


def put_rows(rows: Sequence[np.ndarray], devices: Sequence[jax.Device]) -> jax.Array:
    """One pmap input ``[devices, ...]`` whose row *i* is ``rows[i]``, placed on device *i*.

    One transfer per device: no host array of size devices × row is built.
    """
    devices = list(devices)
    first = np.asarray(rows[0])
    sharding = NamedSharding(Mesh(np.array(devices), (AXIS,)), PartitionSpec(AXIS))
    placed = [
        jax.device_put(np.asarray(row)[None], device)
        for row, device in zip(rows, devices, strict=True)
    ]
    return jax.make_array_from_single_device_arrays((len(devices), *first.shape), sharding, placed)


@functools.cache
def axis_indices(devices: tuple[jax.Device, ...]) -> tuple[int, ...]:
    """The pmap axis index of each of this process's ``devices``, in their order.

    One process: the position in ``devices``. Several: asked of a pmap over every
    device, since the global order of hosts' devices is the runtime's to choose.
    """
    if jax.process_count() == 1:
        return tuple(range(len(devices)))
    rows = put_rows([np.zeros((), np.int32)] * len(devices), devices)
    out = jax.pmap(lambda _: lax.axis_index(AXIS), axis_name=AXIS)(rows)
    by_device = {s.device: int(np.asarray(s.data).reshape(-1)[0]) for s in out.addressable_shards}
    return tuple(by_device[d] for d in devices)


def shard(
    tree: PyTree, devices: Sequence[jax.Device] | None = None, axis_name: str = AXIS
) -> PyTree:
    """``tree`` on the devices: tensors split into chunks, scalars replicated.

    Chunk *i* goes to the device whose pmap axis index is *i* (:func:`axis_indices`).
    """
    devices = list(devices) if devices is not None else jax.local_devices()
    local = len(devices)
    total = local * jax.process_count()
    indices = axis_indices(tuple(devices))

    def place(path: tuple, leaf: Any) -> Any:
        full = np.asarray(leaf)
        lead = _lead(path)
        if full.ndim <= lead:  # scalars (step counts) stay whole on every device
            return put_rows([full] * local, devices)
        chunks = _local_chunks(full, lead, total)
        rows = [chunks[i] for i in indices]
        return Sharded(put_rows(rows, devices), full.shape[lead:], axis_name)

    return jax.tree_util.tree_map_with_path(place, tree)


def unshard(node: Sharded) -> np.ndarray:
    """The full host tensor of a pmap output's chunks ``[devices, *lead, chunk]``."""
    array = node.chunk
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        chunks = np.asarray(multihost_utils.process_allgather(array, tiled=True))
    else:
        chunks = np.asarray(array)
    return join_chunks(chunks, node.rest)


def join_chunks(chunks: np.ndarray, rest: tuple[int, ...]) -> np.ndarray:
    """The full tensor ``[*lead, *rest]`` of all devices' chunks ``[devices, *lead, chunk]``."""
    flat = np.moveaxis(chunks, 0, -2)
    flat = flat.reshape(*flat.shape[:-2], -1)[..., : math.prod(rest)]
    return flat.reshape(*flat.shape[:-1], *rest)


# --- checkpoints: chunks as the devices hold them -----------------------------------------


@functools.cache
def devices_by_axis_index() -> tuple[jax.Device, ...]:
    """Every process's devices, the one with pmap axis index *i* at position *i*."""
    local = jax.local_devices()
    pairs = np.array([[d.id, i] for d, i in zip(local, axis_indices(tuple(local)), strict=True)])
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        pairs = np.asarray(multihost_utils.process_allgather(pairs, tiled=True))
    by_id = {d.id: d for d in jax.devices()}
    return tuple(by_id[int(i)] for i, _ in sorted(pairs.tolist(), key=lambda p: p[1]))


def global_chunks(array: jax.Array) -> jax.Array:
    """A chunk array as one array over every process's devices, row *i* = chunk *i*.

    Placed chunks are this process's rows only; Orbax saves an array spanning all
    processes, each writing the rows it holds. pmap outputs already span them.
    """
    total = jax.device_count()
    if array.shape[0] == total:
        return array
    devices = devices_by_axis_index()
    sharding = NamedSharding(Mesh(np.array(devices), (AXIS,)), PartitionSpec(AXIS))
    pieces = [shard.data for shard in array.addressable_shards]
    return jax.make_array_from_single_device_arrays((total, *array.shape[1:]), sharding, pieces)


def chunk_template(tree: PyTree, devices: int) -> PyTree:
    """Host arrays shaped as :func:`shard` chunks ``tree`` over ``devices`` (a restore target).

    ``np.zeros`` pages are only touched when Orbax writes the restored values into them.
    """

    def one(path: tuple, leaf: Any) -> Any:
        full = np.asarray(leaf)
        lead = _lead(path)
        if full.ndim <= lead:
            return full
        chunk = -(-math.prod(full.shape[lead:]) // devices)
        return np.zeros((devices, *full.shape[:lead], chunk), full.dtype)

    return jax.tree_util.tree_map_with_path(one, tree)


def join_like(chunked: PyTree, template: PyTree) -> PyTree:
    """Restored :func:`chunk_template` arrays joined back into ``template``'s whole tensors."""

    def one(path: tuple, full: Any, chunks: Any) -> Any:
        lead = _lead(path)
        if np.ndim(full) <= lead:
            return chunks
        return join_chunks(np.asarray(chunks), tuple(np.shape(full)[lead:]))

    return jax.tree_util.tree_map_with_path(one, template, chunked)
