"""Low-rank adapters on a model: attach, merge, and split trainable from frozen parameters.

The adapters are Flax NNX's ``LoRALinear`` (``layers.LoRADense`` adds PEFT's alpha/rank
scale) on the projections ``ModelConfig.lora_targets`` names: their ``lora_a`` [in, r] and
``lora_b`` [r, out] are ``nnx.LoRAParam``s, stacked over layers like every other weight.

A stage that trains adapters

* starts from a model whose own adapters (if it was trained with some) are merged into
  its weights (:func:`merge`), then gets fresh ones (:func:`attach`): B = 0, so the model
  computes exactly what it did;
* trains only what :data:`TRAINABLE` selects (adapters and a scalar head) and keeps the
  rest frozen in the compute dtype (:func:`split`): bf16 halves the base's memory, and no
  gradient or optimizer state exists for it;
* gets its frozen reference for free: the same base with the adapters off
  (:func:`adapters_off`), no second copy of the model.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.model.adapter_targets import ADAPTER_TARGETS
from components.core.model.transformer import ModelConfig, Transformer
from components.core.training.host import on_host

log = logging.getLogger(__name__)

PyTree = Any
# Adapters and the reward/value head train; everything else is the frozen base.
TRAINABLE = nnx.Any(nnx.LoRAParam, nnx.PathContains("scalar_head"))
# The path of each adapter target inside a layer of a stack (a leading layer axis).
TARGET_PATHS = {
    "q_proj": ("attn", "wq"),
    "k_proj": ("attn", "wk"),
    "v_proj": ("attn", "wv"),
    "o_proj": ("attn", "wo"),
    "gate_proj": ("mlp", "w_gate"),
    "up_proj": ("mlp", "w_up"),
    "down_proj": ("mlp", "w_down"),
    "in_proj_qkv": ("delta", "w_qkv"),
    "in_proj_z": ("delta", "w_z"),
    "in_proj_b": ("delta", "w_b"),
    "in_proj_a": ("delta", "w_a"),
    "out_proj": ("delta", "w_out"),
    "q_a_proj": ("attn", "wq_a"),  # Mistral 4's latent attention
    "q_b_proj": ("attn", "wq_b"),
    "kv_a_proj_with_mqa": ("attn", "wkv_a"),
    "kv_b_proj": ("attn", "wkv_b"),
}


def with_lora(
    config: ModelConfig, rank: int, alpha: float, targets: tuple[str, ...]
) -> ModelConfig:
    """``config`` carrying adapters of ``rank`` on those of ``targets`` it has (rank 0: none)."""
    present = config.present_targets(tuple(targets)) if rank else ()
    if rank and targets and not present:
        raise ValueError(
            f"lora_targets {list(targets)}: this model has none of them; its projections are "
            f"{list(config.present_targets(ADAPTER_TARGETS))}"
        )
    return dataclasses.replace(config, lora_rank=rank, lora_alpha=alpha, lora_targets=present)


def _abstract_params(model: Transformer, config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """The graph and parameter shapes of ``model``'s kind under ``config`` (not initialised)."""
    head = model.scalar_head is not None
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), scalar_head=head))
    return nnx.split(abstract, nnx.Param)


def merge(model: Transformer) -> Transformer:
    """The same function without adapters: each targeted kernel becomes W + A·B·alpha/rank."""
    config = model.config
    if not config.lora_rank:
        return model
    params = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(params)
    with on_host():
        for target in config.lora_targets:
            module, name = TARGET_PATHS[target]
            for stack in config.target_stacks(target):
                layer = pure[stack][module][name]
                adapter = layer.pop("lora")
                delta = jnp.einsum("lir,lro->lio", adapter["lora_a"], adapter["lora_b"])
                kernel = layer["kernel"]
                layer["kernel"] = (kernel + delta * config.lora_scale).astype(kernel.dtype)
    plain = with_lora(config, 0, config.lora_alpha, ())
    graphdef, template = _abstract_params(model, plain)
    nnx.replace_by_pure_dict(template, pure)
    return nnx.merge(graphdef, template)


def attach(
    model: Transformer, *, rank: int, alpha: float, targets: tuple[str, ...], seed: int
) -> Transformer:
    """``model`` (adapters merged first) with fresh adapters of ``rank`` on ``targets``.

    A is drawn from ``seed``, B is zero: the returned model computes what ``model`` did.
    Rank 0 returns the merged model (full fine-tuning).
    """
    model = merge(model)
    if not rank:
        return model
    config = with_lora(model.config, rank, alpha, targets)
    mlp = {"gate_proj", "up_proj", "down_proj"}
    dropped = sorted(set(targets) & mlp - set(config.lora_targets))
    if dropped and config.n_experts:
        log.warning(
            "LoRA targets %s left out: this mixture-of-experts model's MLPs (its experts and any "
            "shared expert) take no adapters; the adapters go on %s",
            dropped,
            list(config.lora_targets),
        )
    head = model.scalar_head is not None
    with on_host():
        adapted = Transformer(config, rngs=nnx.Rngs(seed), scalar_head=head)
    nnx.update(adapted, nnx.state(model, nnx.Param))
    return adapted


def split(params: nnx.State, config: ModelConfig) -> tuple[nnx.State, nnx.State | None]:
    """(trainable, frozen) parameters: all of them and None without adapters, else
    :func:`freeze`'s split in the compute dtype."""
    if not config.lora_rank:
        return params, None
    return freeze(params, config.compute_dtype)


def freeze(params: nnx.State, dtype: Any) -> tuple[nnx.State, nnx.State]:
    """(adapters and scalar head, the rest cast to ``dtype``): what trains, what is frozen."""
    trainable, frozen = nnx.filter_state(params, TRAINABLE, ...)
    frozen = jax.tree.map(
        lambda leaf: leaf.astype(dtype) if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf,
        frozen,
    )
    return trainable, frozen


def join(trainable: PyTree, frozen: PyTree | None) -> PyTree:
    """The whole parameter state again (``frozen`` None: ``trainable`` is all of it)."""
    return trainable if frozen is None else nnx.merge_state(frozen, trainable)


def adapters_off(params: PyTree) -> PyTree:
    """``params`` with every adapter's B zeroed: the base model's function, at no copy of it."""

    def off(path: tuple, leaf: Any) -> Any:
        names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        return jnp.zeros_like(leaf) if "lora_b" in names else leaf

    return jax.tree_util.tree_map_with_path(off, params)


def adapter_count(params: PyTree) -> int:
    """How many adapter parameters ``params`` holds."""
    trainable = nnx.filter_state(params, nnx.LoRAParam)
    return sum(int(leaf.size) for leaf in jax.tree.leaves(trainable))
