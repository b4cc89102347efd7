"""Gated DeltaNet prefill against transformers' torch implementation, side by side in one run,
and the decode state's bytes against a full-attention layer's keys and values.

Two comparisons at 2,048 and 8,192 tokens (one sequence, float32, this machine's cores):

* the rule alone: ``components/core/model/delta.py``'s ``chunked_delta_rule`` (jit) against
  transformers' ``torch_chunk_gated_delta_rule`` (its reference when flash-linear-attention
  is absent, as on a CPU), at Qwen3.5-9B's head shapes: 16 key heads and 32 value heads of
  128, chunks of 64;
* the whole mixer: alignpipe's ``GatedDeltaNet`` (projections, causal conv, the rule, the
  gated norm, the output projection) against ``Qwen3_5GatedDeltaNet`` with the same weights,
  at ``--hidden`` (1,024 by default: a Qwen3.5-0.8B-wide layer) and the 9B's heads.

Both sides time the same call round-robin (``_timing.interleaved_median_seconds``); torch
uses as many threads as JAX's CPU client (every core). The outputs are compared too.

The state table prints, per layer and sequence at Qwen3.5-9B's shapes in bf16, a DeltaNet
layer's decoding state (``memory.delta_state_bytes``: constant in the length) beside one
full-attention layer's KV cache at 2k, 8k and 32k tokens.

    python benchmarks/bench_deltanet.py [--lengths 2048,8192] [--hidden 1024] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os

import jax

jax.config.update("jax_num_cpu_devices", 1)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from _timing import interleaved_median_seconds, mib  # noqa: E402
from flax import nnx  # noqa: E402
from transformers import Qwen3_5TextConfig  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as theirs  # noqa: E402

from components.core.model import delta  # noqa: E402
from components.core.model.config import ModelConfig  # noqa: E402
from pipelines.dag import memory  # noqa: E402

KEY_HEADS, VALUE_HEADS, HEAD_DIM, CHUNK = 16, 32, 128, 64  # Qwen3.5-9B's DeltaNet heads


def rule_inputs(length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    q, k = (rng.normal(size=(1, length, KEY_HEADS, HEAD_DIM)).astype(np.float32) for _ in "qk")
    v = rng.normal(size=(1, length, VALUE_HEADS, HEAD_DIM)).astype(np.float32)
    g = (-np.abs(rng.normal(size=(1, length, VALUE_HEADS))) * 0.1).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(1, length, VALUE_HEADS))))).astype(np.float32)
    return [q, k, v, g, beta]


@jax.jit
def our_rule(q, k, v, g, beta):
    group = VALUE_HEADS // KEY_HEADS
    q = delta._l2norm(jnp.repeat(q, group, axis=2)) * HEAD_DIM**-0.5
    k = delta._l2norm(jnp.repeat(k, group, axis=2))
    state = jnp.zeros((q.shape[0], VALUE_HEADS, HEAD_DIM, HEAD_DIM), jnp.float32)
    return delta.chunked_delta_rule(q, k, v, g, beta, state, CHUNK)[0]


def their_rule(q, k, v, g, beta):
    with torch.no_grad():
        return theirs.torch_chunk_gated_delta_rule(
            q, k, v, g, beta, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True
        )[0]


def mixers(hidden: int) -> tuple[delta.GatedDeltaNet, torch.nn.Module]:
    """Ours and transformers' mixer at ``hidden`` with the 9B's heads, the same weights."""
    config = ModelConfig(
        vocab_size=8, dim=hidden, n_layers=1, n_heads=8, n_kv_heads=2, hidden_dim=8,
        max_seq_len=16384, norm_eps=1e-6, delta_key_heads=KEY_HEADS, delta_value_heads=VALUE_HEADS,
        delta_key_dim=HEAD_DIM, delta_value_dim=HEAD_DIM, delta_chunk=CHUNK,
    )  # fmt: skip
    ours = delta.GatedDeltaNet(config, rngs=nnx.Rngs(0))
    text = Qwen3_5TextConfig(
        hidden_size=hidden, linear_num_key_heads=KEY_HEADS, linear_num_value_heads=VALUE_HEADS,
        linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM, num_hidden_layers=1,
        layer_types=["linear_attention"],
    )  # fmt: skip
    module = theirs.Qwen3_5GatedDeltaNet(text, layer_idx=0).eval()
    kernels = {
        "in_proj_qkv": ours.w_qkv, "in_proj_z": ours.w_z, "in_proj_b": ours.w_b,
        "in_proj_a": ours.w_a, "out_proj": ours.w_out,
    }  # fmt: skip
    with torch.no_grad():
        for name, linear in kernels.items():
            getattr(module, name).weight.copy_(torch.tensor(np.asarray(linear.kernel[...]).T))
        module.conv1d.weight.copy_(torch.tensor(np.asarray(ours.conv[...])))
        module.dt_bias.copy_(torch.tensor(np.asarray(ours.dt_bias[...])))
        module.A_log.copy_(torch.tensor(np.asarray(ours.a_log[...])))
        module.norm.weight.copy_(torch.tensor(np.asarray(ours.norm[...])))
    return ours, module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    print(f"{os.cpu_count()} cores, jax {jax.__version__}, torch {torch.__version__}, float32")
    ours_mixer, their_mixer = mixers(args.hidden)
    graphdef, params = nnx.split(ours_mixer)

    @jax.jit
    def our_layer(params, x):
        return nnx.merge(graphdef, params)(x, jnp.ones(x.shape[:2], jnp.int32))[0]

    def their_layer(x):
        with torch.no_grad():
            return their_mixer(x)

    print(f"{'what':<32}{'tokens':>8}{'alignpipe tok/s':>17}{'torch tok/s':>13}"
          f"{'ratio':>8}{'max |diff|':>12}")  # fmt: skip
    for length in (int(n) for n in args.lengths.split(",")):
        inputs = rule_inputs(length)
        jax_inputs = [jnp.asarray(x) for x in inputs]
        torch_inputs = [torch.tensor(x) for x in inputs]
        x = np.random.default_rng(1).normal(size=(1, length, args.hidden)).astype(np.float32)
        jax_x, torch_x = jnp.asarray(x), torch.tensor(x)
        cases = {
            f"rule (9B heads {KEY_HEADS}/{VALUE_HEADS}x{HEAD_DIM})": (
                lambda a=jax_inputs: our_rule(*a),
                lambda a=torch_inputs: their_rule(*a),
            ),
            f"mixer (hidden {args.hidden})": (
                lambda a=jax_x: our_layer(params, a),
                lambda a=torch_x: their_layer(a),
            ),
        }
        for name, (ours, theirs_fn) in cases.items():
            times = interleaved_median_seconds(
                {"ours": ours, "theirs": theirs_fn}, warmup=1, repeats=args.repeats
            )
            diff = float(np.abs(np.asarray(ours()) - theirs_fn().numpy()).max())
            rate = {k: length / v for k, v in times.items()}
            print(f"{name:<32}{length:>8}{rate['ours']:>17,.0f}{rate['theirs']:>13,.0f}"
                  f"{rate['ours'] / rate['theirs']:>7.2f}x{diff:>12.1e}")  # fmt: skip
    nine_b = ModelConfig(
        vocab_size=248320, dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, head_dim=256,
        hidden_dim=12288, max_seq_len=262144, dtype="bfloat16", delta_key_heads=KEY_HEADS,
        delta_value_heads=VALUE_HEADS, delta_key_dim=HEAD_DIM, delta_value_dim=HEAD_DIM,
    )  # fmt: skip
    state = memory.delta_state_bytes(nine_b)
    kv_per_token = 2 * nine_b.n_kv_heads * nine_b.resolved_head_dim * 2
    print("\ndecode state per layer and sequence, Qwen3.5-9B shapes, bf16:")
    print(f"{'tokens':>8}{'DeltaNet state':>16}{'attention KV':>15}{'ratio':>8}")
    for length in (2048, 8192, 32768):
        kv = kv_per_token * length
        print(f"{length:>8}{mib(state):>16}{mib(kv):>15}{kv / state:>7.1f}x")


if __name__ == "__main__":
    main()
