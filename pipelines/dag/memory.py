"""The per-chip memory of a stage on a TPU slice: the arithmetic the run presets are sized by.

A stage holds its models on every chip either replicated (``fsdp`` off: each chip
has everything) or in chunks (``fsdp`` on, ``components/core/training/fsdp.py``: each of
the C chips holds 1/C and gathers a tensor where it is used). Per chip, for a
model of N parameters, float32 parameters and AdamW's two float32 moments:

    trained model   20 N bytes: params 4 + grads 4 + Adam moments 8 + update temporaries 4
    frozen model     4 N bytes
    sft, reward     one trained model                                   20 N   (/ C with fsdp)
    ppo             policy + critic trained, reference + reward frozen  48 N   (/ C with fsdp)
    evaluate        policy, reference, reward model frozen              12 N   (/ C with fsdp)

With LoRA (``lora_rank`` r > 0) only adapters train: A [in, r] and B [r, out] on each
targeted projection of each layer, A = L·r·Σ(in + out) parameters per network, at the
same 20 bytes each; the frozen base is stored in the compute dtype (c = 2 bytes in bf16):

    sft, reward     one frozen base, its adapters (and the reward head)   c N + 20 A
    ppo             the policy's base (adapters off: the reference) and the reward
                    model's (the critic's adapters sit on it); two adapter sets
                                                                      2 c N + 40 A
    evaluate        unchanged: it loads merged models                   12 N

With fsdp a chip also holds what is gathered at the time (``gathered_bytes``):
the tensors outside the layer stack (embeddings, output head) of the network
running, and during training their full gradient before the reduce-scatter;
and a few layers of the stack (the layer running, its gradient, the next one
prefetched), all float32; with LoRA the base's tensors in the compute dtype, without
gradients.

Activations (``forward_bytes``, ``backward_bytes``): with ``remat="full"`` the scan keeps
each layer's input (L·B·T·D in the compute dtype) and recomputes one layer at a time in the
backward pass; its attention scores cost B·H·T²·(4 + c) bytes forward and 4 more with their
gradient. The LM logits never live whole: a few [tile, V] fp32 blocks of
``ModelConfig.logits_tile`` elements (64 MiB) at a time (``logits_bytes``). The sampler holds
one position's logits a step; the rollout adds the KV cache. Besides these, a program holds
copies of the embedding (its gradients, its casts to bf16: ``EMBEDDING_GRADIENTS``,
``EMBEDDING_CASTS``), which at 128k-256k vocabularies are the largest tensors after the state.

A mixture-of-experts layer (core/model/moe.py) holds its experts' rows as a grouped matmul
holds them: each token's chosen experts' hidden activations and its copies (``mlp_width``),
not a row for every expert. That is the TPU's form, where XLA runs ``ragged_dot`` as one;
XLA:CPU expands each ragged dot densely over the experts (about 20 bytes per expert, token
pair and hidden unit in a train step, measured 2026-12-07), so its figures for a mixture
are not the TPU's and the mixture's activations are not calibrated against them. Its
parameters are counted exactly (tests/test_moe.py).

How these add up per algorithm and phase, and what stays resident beside each program:
``phases.py``. The constants were read off XLA's compiled programs (``compiled.py``);
tests/test_memory_calibration*.py hold the sum within 15% of XLA's figure.
"""

from __future__ import annotations

from components.core.model import layer_kinds
from components.core.model.config import ModelConfig
from components.core.model.vocab_tiles import positions_per_tile

GiB = 2**30
# Physical HBM per chip (Google's TPU pages: v5e 16 GiB, v6e 32 GiB, v5p 95 GiB); a run may
# use HEADROOM of it, the rest left for XLA's own buffers, fragmentation and the estimate's
# error (within 15% of XLA's compiled figure at the calibration shapes,
# tests/test_memory_calibration.py).
CHIP_HBM = {"v5e": 16 * GiB, "v6e": 32 * GiB, "v5p": 95 * GiB}
HEADROOM = 0.90
TRAINED_BYTES_PER_PARAM = 20  # fp32 params, grads, two Adam moments, update temporaries
FROZEN_BYTES_PER_PARAM = 4
PARAM_BYTES = 4  # gathered tensors and their gradients are float32
LAYERS_GATHERED = 3  # the running layer, its gradient, the next one prefetched
# Logits tiles live at once, as XLA keeps them (benchmarks/bench_vocab_tiles.py, vocab 151,936,
# 64 MiB tiles): a forward pass 1 (its log-softmax reuses it); a loss's gradient 3 (the tile,
# its recomputation, its gradient: 196 MiB); PPO's scoring 4 (the policy's and the
# reference's tiles and their log-softmaxes for the exact KL: 270 MiB).
INFERENCE_TILES, TRAIN_TILES, SCORING_TILES = 1, 3, 4
# Copies of the embedding [V, D] a program holds besides its parameters (XLA's compiled
# programs, the same source): fp32 gradients in the backward pass (the scatter-add of the
# lookup's gradient, its accumulation, the cross-device mean), 3 in the sft,
# reward and dpo train step and 1 in RL's update; and with a bf16 compute dtype, the weights
# cast to it: 1 in a forward pass, 4 in the RL rollout (each network's sampling and scoring
# casts) and in RL's update (the cast and its gradient, policy and critic).
EMBEDDING_GRADIENTS = {"train": 3, "update": 1}
EMBEDDING_CASTS = {"train": 0, "forward": 1, "rollout": 4, "update": 4}
# Networks each stage holds with full fine-tuning: (trained, frozen).
FULL_MODELS = {
    "sft": (1, 0), "reward": (1, 0), "ppo": (2, 2), "grpo": (1, 2), "rloo": (1, 2),
    "dpo": (1, 1), "evaluate": (0, 3),
}  # fmt: skip
# Frozen bases each stage holds with LoRA. PPO: the policy's (its reference is the same base
# with the adapters off) and the reward model's (the critic's adapters sit on it).
LORA_BASES = {"sft": 1, "reward": 1, "ppo": 2, "grpo": 2, "rloo": 2, "dpo": 1}


def param_count(config: ModelConfig) -> int:
    """Parameters of the model (without a scalar head)."""
    counts = layer_kinds.stack_counts(config)
    layers = sum(
        count * (delta_layer_param_count(config) if stack == "linear_blocks" else
                 kind_param_count(config, stack))
        for stack, count in counts.items()
    )  # fmt: skip
    return layers + outer_param_count(config)


def kind_param_count(config: ModelConfig, stack: str) -> int:
    """Parameters of one attention layer of ``stack`` (layer_kinds.py): Gemma 4's full
    layers are wider, its shared layers have no key or value projections."""
    kind = layer_kinds.stack_kind(config, stack)
    d, hd = config.dim, kind.head_dim
    if config.kv_lora_rank:  # Mistral 4
        return latent_param_count(config) + mlp_param_count(config, kind.hidden_dim) + 2 * d
    queries = config.n_heads * (3 if config.attn_output_gate else 2)  # q (and its gate), o
    kv_projections = (1 if kind.k_eq_v else 2) * kind.n_kv_heads if kind.owns_kv else 0
    attn = d * hd * (queries + kv_projections)
    if config.qkv_bias:
        attn += hd * (config.n_heads + kv_projections)
    norms = (4 if config.post_norms else 2) * d
    norms += hd * ((2 if kind.owns_kv else 1) if config.qk_norm else 0)
    per_layer = 2 * d * config.per_layer_dim + d if config.per_layer_dim else 0
    mlp = mlp_param_count(config, kind.hidden_dim)
    return attn + mlp + norms + per_layer + int(config.layer_scalar)


def latent_param_count(config: ModelConfig) -> int:
    """Latent attention's parameters (core/model/latent_attention.py): each projection of
    :func:`projection_shapes` and the two latents' norms."""
    shapes = projection_shapes(config)
    norms = config.kv_lora_rank + config.q_lora_rank
    return sum(shapes[t][0] * shapes[t][1] for t in config.latent_projections()) + norms


def mlp_param_count(config: ModelConfig, hidden_dim: int) -> int:
    """Parameters of a layer's MLP: the gated MLP's three projections, or a mixture's router,
    every expert's three and the shared expert with its gate (core/model/moe.py), or Gemma
    4's gated MLP with experts beside it."""
    d = config.dim
    if not config.n_experts:
        return 3 * d * hidden_dim
    experts = d * config.n_experts * (1 + 3 * config.expert_dim)
    if config.experts_beside_mlp:  # Gemma 4: the MLP, its router's scales and 3 more norms
        return 3 * d * hidden_dim + experts + config.n_experts + 4 * d
    gate = d if config.shared_expert_gated else 0  # Qwen's sigmoid gate; Mistral 4's has none
    shared = 3 * d * config.shared_expert_dim + gate if config.shared_expert_dim else 0
    return experts + shared


def layer_param_count(config: ModelConfig) -> int:
    """Parameters of one attention layer of the stack: the largest kind's (Gemma 4)."""
    stacks = [s for s in layer_kinds.stack_counts(config) if s != "linear_blocks"]
    return max(kind_param_count(config, s) for s in stacks or ["blocks"])


def delta_layer_param_count(config: ModelConfig) -> int:
    """Parameters of one Gated DeltaNet layer (hybrid stacks): its projections, conv, decay
    and norm, and the MLP and norms every layer has."""
    d, heads = config.dim, config.delta_value_heads
    values = heads * config.delta_value_dim
    channels = 2 * config.delta_key_heads * config.delta_key_dim + values
    mixer = d * (channels + values + 2 * heads) + values * d
    mixer += channels * config.delta_conv_kernel + 2 * heads + config.delta_value_dim
    return mixer + mlp_param_count(config, config.hidden_dim) + 2 * d


def outer_param_count(config: ModelConfig) -> int:
    """Parameters outside the layer stack: embeddings, untied output head, final norm, and
    Gemma 4's per-layer input table [V, L·P], its projection [D, L·P] and norm [P]."""
    outer = config.vocab_size * config.dim * (1 if config.tie_embeddings else 2) + config.dim
    if config.per_layer_dim:
        width = config.n_layers * config.per_layer_dim
        outer += (config.per_layer_vocab + config.dim) * width + config.per_layer_dim
    return outer


def projection_shapes(config: ModelConfig, stack: str = "blocks") -> dict[str, tuple[int, int]]:
    """(in, out) of each projection of a layer an adapter can wrap, by Hugging Face name."""
    kind = layer_kinds.stack_kind(config, stack)
    d, hidden = config.dim, kind.hidden_dim
    q, kv = config.n_heads * kind.head_dim, kind.n_kv_heads * kind.head_dim
    keys = config.delta_key_heads * config.delta_key_dim
    values = config.delta_value_heads * config.delta_value_dim
    gate = 2 if config.attn_output_gate else 1  # Qwen3.5's q_proj emits a gate per query
    latent, rope = config.kv_lora_rank, config.rotary_dim
    return {
        # Mistral 4's latent attention: queries and keys/values through latents
        "q_a_proj": (d, config.q_lora_rank),
        "q_b_proj": (config.q_lora_rank, q),
        "kv_a_proj_with_mqa": (d, latent + rope),
        "kv_b_proj": (latent, config.n_heads * (2 * kind.head_dim - rope)),
        "q_proj": (d, gate * q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, hidden),
        "up_proj": (d, hidden),
        "down_proj": (hidden, d),
        # Qwen3.5's Gated DeltaNet layers
        "in_proj_qkv": (d, 2 * keys + values),
        "in_proj_z": (d, values),
        "in_proj_b": (d, config.delta_value_heads),
        "in_proj_a": (d, config.delta_value_heads),
        "out_proj": (values, d),
    }


def adapter_param_count(config: ModelConfig, rank: int, targets: tuple[str, ...]) -> int:
    """LoRA parameters of one network: A [in, r] and B [r, out] on each target of each layer
    that has it (hybrid stacks: DeltaNet projections on their layers only)."""
    count = layer_kinds.stack_counts(config)
    return rank * sum(
        sum(projection_shapes(config, stack)[target]) * count[stack]
        for target in config.present_targets(targets)
        for stack in config.target_stacks(target)
    )


def compute_bytes(config: ModelConfig) -> int:
    """Bytes of one value in the compute dtype (activations; LoRA's frozen base)."""
    return 2 if config.dtype == "bfloat16" else 4


def attention_bytes(config: ModelConfig, sequences: int, seq_len: int, *, train: bool) -> float:
    """One layer's attention scores [B, H, T, T] live at once: forward, the fp32 scores and
    their probabilities in the compute dtype; recomputed for the gradient, the scores, the
    probabilities and their gradient all in fp32 (as XLA keeps them, whatever the dtype)."""
    per_score = 12 if train else 4 + compute_bytes(config)
    return per_score * sequences * config.n_heads * seq_len * seq_len


# A Gated DeltaNet layer's chunked rule (core/model/delta.py) keeps fp32 arrays per token and
# value head: [C] rows of the chunk's decay, Gram and attention matrices and [D] rows of its
# queries, keys, values and their transforms. Bytes per (chunk position, head width), fitted
# to XLA:CPU's temporaries of one layer at B·H·T from 4k to 16k, C 64, D 16 and 32 (within
# 3%); the gradient also keeps each chunk's state [Dk, Dv] in fp32.
DELTA_FORWARD = (17, 29)
DELTA_TRAIN = (28, 140)


def delta_bytes(config: ModelConfig, sequences: int, seq_len: int, *, train: bool) -> float:
    """One Gated DeltaNet layer's rule temporaries (0 without such layers); a decode step
    (one token) updates the state in place of the chunks."""
    if not config.is_hybrid:
        return 0.0
    heads, dk, dv, chunk = (
        config.delta_value_heads, config.delta_key_dim, config.delta_value_dim, config.delta_chunk,
    )  # fmt: skip
    if seq_len == 1 and not train:
        return 2 * sequences * heads * dk * dv * 4
    per_position, per_width = DELTA_TRAIN if train else DELTA_FORWARD
    per_token = per_position * chunk + per_width * dv + (4 * dk * dv / chunk if train else 0)
    padded = -(-seq_len // chunk) * chunk
    return sequences * padded * heads * per_token


def _layer_matmuls(config: ModelConfig, sequences: int, seq_len: int) -> float:
    """One layer's projection outputs live at once, in the compute dtype: the attention
    block's (queries and keys, values) or one of the MLP's hidden activations, whichever is
    wider, and the residual stream with its normed copy (XLA fuses the rest away)."""
    kinds = [layer_kinds.stack_kind(config, s) for s in layer_kinds.stack_counts(config)]
    attention = max(
        config.n_heads * k.head_dim * (2 if config.attn_output_gate else 1)
        + 2 * k.n_kv_heads * k.head_dim
        for k in kinds
    )
    if config.kv_lora_rank:  # the latents and kv_b_proj's output beside the expanded heads
        shapes = projection_shapes(config)
        attention += sum(shapes[t][1] for t in ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj"))
    if config.is_hybrid:  # a DeltaNet layer's conv channels and output gate
        values = config.delta_value_heads * config.delta_value_dim
        attention = max(attention, 2 * config.delta_key_heads * config.delta_key_dim + 2 * values)
    widths = max(attention, *(mlp_width(config, k.hidden_dim) for k in kinds)) + 2 * config.dim
    return sequences * seq_len * widths * compute_bytes(config)


def mlp_width(config: ModelConfig, hidden_dim: int) -> int:
    """Values a token keeps at once in a layer's MLP: its hidden activation, or in a mixture
    (moe.py) each chosen expert's hidden activation, its copy of the token's row and its
    output row (the pairs sorted by expert), the router's logits and the shared expert's."""
    if not config.n_experts:
        return hidden_dim
    pairs = config.experts_per_token * (config.expert_dim + 2 * config.dim)
    beside = hidden_dim + 2 * config.dim if config.experts_beside_mlp else 0
    return pairs + config.n_experts + config.shared_expert_dim + beside


def forward_bytes(
    config: ModelConfig, sequences: int, seq_len: int, *, logits_len: int, tiles: int
) -> float:
    """Temporaries of a forward pass without gradient on one chip: one layer at a time (its
    projections and attention scores), then ``tiles`` logits tiles over ``logits_len``
    positions a sequence."""
    layers = layer_forward_bytes(config, sequences, seq_len)
    layers += per_layer_input_bytes(config, sequences, seq_len)
    return layers + logits_bytes(config, sequences * logits_len, tiles)


def layer_forward_bytes(config: ModelConfig, sequences: int, seq_len: int) -> float:
    """A forward pass's layer temporaries (no logits): one layer's projections and scores.
    A hybrid period's attention scores and DeltaNet chunks live side by side (XLA:CPU reuses
    neither's buffers for the other within the scanned period)."""
    mixing = attention_bytes(config, sequences, seq_len, train=False) + delta_bytes(
        config, sequences, seq_len, train=False
    )
    return _layer_matmuls(config, sequences, seq_len) + mixing


def recompute_bytes(config: ModelConfig, sequences: int, seq_len: int) -> float:
    """What the backward pass of a stack scanned by period (Qwen3.5, Gemma 4) holds for the
    period it recomputes: every layer of the longest period at once (0 for a plain stack,
    whose layer is counted in :func:`backward_bytes` alone)."""
    if not layer_kinds.uses_kinds(config):
        return 0.0
    one_layer = _layer_matmuls(config, sequences, seq_len)
    attention = one_layer + attention_bytes(config, sequences, seq_len, train=True)
    delta = one_layer + delta_bytes(config, sequences, seq_len, train=True)
    return max(
        sum(delta if stack == "linear_blocks" else attention for stack, _ in segment.period)
        for segment in layer_kinds.segments(config)
    )


def per_layer_input_bytes(config: ModelConfig, sequences: int, seq_len: int) -> float:
    """Gemma 4's per-layer inputs [B, T, L, P] in the compute dtype, live the whole pass."""
    width = config.n_layers * config.per_layer_dim
    return sequences * seq_len * width * compute_bytes(config)


def backward_bytes(config: ModelConfig, sequences: int, seq_len: int, *, logits_len: int) -> float:
    """Activations of a forward and backward pass on one chip, besides the gradients: what the
    remat policy keeps of every layer, the layer being recomputed (its attention scores,
    probabilities and their gradient), the loss's logits tiles; Gemma 4's per-layer inputs
    and their gradient."""
    one_layer = _layer_matmuls(config, sequences, seq_len)
    recomputed = one_layer + attention_bytes(config, sequences, seq_len, train=True)
    scanned = config.n_layers
    if layer_kinds.uses_kinds(config):  # a scan step recomputes a whole period at once
        recomputed = recompute_bytes(config, sequences, seq_len)
        scanned = sum(segment.periods for segment in layer_kinds.segments(config))
    inputs = scanned * sequences * seq_len * config.dim * compute_bytes(config)
    if config.remat == "full":
        kept = inputs
    elif config.remat == "dots_saveable":
        kept = inputs + config.n_layers * one_layer
    else:
        kept = scanned * recomputed
    per_layer = 2 * per_layer_input_bytes(config, sequences, seq_len)
    return kept + recomputed + per_layer + logits_bytes(config, sequences * logits_len, TRAIN_TILES)


def activation_bytes(
    config: ModelConfig, sequences: int, seq_len: int, *, logits_len: int, train: bool
) -> float:
    """Peak activations of one forward (and backward when ``train``) on one chip."""
    if train:
        return backward_bytes(config, sequences, seq_len, logits_len=logits_len)
    return forward_bytes(config, sequences, seq_len, logits_len=logits_len, tiles=INFERENCE_TILES)


def logits_bytes(config: ModelConfig, positions: int, tiles: int) -> float:
    """Full-vocabulary fp32 blocks live at once: ``tiles`` tiles of ``positions`` (at most
    ``ModelConfig.logits_tile`` elements each, core/model/vocab_tiles.py)."""
    if positions <= 0:
        return 0.0
    per_tile = positions_per_tile(config.logits_tile, config.vocab_size) or positions
    return tiles * min(positions, per_tile) * config.vocab_size * 4


def per_layer_table_count(config: ModelConfig) -> int:
    """Elements of Gemma 4's per-layer input table [V, L·P] (0 without one)."""
    return config.per_layer_vocab * config.n_layers * config.per_layer_dim


def embedding_bytes(
    config: ModelConfig, dtype_bytes: int = PARAM_BYTES, *, per_layer: bool = True
) -> int:
    """One copy of the input embedding [V, D] (fp32 unless ``dtype_bytes`` says), and with
    ``per_layer`` of Gemma 4's per-layer input table, whose gradient is as dense when it is
    whole (replicated; fsdp never gathers it: fsdp.sharded_rows)."""
    table = per_layer_table_count(config) if per_layer else 0
    return (config.vocab_size * config.dim + table) * dtype_bytes


def cast_bytes(config: ModelConfig, program: str) -> int:
    """The embedding's copies cast to the compute dtype in ``program`` (none in fp32)."""
    c = compute_bytes(config)
    return 0 if c == PARAM_BYTES else EMBEDDING_CASTS[program] * embedding_bytes(config, c)


def kv_cache_bytes(config: ModelConfig, sequences: int, length: int) -> float:
    """Keys and values of every attention layer for ``sequences`` of ``length`` tokens, and
    each Gated DeltaNet layer's state (fp32, its size free of ``length``) and conv inputs."""
    widths = sum(
        count * kind.n_kv_heads * kind.head_dim
        for stack, count in layer_kinds.stack_counts(config).items()
        if stack != "linear_blocks" and (kind := layer_kinds.stack_kind(config, stack)).owns_kv
    )  # Gemma 4: full layers' own widths; shared layers read the storing layer's cache
    keys = 2 * widths * sequences * length * compute_bytes(config)
    linear = sum(config.linear_layers())
    return keys + linear * sequences * delta_state_bytes(config)


def delta_state_bytes(config: ModelConfig) -> int:
    """One sequence's decoding state in one Gated DeltaNet layer: [Hv, Dk, Dv] fp32 and the
    conv's last kernel - 1 inputs in the compute dtype."""
    heads, values = config.delta_value_heads, config.delta_value_dim
    channels = 2 * config.delta_key_heads * config.delta_key_dim + heads * values
    recurrent = heads * config.delta_key_dim * values * 4
    return recurrent + (config.delta_conv_kernel - 1) * channels * compute_bytes(config)


def gathered_bytes(
    config: ModelConfig, *, networks: int, trained: bool, adapters: int | None = None
) -> float:
    """What fsdp holds whole at a time: ``networks`` running networks' outer tensors (and their
    gradients when ``trained``), and LAYERS_GATHERED layers of the stack.

    With LoRA (``adapters``: a network's adapter parameters) the frozen base is gathered in
    the compute dtype and has no gradient; a layer's adapters come in float32 with theirs.
    """
    gathered_outer = outer_param_count(config) - per_layer_table_count(config)  # read by rows
    if adapters is None:
        outer = gathered_outer * PARAM_BYTES * (2 if trained else 1)
        return networks * outer + LAYERS_GATHERED * layer_param_count(config) * PARAM_BYTES
    c = compute_bytes(config)
    layer = layer_param_count(config) * c + adapters // config.n_layers * 2 * PARAM_BYTES
    return networks * gathered_outer * c + LAYERS_GATHERED * layer
