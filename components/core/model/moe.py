"""Mixture-of-experts MLPs (Qwen3 MoE, Qwen3.5 MoE): a softmax router picks
``experts_per_token`` of ``n_experts`` gated MLPs for each token, and Qwen3.5 adds a shared
expert, gated by a sigmoid, beside them.

The math is transformers' ``Qwen3MoeSparseMoeBlock`` / ``Qwen3_5MoeSparseMoeBlock``: router
logits in the compute dtype, a float32 softmax over every expert, the top k of it
(renormalised to sum to 1 with ``norm_topk_prob``, which Qwen3.5 always does), each chosen
expert's SwiGLU output times its weight, summed. Dropless: no token is turned away from a
full expert (no capacity factor), so the result is the checkpoint's whatever the batch.

Compute follows the routing, not the expert count: the token-expert pairs are sorted by
expert and each expert multiplies only its own rows (``jax.lax.ragged_dot``, grouped
matmuls; MaxText's sparse path on TPU is the same op). A dense form that ran every expert on
every token would cost n_experts / experts_per_token times the MLP's FLOPs (16x for
Qwen3-30B-A3B's 128 and 8).

``ragged_dot`` has no batching rule for rows batched against shared experts, which the
evaluation's per-row sampler (``jax.vmap`` over rows, eval_sampling.py) needs; the rows of a
vmapped call are independent, so the rule here folds the batch into the rows (one call, the
same numbers), or maps over it where the expert weights are batched too. ``custom_vmap``
has no reverse-mode derivative of its own, so the gradient is the plain function's
(``custom_vjp``), which never meets a vmap in training.

No load-balancing loss is added: alignment fine-tunes a trained router for few steps at
small rates. Peers differ: TRL's GRPO adds the router's at 0.001 by default
(``router_aux_loss_coef``), OpenRLHF's at 0, and verl's Megatron converters turn it off
("hurts perf in RL"). Rollouts and updates run this same code, so a token is routed alike
in both (up to the update's float order); verl's routing replay (R2/R3) is for rollouts
from another engine.
Adapters (LoRA) wrap no MLP of a MoE layer (config.py's ``target_stacks``). PEFT's
``target_modules`` match ``nn.Linear`` modules and transformers 5 keeps the experts as 3-D
parameters, so ``gate_proj`` etc. adapt no expert there either; they do adapt Qwen3.5 MoE's
shared expert (plain linears), which alignpipe leaves unadapted (a PEFT adapter with them is
refused by name, hf/peft.py).

A gradient through a vmapped call is not supported: the gradient is ``ragged_dot``'s own,
which has no batching rule for it. Training never vmaps the model (pmap and scan); only the
evaluation's sampler does, without a gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from components.core.model.config import ModelConfig
from components.core.model.layers import ACTIVATIONS, INIT_STD, GatedMLP, RMSNorm, dense


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Each row's k experts and their weights: the top k of a float32 softmax of ``logits``
    [N, E], divided by their sum where ``normalize`` (transformers' ``norm_topk_prob``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts


def _grouped(rows, logits, scale, w_gate, w_up, w_down, *, k: int, normalize: bool, activation):
    """The experts' weighted sum for ``rows`` [N, D], each pair's rows sorted by expert;
    each chosen expert's weight times its ``scale`` [E] (Gemma 4's per-expert scale)."""
    n, n_experts = logits.shape
    weights, experts = route(logits, k, normalize)
    weights = weights * scale[experts]
    flat = experts.reshape(-1)  # [N·k], row-major: token t's pairs are t·k … t·k + k - 1
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    x = rows[order // k]
    dtype = rows.dtype
    hidden = activation(jax.lax.ragged_dot(x, w_gate.astype(dtype), sizes))
    hidden = hidden * jax.lax.ragged_dot(x, w_up.astype(dtype), sizes)
    out = jax.lax.ragged_dot(hidden, w_down.astype(dtype), sizes)
    out = out * weights.reshape(-1)[order][:, None].astype(dtype)
    unsorted = out[jnp.argsort(order)]  # back to token order (a gather, not a scatter-add)
    return jnp.sum(unsorted.reshape(n, k, -1), axis=1)


@functools.cache
def _experts_fn(k: int, normalize: bool, activation):
    """``_grouped`` for fixed routing settings, with its vmap rule and plain gradient."""
    plain = functools.partial(_grouped, k=k, normalize=normalize, activation=activation)

    @jax.custom_batching.custom_vmap
    def batched(rows, logits, scale, w_gate, w_up, w_down):
        return plain(rows, logits, scale, w_gate, w_up, w_down)

    @batched.def_vmap
    def _rule(axis_size, in_batched, rows, logits, scale, w_gate, w_up, w_down):
        rows_b, logits_b, *weights_b = in_batched
        if any(weights_b):  # experts batched too (a vmapped ensemble): one member at a time
            every = (rows, logits, scale, w_gate, w_up, w_down)
            args = [
                a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
                for a, b in zip(every, in_batched, strict=True)
            ]
            return jax.lax.map(lambda a: batched(*a), tuple(args)), True
        if not rows_b:
            rows = jnp.broadcast_to(rows, (axis_size, *rows.shape))
        if not logits_b:
            logits = jnp.broadcast_to(logits, (axis_size, *logits.shape))
        out = batched(
            rows.reshape(-1, rows.shape[-1]), logits.reshape(-1, logits.shape[-1]),
            scale, w_gate, w_up, w_down,
        )  # fmt: skip
        return out.reshape(*rows.shape[:-1], out.shape[-1]), True

    @jax.custom_vjp
    def experts(rows, logits, scale, w_gate, w_up, w_down):
        return batched(rows, logits, scale, w_gate, w_up, w_down)

    def forward(*args):
        return jax.vjp(plain, *args)  # the residual is the vjp closure, a pytree

    def backward(vjp, grad):
        return vjp(grad)

    experts.defvjp(forward, backward)
    return experts


class MoE(nnx.Module):
    """A mixture-of-experts MLP over ``x`` [..., dim]: ``router`` (HF ``mlp.gate``), the
    experts' stacked ``w_gate``/``w_up`` [E, dim, F] and ``w_down`` [E, F, dim], and, with
    ``shared_expert_dim``, a shared gated MLP times sigmoid(``shared_gate``(x)) (Qwen's) or
    as it is (Mistral 4's); the chosen experts' weights times ``routed_scaling``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dim, width, count = config.dim, config.expert_dim, config.n_experts
        init = nnx.initializers.normal(INIT_STD)
        self.router = dense(dim, count, config, rngs, target="router")
        self.w_gate = nnx.Param(init(rngs.params(), (count, dim, width), jnp.float32))
        self.w_up = nnx.Param(init(rngs.params(), (count, dim, width), jnp.float32))
        self.w_down = nnx.Param(init(rngs.params(), (count, width, dim), jnp.float32))
        shared = config.shared_expert_dim
        self.shared = GatedMLP(config, rngs=rngs, hidden_dim=shared) if shared else None
        gated = shared and config.shared_expert_gated  # Mistral 4's shared expert: no gate
        self.shared_gate = dense(dim, 1, config, rngs, target="shared_gate") if gated else None
        self.scaling = config.routed_scaling
        self.dtype = config.compute_dtype
        self.experts = _experts_fn(
            config.experts_per_token, config.norm_topk_prob, ACTIVATIONS[config.mlp_activation]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        rows = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        scale = jnp.full(self.w_gate.shape[0], self.scaling, rows.dtype)
        out = self.routed(rows, self.router(rows), scale)
        if self.shared_gate is not None:
            gate = jax.nn.sigmoid(self.shared_gate(rows).astype(jnp.float32)).astype(out.dtype)
            out = out + gate * self.shared(rows)
        elif self.shared is not None:
            out = out + self.shared(rows)
        return out.reshape(*x.shape[:-1], -1)

    def routed(self, rows: jax.Array, logits: jax.Array, scale: jax.Array) -> jax.Array:
        """The routed experts' sum for ``rows`` [N, D] given the router's ``logits`` [N, E]."""
        weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
        return self.experts(rows, logits, scale.astype(rows.dtype), *weights)


class BesideExperts(nnx.Module):
    """Gemma 4's experts (26B-A4B), which run beside the layer's dense MLP: routed on the
    residual stream ``x`` (RMS-normed without a scale, times ``router_scale`` and dim^-1/2,
    through ``router``; the top k renormalised, each times its ``expert_scale``), fed
    ``pre_norm(x)``, and added as ``post_norm(experts) + post_mlp_norm(mlp_out)``, as
    transformers' ``Gemma4TextDecoderLayer`` with ``enable_moe_block``. The layer's own
    ``post_mlp_norm`` then norms the sum (layers.py)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dim, count = config.dim, config.n_experts
        self.moe = MoE(config, rngs=rngs)  # its router is the projection here
        self.router_norm = RMSNorm(dim, config, scaled=False)
        self.router_scale = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.expert_scale = nnx.Param(jnp.ones((count,), jnp.float32))
        self.pre_norm = RMSNorm(dim, config)
        self.post_norm = RMSNorm(dim, config)
        self.post_mlp_norm = RMSNorm(dim, config)

    def __call__(self, x: jax.Array, mlp_out: jax.Array) -> jax.Array:
        rows = x.reshape(-1, x.shape[-1])
        routed = self.router_norm(rows).astype(jnp.float32) * self.router_scale[...]
        routed = (routed * rows.shape[-1] ** -0.5).astype(self.moe.dtype)
        out = self.moe.routed(
            self.pre_norm(rows).astype(self.moe.dtype), self.moe.router(routed),
            self.expert_scale[...],
        )  # fmt: skip
        return self.post_mlp_norm(mlp_out) + self.post_norm(out.reshape(x.shape))
