"""Mixture-of-experts layers (components/core/model/moe.py): Mixtral, Qwen2 MoE, Qwen3 MoE,
Qwen3.5 MoE, Qwen3-Next, Qwen3-VL MoE and Gemma 4 26B-A4B.

The routed experts against every expert run densely (forward and gradient), a vmapped call
(the evaluation's per-row sampler) against the rows alone, eight devices against one,
Gemma 4's experts beside the MLP, adapters on the attention only, unrenormalised routing
against transformers. Their checkpoints (layouts, exports, configs, the planner's counts):
test_moe_checkpoints.py; their logits against transformers': test_hf_import.py; a whole
run: test_hf_pipeline.py.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from components.core.model.artifact import load_model
from components.core.model.config import ModelConfig
from components.core.model.lora import attach, with_lora
from components.core.model.moe import BesideExperts, MoE, route
from components.core.model.transformer import Transformer
from components.core.training.parallel import replicate
from components.hf.importer import import_hf

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
MOE = ModelConfig(
    vocab_size=64, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=32, max_seq_len=32,
    qk_norm=True, n_experts=6, experts_per_token=2, expert_dim=12,
)  # fmt: skip


def _dense_reference(layer: MoE, config: ModelConfig, x: jax.Array) -> jax.Array:
    """Every expert on every row, weighted by the router's top k (zero elsewhere)."""
    rows = x.reshape(-1, x.shape[-1])
    weights, experts = route(layer.router(rows), config.experts_per_token, config.norm_topk_prob)
    combine = jnp.zeros((rows.shape[0], config.n_experts)).at[
        jnp.arange(rows.shape[0])[:, None], experts
    ].set(weights)  # fmt: skip
    gate = jnp.einsum("nd,edf->nef", rows, layer.w_gate[...])
    up = jnp.einsum("nd,edf->nef", rows, layer.w_up[...])
    out = jnp.einsum("nef,efd->ned", jax.nn.silu(gate) * up, layer.w_down[...])
    out = jnp.einsum("ned,ne->nd", out, combine)
    if layer.shared is not None:
        out = out + jax.nn.sigmoid(layer.shared_gate(rows)) * layer.shared(rows)
    return out.reshape(x.shape)


@pytest.mark.parametrize(
    "changes", [{}, {"norm_topk_prob": False}, {"shared_expert_dim": 20, "experts_per_token": 3}]
)
def test_routed_experts_equal_every_expert_run_densely(changes):
    config = dataclasses.replace(MOE, **changes)
    layer = MoE(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 7, config.dim))
    np.testing.assert_allclose(layer(x), _dense_reference(layer, config, x), atol=1e-6)

    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x, dense):
        merged = nnx.merge(graphdef, params, rest)
        out = _dense_reference(merged, config, x) if dense else merged(x)
        return jnp.sum(jnp.sin(out))

    # Compiled (eager, each op of the routed call compiled alone took twice as long).
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    ours, dense = grad(params, x, False), grad(params, x, True)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(dense), strict=True):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(a, b, atol=2e-6)


def test_a_vmapped_call_computes_each_row_as_alone():
    """The evaluation samples each row under jax.vmap (eval_sampling.py): the rows fold into
    one routed call; with the experts batched too (an ensemble), a member at a time."""
    layer = MoE(dataclasses.replace(MOE, shared_expert_dim=8), rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (4, 5, MOE.dim))
    alone = jnp.stack([layer(row) for row in x])
    np.testing.assert_allclose(jax.vmap(layer)(x), alone, atol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.vmap(layer)))(x[:, :, None]), alone[:, :, None],
                               atol=1e-6)  # fmt: skip
    members = jnp.stack([layer.w_down[...], 2 * layer.w_down[...]])
    rows = x[0]
    logits = layer.router(rows)

    def member(w_down):
        scale = jnp.ones(MOE.n_experts)
        return layer.experts(rows, logits, scale, layer.w_gate[...], layer.w_up[...], w_down)

    np.testing.assert_allclose(jax.vmap(member)(members)[1], 2 * member(members[0]), atol=1e-5)


def test_gemma4_experts_beside_the_mlp_learn_their_router_and_scales():
    """26B-A4B's layer (moe.BesideExperts): every parameter gets a gradient, the router's
    scale and the per-expert scales included, and a vmapped call computes each row alone."""
    config = dataclasses.replace(MOE, mlp_activation="gelu_tanh", experts_beside_mlp=True)
    layer = BesideExperts(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(4), (3, 5, MOE.dim))
    mlp_out = jax.random.normal(jax.random.key(5), x.shape)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, params, rest)(x, mlp_out)))

    grads = nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))
    for name in ("router_scale", "expert_scale"):
        assert float(jnp.abs(grads[name]).max()) > 0, name
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))
    alone = jnp.stack([layer(row, out) for row, out in zip(x, mlp_out, strict=True)])
    np.testing.assert_allclose(jax.vmap(layer)(x, mlp_out), alone, atol=1e-6)


def test_eight_devices_compute_what_one_does():
    model = Transformer(MOE, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(3), (8, 2, 12), 0, MOE.vocab_size)

    def loss(params, tokens):
        model = nnx.merge(graphdef, params)
        return jnp.mean(model.token_logprobs(tokens, jnp.ones_like(tokens)))

    def step(params, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        return jax.lax.pmean(value, "data"), jax.lax.pmean(grads, "data")

    replicated = replicate(params, jax.devices()[:8])
    value, grads = jax.pmap(step, axis_name="data")(replicated, tokens)
    one_value, one_grads = jax.jit(jax.value_and_grad(loss))(params, tokens.reshape(16, 12))
    np.testing.assert_allclose(value[0], one_value, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(one_grads), strict=True):
        np.testing.assert_allclose(a[0], b, atol=1e-6)


def test_adapters_go_on_the_attention_only(caplog):
    """PEFT targets nn.Linear modules and transformers 5 keeps experts as 3-D parameters, so
    gate_proj etc. adapt no routed expert there either (they would adapt a Qwen MoE's shared
    expert, a plain MLP, which alignpipe leaves unadapted): all-linear is the attention."""
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert with_lora(MOE, 4, 8.0, every).lora_targets == every[:4]
    with pytest.raises(ValueError, match="mixture-of-experts model's MLPs take no adapters"):
        dataclasses.replace(MOE, lora_rank=4, lora_targets=("q_proj", "up_proj"))
    with caplog.at_level("WARNING"):
        adapted = attach(
            Transformer(MOE, rngs=nnx.Rngs(0)), rank=4, alpha=8.0, targets=every, seed=0
        )
    assert adapted.config.lora_targets == every[:4]
    assert "['down_proj', 'gate_proj', 'up_proj'] left out" in caplog.text  # said, not silent


def test_unrenormalised_routing_matches_transformers(tmp_path):
    """norm_topk_prob false (Qwen3MoeConfig's default): the top k keep their softmax weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "raw"
    shutil.copytree(FIXTURES / "qwen3_moe", folder)
    hf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**hf, "norm_topk_prob": False}))
    model, _ = load_model(import_hf(str(folder), str(tmp_path / "m"))["out"], dtype="float32")
    assert not model.config.norm_topk_prob
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 64))
    ids = jnp.asarray(tokens, jnp.int32)
    ours = np.asarray(model.lm_logits(model(ids, jnp.ones_like(ids))))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = theirs.eval()(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, expected, atol=1e-4)
    renormalised, _ = load_model(import_hf(str(FIXTURES / "qwen3_moe"), str(tmp_path / "n"))["out"])
    other = np.asarray(renormalised.lm_logits(renormalised(ids, jnp.ones_like(ids))))
    assert np.abs(other - expected).max() > 1e-2  # the setting matters at these weights


def test_gemma4_experts_without_renormalisation_are_refused():
    """Gemma 4's router always renormalises its top k: an exported config could not say
    otherwise."""
    with pytest.raises(ValueError, match="norm_topk_prob off"):
        dataclasses.replace(MOE, experts_beside_mlp=True, norm_topk_prob=False)
