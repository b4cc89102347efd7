"""Which layer stack each decoder layer lives in, the shapes of each stack's layers, and the
runs of layers (segments) the transformer scans one repeating period at a time.

A plain model keeps every layer in ``blocks``, one shape for all, with a sliding flag per
layer. Two families need stacks of different shapes:

- Qwen3.5: Gated DeltaNet layers (``linear_blocks``) between attention layers (``blocks``).
- Gemma 4: full-attention layers with their own head width and KV heads, keys serving as
  values (``global_blocks``); and the last ``kv_shared_layers`` layers, which have no key or
  value projections and read the keys and values the last earlier layer of their type
  stored (``shared_blocks``, ``shared_global_blocks``; their MLP may be twice as wide).

Each segment (the layers that own their keys and values, then those that reuse them) must
repeat one period of (stack, sliding) signatures: XLA compiles one period, not the stack.
Every released Gemma 4 and Qwen3.5 checkpoint does (E2B: 3 periods of 4 sliding and 1 full
layer, then 4 shared periods; E4B: 4 + 3 periods of 5 and 1; 31B: 10 periods of 5 and 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

# config.py's ModelConfig, which imports this module (its checks call check_kinds).
ModelConfig = Any

STACKS = ("blocks", "linear_blocks", "global_blocks", "shared_blocks", "shared_global_blocks")
# (stack, sliding): a layer's signature; a period is a tuple of them.
Signature = tuple[str, bool]


@dataclasses.dataclass(frozen=True, slots=True)
class LayerKind:
    """The shapes and wiring of one stack's layers."""

    stack: str
    head_dim: int
    n_kv_heads: int
    hidden_dim: int
    k_eq_v: bool = False  # the key projection's output serves as values too
    owns_kv: bool = True  # False: reuses the keys and values a storing layer wrote

    @property
    def is_global(self) -> bool:
        """Whether the stack holds only full-attention layers with their own shapes."""
        return self.stack.endswith("global_blocks")


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
    """Layers ``start`` to ``end`` (exclusive): ``period`` repeated ``end - start`` / len."""

    start: int
    end: int
    period: tuple[Signature, ...]

    @property
    def periods(self) -> int:
        return (self.end - self.start) // len(self.period)


def split_global(config: ModelConfig) -> bool:
    """Whether full-attention layers differ in shape from sliding ones (Gemma 4)."""
    return (
        config.global_head_dim not in (None, config.resolved_head_dim)
        or config.global_kv_heads not in (None, config.n_kv_heads)
        or config.global_k_eq_v
    )


def uses_kinds(config: ModelConfig) -> bool:
    """Whether the model runs the by-kind segment scan (Qwen3.5, Gemma 4), not one stack."""
    return (
        config.is_hybrid
        or split_global(config)
        or config.kv_shared_layers > 0
        or config.per_layer_dim > 0
        or config.layer_scalar
    )


def first_shared(config: ModelConfig) -> int:
    """The first layer that reuses keys and values (n_layers when none does)."""
    return config.n_layers - config.kv_shared_layers


def layer_stacks(config: ModelConfig) -> list[str]:
    """Per checkpoint layer: the stack it lives in."""
    split, shared_from = split_global(config), first_shared(config)
    stacks = []
    for i, (linear, sliding) in enumerate(
        zip(config.linear_layers(), config.sliding_layers(), strict=True)
    ):
        if linear:
            stacks.append("linear_blocks")
            continue
        base = "global_blocks" if split and not sliding else "blocks"
        stacks.append(f"shared_{base}" if i >= shared_from else base)
    return stacks


def stack_places(config: ModelConfig) -> list[tuple[str, int]]:
    """Per checkpoint layer: its stack and its index there."""
    taken: dict[str, int] = {}
    places = []
    for stack in layer_stacks(config):
        places.append((stack, taken.get(stack, 0)))
        taken[stack] = taken.get(stack, 0) + 1
    return places


def stack_counts(config: ModelConfig) -> dict[str, int]:
    """How many layers each present stack holds, in STACKS order."""
    stacks = layer_stacks(config)
    return {s: stacks.count(s) for s in STACKS if s in stacks}


def stack_kind(config: ModelConfig, stack: str) -> LayerKind:
    """The shapes of ``stack``'s layers."""
    is_global = stack.endswith("global_blocks")
    head_dim = config.resolved_head_dim
    kv = config.n_kv_heads
    if is_global:
        head_dim = config.global_head_dim or head_dim
        kv = config.global_kv_heads or kv
    shared = stack.startswith("shared_")
    return LayerKind(
        stack=stack,
        head_dim=head_dim,
        n_kv_heads=kv,
        hidden_dim=config.hidden_dim * (config.shared_mlp_factor if shared else 1),
        k_eq_v=is_global and config.global_k_eq_v,
        owns_kv=not shared,
    )


def kind_of(config: ModelConfig, kind: LayerKind | None) -> LayerKind:
    """``kind``, or a plain model's one kind (``blocks``)."""
    return kind if kind is not None else stack_kind(config, "blocks")


def _period(signatures: list[Signature]) -> tuple[Signature, ...]:
    """The shortest run of ``signatures`` that repeats to make them all."""
    count = len(signatures)
    for period in range(1, count + 1):
        if count % period == 0 and signatures == signatures[:period] * (count // period):
            return tuple(signatures[:period])
    return tuple(signatures)


def segments(config: ModelConfig) -> list[Segment]:
    """The layers owning their keys and values, then those reusing them, each by period.

    A segment that does not repeat a shorter period is scanned as one period of all its
    layers (compiled whole): refused past 8 layers by :func:`check_kinds`.
    """
    signatures = list(zip(layer_stacks(config), config.sliding_layers(), strict=True))
    bounds = [(0, first_shared(config)), (first_shared(config), config.n_layers)]
    return [
        Segment(start, end, _period(signatures[start:end])) for start, end in bounds if end > start
    ]


def store_layers(config: ModelConfig) -> dict[bool, int]:
    """Per layer type (sliding or not): the last layer owning its keys and values, whose
    keys and values the shared layers of that type reuse (transformers' ``store``)."""
    sliding = config.sliding_layers()
    stores: dict[bool, int] = {}
    for i in range(first_shared(config)):
        if not config.linear_layers()[i]:
            stores[sliding[i]] = i
    return stores


def check_kinds(config: ModelConfig) -> None:
    """Refuse a Gemma 4 layout this model cannot run, naming the field and the fix."""
    shared = config.kv_shared_layers
    if not 0 <= shared < config.n_layers:
        raise ValueError(
            f"ModelConfig.kv_shared_layers ({shared}) must be in [0, n_layers = "
            f"{config.n_layers}): some earlier layer must store the keys and values"
        )
    if config.shared_mlp_factor < 1 or (config.shared_mlp_factor > 1 and not shared):
        raise ValueError(
            f"ModelConfig.shared_mlp_factor ({config.shared_mlp_factor}) must be >= 1, and 1 "
            "without kv_shared_layers (it widens the shared layers' MLP)"
        )
    if config.per_layer_dim < 0 or (config.per_layer_dim > 0) != (config.per_layer_vocab > 0):
        raise ValueError(
            f"ModelConfig.per_layer_dim ({config.per_layer_dim}) and per_layer_vocab "
            f"({config.per_layer_vocab}) must both be > 0 (per-layer input embeddings) or 0"
        )
    head, kv = config.global_head_dim, config.global_kv_heads
    if (head is not None and (head < 2 or head % 2)) or (
        kv is not None and (kv < 1 or config.n_heads % kv)
    ):
        raise ValueError(
            f"ModelConfig.global_head_dim ({head}) must be even and global_kv_heads ({kv}) "
            f"divide n_heads ({config.n_heads})"
        )
    if not uses_kinds(config):
        return
    if config.is_hybrid and (split_global(config) or shared or config.per_layer_dim):
        raise ValueError(
            "ModelConfig: Gated DeltaNet layers beside Gemma 4's per-type shapes, shared keys "
            "and values or per-layer inputs are not modelled together"
        )
    stores = store_layers(config)
    needed = {config.sliding_layers()[i] for i in range(first_shared(config), config.n_layers)}
    missing = sorted("sliding" if s else "full" for s in needed - set(stores))
    if missing:
        raise ValueError(
            f"ModelConfig.kv_shared_layers ({shared}): no earlier {missing} attention layer "
            "stores the keys and values the shared layers of that type reuse"
        )
    for segment in segments(config):
        if len(segment.period) == segment.end - segment.start and len(segment.period) > 8:
            raise ValueError(
                f"ModelConfig.layer_types: layers {segment.start}-{segment.end - 1} do not "
                "repeat one pattern of layer types; alignpipe scans such a stack one period "
                "at a time"
            )
