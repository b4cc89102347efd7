"""The benchmarks' model-FLOPs accounting (benchmarks/_roofline.py) against XLA's own count.

XLA's cost analysis counts a scanned loop body once, whatever its trip count, so the
models here have one layer; it also counts elementwise work (norms, softmax, rotary),
which the model-FLOPs convention leaves out: the two agree within a few percent.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from components.core.model.transformer import Transformer, model_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _roofline  # noqa: E402

ROWS, LENGTH = 2, 32


@pytest.fixture(scope="module")
def one_layer():
    config = model_config(
        "tiny", 128, n_layers=1, dim=64, hidden_dim=256, n_heads=4, n_kv_heads=2, remat="none"
    )
    # Shapes only: lowering for the cost analysis needs no values.
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    return config, graphdef, params


def xla_flops(fn, *args) -> float:
    return jax.jit(fn).lower(*args).cost_analysis()["flops"]


def test_forward_and_training_flops_match_xla(one_layer):
    config, graphdef, params = one_layer
    tokens = jnp.ones((ROWS, LENGTH), jnp.int32)

    def forward(params):
        model = nnx.merge(graphdef, params)
        return model.lm_logits(model(tokens, tokens)).sum()

    def loss(params):  # next-token logits at LENGTH - 1 positions, as the sft loss
        return nnx.merge(graphdef, params).token_logprobs(tokens, tokens).sum()

    counted = _roofline.forward_flops(config, ROWS, LENGTH, logits_per_row=LENGTH)
    assert xla_flops(forward, params) == pytest.approx(counted, rel=0.05)
    counted = _roofline.train_flops(config, ROWS, LENGTH, logits_per_row=LENGTH - 1)
    assert xla_flops(jax.grad(loss), params) == pytest.approx(counted, rel=0.05)


def test_decode_step_flops_and_bytes_match_the_cache(one_layer):
    config, graphdef, params = one_layer
    tokens = jnp.ones((ROWS, 8), jnp.int32)
    slots = 24

    def decode(params):
        model = nnx.merge(graphdef, params)
        _, cache = model.prefill(tokens, tokens, slots)
        return model.lm_logits(model.decode(tokens[:, -1], cache)[0]), cache

    def prefill(params):
        return nnx.merge(graphdef, params).prefill(tokens, tokens, slots)

    step = xla_flops(decode, params) - xla_flops(prefill, params)
    assert step == pytest.approx(_roofline.decode_step_flops(config, ROWS, slots), rel=0.05)
    cache = jax.eval_shape(decode, params)[1]
    cache_bytes = _roofline.tree_bytes((cache.k, cache.v))
    assert cache_bytes == 2 * sum(k.size for k in cache.k) * 4  # float32 compute here
    assert _roofline.kv_cache_bytes(config, ROWS, slots) == cache_bytes
    param_bytes = _roofline.tree_bytes(params)
    assert param_bytes == 4 * sum(x.size for x in jax.tree.leaves(params))
    assert _roofline.decode_step_bytes(config, param_bytes, ROWS, slots) == (
        param_bytes + cache_bytes
    )


def test_generate_flops_counts_prefill_and_steps(one_layer):
    config = one_layer[0]
    prefill = _roofline.forward_flops(config, ROWS, 8, logits_per_row=1)
    step = _roofline.decode_step_flops(config, ROWS, 8 + 16 - 1)
    assert _roofline.generate_flops(config, ROWS, 8, 16, 15) == prefill + 15 * step
    assert _roofline.generate_flops(config, ROWS, 8, 16, 3) == prefill + 3 * step


def test_fraction_of_peak_is_printed_against_the_named_dtype():
    peak = _roofline.Peak({"float32": 100e9, "bfloat16": 400e9}, 10e9, "cpu, 2 cores", 1.0, 0.5)
    assert "50.0% of float32 peak" in _roofline.of_peak(100e9, 2.0, peak)
    assert "12.5% of bfloat16 peak" in _roofline.of_peak(100e9, 2.0, peak, "bfloat16")
    line = _roofline.describe(peak)
    assert "float32 100.0 GFLOP/s" in line and "10.0 GB/s" in line


def test_shape_ceiling_counts_the_training_steps_weight_matmuls(one_layer):
    config = one_layer[0]
    shapes = _roofline.with_backward(_roofline.weight_matmuls(config, ROWS * LENGTH, ROWS * 8))
    assert len(shapes) == 3 * (7 * config.n_layers + 1)
    weights = sum(2 * m * k * n for m, k, n in shapes)
    attention = 3 * _roofline.attention_flops(config, ROWS * LENGTH, LENGTH)
    assert weights == _roofline.train_flops(config, ROWS, LENGTH, 8) - attention


def test_thunk_kinds_sort_xla_cpu_trace_names():
    from _timing import thunk_kind

    assert thunk_kind("ynn_fusion.14") == thunk_kind("dot.130") == "matmuls"
    assert thunk_kind("copy_bitcast_fusion.7") == "copies and transposes"
    assert thunk_kind("psum.31") == "collectives"
    assert thunk_kind("add_select_fusion.67") == "elementwise and other fusions"
    # The loop holds its body's thunks; Python frames, executors and waits are no thunks.
    for name in ("while.287", "ThunkExecutor::Execute", "$api.py:2479 block_until_ready"):
        assert thunk_kind(name) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_one_core_bandwidth_streams_in_a_pinned_child():
    core = min(os.sched_getaffinity(0))
    rate = _roofline.one_core_bandwidth(core)
    assert 1e8 < rate < 1e13  # bytes/s: a real stream, neither zero nor absurd
    # The child pins itself before JAX starts; a core the host lacks fails it, loudly.
    with pytest.raises(RuntimeError, match="one-core bandwidth child failed"):
        _roofline.one_core_bandwidth(10**6)
