"""Presets for real runs on TPU slices, and the per-chip memory arithmetic that decides them.

Every stage replicates its models on every chip (``jax.pmap`` data parallelism)
with float32 parameters and AdamW's two float32 moments, so per chip, for a model
of N parameters:

    trained model   20 N bytes: params 4 + grads 4 + Adam moments 8 + update temporaries 4
    frozen model     4 N bytes
    sft              one trained model                          20 N
    reward           one trained model                          20 N
    ppo              policy + critic trained, reference + RM    48 N

plus activations (``activation_bytes``): with ``remat="full"`` the scan keeps
each layer's input (L·B·T·D in the compute dtype) and recomputes one layer at a
time in the backward pass; the LM logits and their softmax cost 2·B·T·V·4 bytes,
which for 128k-256k vocabularies is the largest activation by far.

What follows (``estimate`` below; tests/test_run_presets.py checks each claim):

* Qwen2.5-0.5B-class (N = 0.49e9): sft and reward fit a v5e chip (16 GB) at
  1024 tokens; its PPO (48 N = 23.7 GB) does not fit a v5e chip at all.
* Llama-3.2-1B-class (N = 1.24e9): 20 N = 24.7 GB exceeds a v5e chip before any
  activation, so no stage of it fits a v5e-8 slice with replicated fp32 state;
  on a v5p-8 slice (4 chips of 95 GB) every stage fits, PPO at 68 GB.
* 7B-class (Llama-2-7B, N = 6.74e9): 20 N = 135 GB exceeds every TPU chip, so
  replicated training cannot run it at all. It needs the state sharded over the
  slice (FSDP: 48 N / 32 chips = 10.1 GB per chip for PPO on v5p-64) or smaller
  state (bf16 moments, LoRA), which this release does not have.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from components.core.model_config import ModelConfig, model_config

GB = 1e9
# HBM per chip as Google lists it; a run may use HEADROOM of it (XLA's own buffers,
# fragmentation and the estimate's rough edges take the rest).
CHIP_HBM = {"v5e": 16 * GB, "v6e": 32 * GB, "v5p": 95 * GB}
HEADROOM = 0.85
TRAINED_BYTES_PER_PARAM = 20  # fp32 params, grads, two Adam moments, update temporaries
FROZEN_BYTES_PER_PARAM = 4


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunPreset:
    """A model class on a TPU slice, with each stage's flags chosen so the memory fits."""

    model: str  # a ModelConfig preset of the model class's shape
    vocab_size: int
    example: str  # a released model of that shape
    chip: str
    chips: int
    stages: dict[str, dict[str, Any]]

    def config(self, stage: str) -> ModelConfig:
        """The model config a stage of this preset trains (its remat and dtype applied)."""
        flags = self.stages[stage]
        return model_config(self.model, self.vocab_size, remat=flags["remat"], dtype=flags["dtype"])


def param_count(config: ModelConfig) -> int:
    """Parameters of the model (without a scalar head)."""
    d, hd, layers = config.dim, config.resolved_head_dim, config.n_layers
    attn = d * hd * (2 * config.n_heads + 2 * config.n_kv_heads)
    if config.qkv_bias:
        attn += hd * (config.n_heads + 2 * config.n_kv_heads)
    norms = (4 if config.post_norms else 2) * d
    embed = config.vocab_size * d * (1 if config.tie_embeddings else 2)
    return layers * (attn + 3 * d * config.hidden_dim + norms) + embed + d


def activation_bytes(
    config: ModelConfig, sequences: int, seq_len: int, *, logits_len: int, train: bool
) -> float:
    """Peak activations of one forward (and backward when ``train``) on one chip."""
    c = 2 if config.dtype == "bfloat16" else 4
    b, t, d, hd = sequences, seq_len, config.dim, config.resolved_head_dim
    heads, kv = config.n_heads, config.n_kv_heads
    matmuls = b * t * (2 * heads * hd + 2 * kv * hd + 3 * config.hidden_dim + 2 * d) * c
    scores = b * heads * t * t * (4 + c)  # fp32 attention logits and their probabilities
    one_layer = matmuls + scores
    logits = b * logits_len * config.vocab_size * 4
    if not train:
        return one_layer + logits
    inputs = config.n_layers * b * t * d * c
    if config.remat == "full":
        kept = inputs
    elif config.remat == "dots_saveable":
        kept = inputs + config.n_layers * matmuls
    else:
        kept = config.n_layers * one_layer
    # The recomputed layer and its gradients; logits and the softmax of their gradient.
    return kept + 2 * one_layer + 2 * logits


def estimate(preset: RunPreset, stage: str) -> dict[str, float]:
    """Bytes per chip of ``stage`` under ``preset``: state, activations, total."""
    flags = preset.stages[stage]
    config = preset.config(stage)
    n = param_count(config)
    if stage == "ppo":
        return _ppo_estimate(config, n, flags, preset.chips)
    per_chip = flags["batch_size"] // preset.chips
    sequences = 2 * per_chip if stage == "reward" else per_chip  # reward: chosen + rejected
    logits_len = 0 if stage == "reward" else flags["max_len"]  # the reward head is a scalar
    state = TRAINED_BYTES_PER_PARAM * n
    acts = activation_bytes(config, sequences, flags["max_len"], logits_len=logits_len, train=True)
    return {"params": n, "state": state, "activations": acts, "total": state + acts}


def _ppo_estimate(config: ModelConfig, n: int, flags: dict, chips: int) -> dict[str, float]:
    """Policy + critic trained, reference + reward frozen; peak of rollout or update."""
    state = (2 * TRAINED_BYTES_PER_PARAM + 2 * FROZEN_BYTES_PER_PARAM) * n
    rollout = flags["rollout_batch_size"] // chips
    minibatch = rollout // flags["minibatches"]
    prompt, response = flags["prompt_len"], flags["max_new_tokens"]
    length = prompt + response
    c = 2 if config.dtype == "bfloat16" else 4
    kv_cache = 2 * config.n_layers * rollout * length * config.n_kv_heads
    kv_cache *= config.resolved_head_dim * c
    scoring = activation_bytes(config, rollout, length, logits_len=response, train=False)
    policy = activation_bytes(config, minibatch, length, logits_len=response, train=True)
    critic = activation_bytes(config, minibatch, length, logits_len=0, train=True)
    acts = max(kv_cache + scoring, policy + critic)
    return {"params": n, "state": state, "activations": acts, "total": state + acts}


def fits(preset: RunPreset, stage: str) -> bool:
    """Whether ``stage`` stays within HEADROOM of one chip's HBM."""
    return estimate(preset, stage)["total"] <= HEADROOM * CHIP_HBM[preset.chip]


_BF16_FULL = {"remat": "full", "dtype": "bfloat16"}

RUN_PRESETS: dict[str, RunPreset] = {
    # 0.5B-class on v5e-8 (8 chips x 16 GB; a run may use 13.6 GB). State 20 N = 9.9 GB.
    # sft: 2 x 1024 tokens per chip: logits 2 x 2 x 1024 x 151936 x 4 = 2.5 GB + layers
    # 0.6 GB -> 13.0 GB (4 per chip would need 16.0 GB). reward: 4 pairs = 8 sequences
    # per chip, no vocabulary logits: 2.4 GB -> 12.2 GB. ppo: 48 N = 23.7 GB: not here.
    "v5e-8-0.5b": RunPreset(
        model="0.5b",
        vocab_size=151936,
        example="Qwen/Qwen2.5-0.5B-Instruct",
        chip="v5e",
        chips=8,
        stages={
            "sft": {"batch_size": 16, "max_len": 1024, **_BF16_FULL},
            "reward": {"batch_size": 32, "max_len": 1024, **_BF16_FULL},
        },
    ),
    # 1B-class on v5p-8 (4 chips x 95 GB; a run may use 80.8 GB). State 20 N = 24.7 GB
    # (sft, reward), 48 N = 59.3 GB (ppo). sft: 16 x 1024 per chip: logits 16.8 GB +
    # layers 9.7 GB -> 51 GB. reward: 16 pairs per chip -> 44 GB. ppo: 16 prompts per
    # chip, minibatch 4, 512 + 512 tokens: update (policy + critic) 9.1 GB -> 68 GB.
    "v5p-8-1b": RunPreset(
        model="1b",
        vocab_size=128256,
        example="meta-llama/Llama-3.2-1B-Instruct",
        chip="v5p",
        chips=4,
        stages={
            "sft": {"batch_size": 64, "max_len": 1024, **_BF16_FULL},
            "reward": {"batch_size": 64, "max_len": 1024, **_BF16_FULL},
            "ppo": {
                "rollout_batch_size": 64,
                "minibatches": 4,
                "prompt_len": 512,
                "max_new_tokens": 512,
                **_BF16_FULL,
            },
        },
    ),
}
