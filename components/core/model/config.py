"""The transformer's architecture config, its named presets, and validation."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from components.core.model import layer_kinds
from components.core.model.adapter_targets import (
    ADAPTER_TARGETS,
    DELTA_TARGETS,
    LATENT_TARGETS,
    LORA_TARGETS,
)
from components.core.model.layer_kinds import check_kinds

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("sliding_attention", "full_attention", "linear_attention")

# None: keep every activation; full: keep only layer inputs; dots_saveable: keep matmul
# outputs (less recompute, more memory). Batch-dim dots (attention) are recomputed.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer; the defaults are Llama's.

    The fields after ``remat`` describe the Llama 3.1, Qwen2/3, Gemma 2/3 and Mistral variations
    (see ``components/hf``), so one model class serves every imported family.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    max_seq_len: int
    head_dim: int | None = None  # None: dim // n_heads
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "float32"  # compute dtype; params are always float32
    remat: str = "full"  # none | full | dots_saveable
    # Llama 3.1 rotary scaling (rope_type "llama3"); None: plain rotary.
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    mlp_activation: str = "silu"  # silu (SwiGLU) | gelu_tanh (Gemma's GeGLU)
    norm_scale_offset: float = 0.0  # Gemma: norms apply (1 + w)
    post_norms: bool = False  # Gemma 2: norm each sub-layer's output before the residual add
    embed_scale: bool = False  # Gemma: embeddings times sqrt(dim)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5; None: head_dim
    attn_logit_softcap: float | None = None  # Gemma 2: cap * tanh(logits / cap) in attention
    final_logit_softcap: float | None = None  # Gemma 2: the same on the output logits
    # Gemma 2: layers i with (i + 1) % sliding_window_pattern != 0 attend only to the last
    # sliding_window tokens (Gemma 2: every even layer, pattern 2); None: every layer global.
    sliding_window: int | None = None
    sliding_window_pattern: int = 2
    # Per layer "sliding_attention" or "full_attention", as Hugging Face's ``layer_types``
    # (Gemma 3: five local layers to one global; Mistral: every layer); () follows the pattern.
    layer_types: tuple[str, ...] = ()
    # Qwen3, Gemma 3: an RMSNorm over each head's queries and keys before the rotation.
    qk_norm: bool = False
    # Gemma 3: the sliding layers rotate with their own base (no scaling); None: one table.
    rope_local_theta: float | None = None
    # rope_type "linear": positions divided by this factor (Gemma 3's global layers).
    rope_linear_factor: float = 1.0
    # rope_type "yarn" (Ministral 3, Devstral 2; Qwen3 past 32k): each frequency blended
    # between itself and itself / factor by a ramp over the dims that turn between
    # beta_slow and beta_fast times within rope_original_max_len; sin and cos times
    # rope_attention_factor (transformers' ``_compute_yarn_parameters``). None: no yarn.
    rope_yarn_factor: float | None = None
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_truncate: bool = True
    rope_attention_factor: float = 1.0
    # Ministral 3's query temperature (``llama_4_scaling_beta``): the queries at position p
    # times 1 + beta · log(1 + floor(p / rope_original_max_len)); 0: none.
    query_scale_beta: float = 0.0
    # Partial rotary (Qwen3.5: 0.25): only the first head_dim * this of each head rotates.
    rotary_fraction: float = 1.0
    # Qwen3.5: q_proj emits each head's queries and a gate; the output is scaled by sigmoid(gate).
    attn_output_gate: bool = False
    # Gated DeltaNet layers ("linear_attention" in layer_types; core/model/delta.py): heads
    # of keys and of values, their widths, the causal conv's kernel and the chunk length
    # of the parallel form (transformers' and FLA's 64).
    delta_key_heads: int = 0
    delta_value_heads: int = 0
    delta_key_dim: int = 128
    delta_value_dim: int = 128
    delta_conv_kernel: int = 4
    delta_chunk: int = 64
    # Gemma 4 (layer_kinds.py): full-attention layers with their own head width and KV heads
    # (None: head_dim, n_kv_heads), keys serving as values there (attention_k_eq_v); values
    # RMS-normed without a scale; the last kv_shared_layers layers reusing the keys and
    # values of the last earlier layer of their type, their MLP shared_mlp_factor times as
    # wide (use_double_wide_mlp); per-layer input embeddings of per_layer_dim a layer over
    # per_layer_vocab rows; a fixed scalar on each layer's output; and full layers' rotary
    # "proportional" (rotary_fraction of the angles turn, exponents over the whole head).
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    global_k_eq_v: bool = False
    v_norm: bool = False
    kv_shared_layers: int = 0
    shared_mlp_factor: int = 1
    per_layer_dim: int = 0
    per_layer_vocab: int = 0
    layer_scalar: bool = False
    rope_proportional: bool = False
    # Mixture-of-experts MLPs on every layer (Qwen3 MoE, Qwen3.5 MoE; core/model/moe.py):
    # n_experts SwiGLU experts expert_dim wide, experts_per_token of them chosen per token by
    # a softmax router (their weights renormalised to sum 1 with norm_topk_prob), and
    # Qwen3.5's sigmoid-gated shared expert shared_expert_dim wide beside them. 0: dense MLPs.
    n_experts: int = 0
    experts_per_token: int = 0
    expert_dim: int = 0
    norm_topk_prob: bool = True
    shared_expert_dim: int = 0
    # Gemma 4 26B-A4B: the experts run beside each layer's dense MLP (moe.BesideExperts).
    experts_beside_mlp: bool = False
    # Mistral 4: the chosen experts' weights times routed_scaling (routed_scaling_factor), and
    # a shared expert without Qwen's sigmoid gate (its ``shared_experts``).
    routed_scaling: float = 1.0
    shared_expert_gated: bool = True
    # Multi-head latent attention (Mistral 4, after DeepSeek-V2; core/model/latent_attention.py):
    # keys and values from a kv_lora_rank-wide latent, queries through a q_lora_rank-wide one
    # (0: one projection), each head's last rotary_dim query/key dims rotated, that part of
    # the key shared by every head. head_dim is the query, key and value width. 0: none.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    # Logits live a tile of at most this many elements (positions × vocabulary) at a time
    # wherever log-probs, entropy or KL are reduced (core/model/vocab_tiles.py): 2**24 fp32
    # = 64 MiB; 0 = whole. The sampler's one position a step is never tiled.
    logits_tile: int = 2**24
    # Low-rank adapters (core/model/lora.py): rank 0 = none; targets by Hugging Face name.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seq_len < 1:
            raise ValueError(f"ModelConfig.max_seq_len must be >= 1, got {self.max_seq_len}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                f"({self.n_kv_heads}): choose n_kv_heads among the divisors of n_heads"
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"ModelConfig.dim ({self.dim}) is not divisible by n_heads ({self.n_heads}): "
                "change one of them or set head_dim explicitly"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(
                f"ModelConfig head_dim ({self.resolved_head_dim}) must be even for rotary "
                "positions: set head_dim or change dim / n_heads"
            )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"ModelConfig.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"ModelConfig.remat must be one of {list(REMAT_POLICIES)}, got {self.remat!r}"
            )
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("ModelConfig.rope_theta and norm_eps must be positive")
        self._check_variations()
        self._check_lora()

    def _check_lora(self) -> None:
        """Adapters: a non-negative rank, a positive alpha, targets the model has."""
        known = ADAPTER_TARGETS if self.is_hybrid else LORA_TARGETS
        if self.kv_lora_rank:  # latent attention: its projections, and the MLP's (refused below)
            known = tuple(t for t in ADAPTER_TARGETS if self.target_stacks(t)) + (
                "gate_proj", "up_proj", "down_proj",
            )  # fmt: skip
        if not self.is_hybrid and set(self.lora_targets) & set(DELTA_TARGETS):
            raise ValueError(
                f"ModelConfig.lora_targets {list(self.lora_targets)}: {list(DELTA_TARGETS)} "
                "are Gated DeltaNet projections, which this model (no linear_attention layers) "
                "does not have"
            )
        if self.lora_rank < 0 or not self.lora_alpha > 0:
            raise ValueError(
                f"ModelConfig.lora_rank ({self.lora_rank}) must be >= 0 and lora_alpha "
                f"({self.lora_alpha}) > 0"
            )
        mlp = set(self.lora_targets) & {"gate_proj", "up_proj", "down_proj"}
        if self.n_experts and not self.experts_beside_mlp and mlp:
            raise ValueError(
                f"ModelConfig.lora_targets {sorted(mlp)}: a mixture-of-experts model's MLPs "
                "take no adapters (moe.py); target the attention projections"
            )
        unknown = sorted(set(self.lora_targets) - set(known))
        if unknown or (self.lora_rank > 0) != bool(self.lora_targets):
            raise ValueError(
                f"ModelConfig.lora_targets {list(self.lora_targets)} must name projections among "
                f"{list(known)}, and be given exactly when lora_rank > 0"
            )

    def _check_variations(self) -> None:
        """Validate the family-specific fields (activation, caps, window, rotary scaling)."""
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(
                f"ModelConfig.mlp_activation must be one of {MLP_ACTIVATIONS}, "
                f"got {self.mlp_activation!r}"
            )
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be positive or None, got {value}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"ModelConfig.sliding_window must be >= 1 or None, got {self.sliding_window}"
            )
        if self.sliding_window_pattern < 1:
            raise ValueError(
                "ModelConfig.sliding_window_pattern must be >= 1, "
                f"got {self.sliding_window_pattern}"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown or (self.layer_types and len(self.layer_types) != self.n_layers):
            raise ValueError(
                f"ModelConfig.layer_types must give one of {LAYER_TYPES} per layer "
                f"({self.n_layers}), got {list(self.layer_types)}"
            )
        if self.logits_tile < 0:
            raise ValueError(
                f"ModelConfig.logits_tile must be >= 0 (0 = whole logits), got {self.logits_tile}"
            )
        self._check_hybrid()
        self._check_experts()
        self._check_latent()
        check_kinds(self)
        self._check_yarn()
        if self.rope_linear_factor <= 0 or (self.rope_local_theta or 1.0) <= 0:
            raise ValueError("ModelConfig.rope_linear_factor and rope_local_theta must be positive")
        if self.rope_scaling_factor is not None and not (
            self.rope_scaling_factor > 0 and self.rope_high_freq_factor > self.rope_low_freq_factor
        ):
            raise ValueError(
                "ModelConfig rotary scaling needs rope_scaling_factor > 0 and "
                "rope_high_freq_factor > rope_low_freq_factor"
            )

    def _check_experts(self) -> None:
        """Mixture of experts: k of n experts, a width, no Gemma 4 layer variations."""
        sizes = (self.experts_per_token, self.expert_dim, self.shared_expert_dim)
        if not self.n_experts:
            if any(sizes) or self.experts_beside_mlp:
                raise ValueError(
                    "ModelConfig experts_per_token, expert_dim, shared_expert_dim and "
                    f"experts_beside_mlp need n_experts > 0, got {sizes}"
                )
            return
        if not 1 <= self.experts_per_token <= self.n_experts or self.expert_dim < 1:
            raise ValueError(
                f"ModelConfig.experts_per_token ({self.experts_per_token}) must be in "
                f"[1, n_experts ({self.n_experts})] and expert_dim ({self.expert_dim}) >= 1"
            )
        # Beside a dense MLP (Gemma 4's router): no shared expert, the top k renormalised.
        beside = self.experts_beside_mlp and (self.shared_expert_dim or not self.norm_topk_prob)
        if self.routed_scaling <= 0:
            raise ValueError(f"ModelConfig.routed_scaling must be > 0, got {self.routed_scaling}")
        if self.shared_expert_dim < 0 or self.shared_mlp_factor != 1 or beside:
            raise ValueError(
                "ModelConfig: experts beside Gemma 4's double-wide MLPs, or beside a dense MLP "
                "with a shared expert or norm_topk_prob off, or a negative shared_expert_dim "
                f"({self.shared_expert_dim})"
            )

    def _check_latent(self) -> None:
        """Latent attention: a latent, one key and value head a query head, a rotated part."""
        if not self.kv_lora_rank:
            if self.q_lora_rank:
                raise ValueError("ModelConfig.q_lora_rank is latent attention's: set kv_lora_rank")
            return
        if (
            min(self.kv_lora_rank, self.q_lora_rank) < 0
            or self.n_kv_heads != self.n_heads
            or self.rotary_fraction == 1.0
            or self.qk_norm or self.attn_output_gate or self.qkv_bias or self.is_hybrid
        ):  # fmt: skip
            raise ValueError(
                f"ModelConfig latent attention (kv_lora_rank {self.kv_lora_rank}) needs "
                "q_lora_rank >= 0, n_kv_heads = n_heads, rotary_fraction < 1 (the rotated part "
                "of each head), and none of qk_norm, attn_output_gate, qkv_bias, linear layers"
            )

    def _check_yarn(self) -> None:
        """Yarn and the query temperature: positive scales, one rotary scaling at a time."""
        if self.rope_yarn_factor is not None and (
            self.rope_yarn_factor <= 0 or self.rope_scaling_factor is not None
        ):
            raise ValueError(
                "ModelConfig.rope_yarn_factor must be > 0 and cannot be combined with "
                "rope_scaling_factor (Llama 3.1's scaling)"
            )
        if self.rope_attention_factor <= 0 or self.query_scale_beta < 0:
            raise ValueError(
                "ModelConfig.rope_attention_factor must be > 0 and query_scale_beta >= 0"
            )
        if (self.rope_yarn_factor or self.query_scale_beta) and self.rope_original_max_len < 1:
            raise ValueError("ModelConfig.rope_original_max_len must be >= 1 with yarn")
        scaled = self.rope_yarn_factor is not None or self.query_scale_beta
        if scaled and (
            self.rope_proportional or self.rope_local_theta is not None
            or self.rope_linear_factor != 1.0
        ):  # fmt: skip
            raise ValueError(
                "ModelConfig yarn and query_scale_beta apply to one plain rotary table: not with "
                "rope_proportional, rope_local_theta or rope_linear_factor"
            )
        if self.rope_attention_factor != 1.0 and self.rope_yarn_factor is None:
            raise ValueError("ModelConfig.rope_attention_factor is yarn's: set rope_yarn_factor")

    def _check_hybrid(self) -> None:
        """Gated DeltaNet layers: their heads and widths, a repeating pattern, no window."""
        if not 0 < self.rotary_fraction <= 1 or (
            int(self.rotary_dim) % 2 and not self.rope_proportional
        ):
            raise ValueError(
                f"ModelConfig.rotary_fraction ({self.rotary_fraction}) must be in (0, 1] and "
                f"leave an even rotary width (head_dim {self.resolved_head_dim})"
            )
        if not self.is_hybrid:
            return
        heads, value_heads = self.delta_key_heads, self.delta_value_heads
        sizes = (heads, value_heads, self.delta_key_dim, self.delta_value_dim)
        if min(sizes) < 1 or value_heads % heads or self.delta_conv_kernel < 1:
            raise ValueError(
                "ModelConfig linear_attention layers need delta_key_heads, delta_value_heads "
                "(a multiple of the key heads), delta_key_dim, delta_value_dim and "
                f"delta_conv_kernel >= 1, got {sizes} and kernel {self.delta_conv_kernel}"
            )
        if self.delta_chunk < 1:
            raise ValueError(f"ModelConfig.delta_chunk must be >= 1, got {self.delta_chunk}")
        if self.sliding_window is not None:
            raise ValueError("ModelConfig: sliding windows beside linear_attention layers")
        # A pattern that does not repeat: refused by layer_kinds.check_kinds, per segment.

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are Gated DeltaNet (linear attention) layers."""
        return "linear_attention" in self.layer_types

    def linear_layers(self) -> list[bool]:
        """Per layer: whether it is a Gated DeltaNet layer (all False in a plain model)."""
        return [kind == "linear_attention" for kind in self.layer_types] or [False] * self.n_layers

    def stack_places(self) -> list[tuple[str, int]]:
        """Per checkpoint layer: its stack (``layer_kinds.STACKS``) and index there."""
        return layer_kinds.stack_places(self)

    def layer_period(self) -> tuple[bool, ...]:
        """The shortest run of :meth:`linear_layers` flags that repeats to make the stack.

        A hybrid stack is scanned one period at a time (transformer.py): Qwen3.5's three
        DeltaNet layers and one attention layer. A pattern that does not repeat is refused.
        """
        flags = tuple(self.linear_layers())
        for period in range(1, self.n_layers + 1):
            if self.n_layers % period == 0 and flags == flags[:period] * (self.n_layers // period):
                if period == self.n_layers and self.n_layers > 8:
                    break
                return flags[:period]
        raise ValueError(
            f"ModelConfig.layer_types {list(self.layer_types)} do not repeat one pattern of "
            "linear_attention and full_attention layers; alignpipe scans a hybrid stack one "
            "period at a time"
        )

    def target_stacks(self, target: str) -> tuple[str, ...]:
        """The layer stacks (layer_kinds.py) holding the adapter target ``target``: DeltaNet
        projections in ``linear_blocks``, the MLP's in every stack, the attention ones in
        the attention stacks that have them (Gemma 4: no k/v where layers reuse them, no v
        where keys serve as values)."""
        counts = layer_kinds.stack_counts(self)
        if target in DELTA_TARGETS:
            return tuple(s for s in counts if s == "linear_blocks")
        if target in ("gate_proj", "up_proj", "down_proj"):  # no expert takes adapters
            return () if self.n_experts and not self.experts_beside_mlp else tuple(counts)
        if self.kv_lora_rank or target in LATENT_TARGETS:  # Mistral 4's latent attention
            latent = self.kv_lora_rank and target in self.latent_projections()
            return tuple(counts) if latent else ()
        stacks = []
        for stack in counts:
            kind = layer_kinds.stack_kind(self, stack)
            has = stack != "linear_blocks" and (
                target in ("q_proj", "o_proj")
                or (kind.owns_kv and (target == "k_proj" or not kind.k_eq_v))
            )
            if has:
                stacks.append(stack)
        return tuple(stacks)

    def latent_projections(self) -> tuple[str, ...]:
        """Latent attention's projections by Hugging Face name, in a layer's order: the query
        latent's two (or ``q_proj`` without one), the key-value latent's two, the output."""
        queries = ("q_a_proj", "q_b_proj") if self.q_lora_rank else ("q_proj",)
        return (*queries, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

    def present_targets(self, targets: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``targets`` this model's layers have (all-linear names DeltaNet's too)."""
        return tuple(t for t in targets if self.target_stacks(t))

    @property
    def rotary_dim(self) -> int:
        """How many of each head's leading dimensions rotate (all of them by default)."""
        return int(self.resolved_head_dim * self.rotary_fraction)

    def sliding_layers(self) -> list[bool]:
        """Per layer: whether it uses the sliding window (all False without one)."""
        if self.sliding_window is None:
            return [False] * self.n_layers
        if self.layer_types:
            return [kind == "sliding_attention" for kind in self.layer_types]
        pattern = self.sliding_window_pattern
        return [(i + 1) % pattern != 0 for i in range(self.n_layers)]

    @property
    def resolved_head_dim(self) -> int:
        """The per-head width: head_dim if set, else dim // n_heads."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def lora_scale(self) -> float:
        """The adapters' output scale, alpha / rank (PEFT's ``scaling``)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    @property
    def compute_dtype(self) -> jnp.dtype:
        """The activation dtype as a JAX dtype."""
        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Rebuild a config from ``to_dict`` output; unknown keys are an error, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown ModelConfig fields {unknown}; known fields are {sorted(known)}"
            )
        for name in ("lora_targets", "layer_types"):  # JSON lists
            if name in d:
                d = {**d, name: tuple(d[name])}
        return cls(**d)
