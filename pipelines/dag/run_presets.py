"""Presets for real runs on TPU slices: a model class, a slice, and each stage's flags
chosen so its memory fits (per algorithm and phase: ``phases.py``, calibrated against XLA's
compiled programs; ``estimate`` below gives a stage's peak; tests/test_run_presets.py
checks each claim). Figures are per chip; a run may use 90% of a chip's physical HBM
(v5e 16 GiB, v5p 95 GiB: 14.4 and 85.5 GiB).

Each preset's figures, phase by phase, and what they show (why fsdp, which slice, where
LoRA changes the answer, what does not fit): docs/real-models.md, "Fitting a real model";
``alignpipe run-presets NAME`` prints them.

Where the planner stands against XLA: within 15% of the compiled programs replicated at the
calibration shapes (tests/test_memory_calibration*.py); with fsdp it counts gathered
tensors and casts apart that XLA partly overlaps, 0.9-1.2x at those shapes. ``alignpipe plan
--run-preset NAME --compile`` prints XLA's figures at a preset's own shapes. No TPU has
measured these presets.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from components.core.config import ALL_LINEAR, LoRASettings
from components.core.model.config import ModelConfig
from components.core.model.presets import model_config
from components.core.training.config import PRETRAINED_LEARNING_RATE
from pipelines.dag import memory, param_table, phases
from pipelines.dag.phases import Phase, Placement

STAGES = ("sft", "reward", "ppo", "dpo", "evaluate")
# The stages a run of each algorithm takes (dpo replaces the reward and ppo stages).
RL_ALGORITHMS = ("ppo", "grpo", "rloo")
ALGORITHM_STAGES = {
    **{name: ("sft", "reward", "ppo", "evaluate") for name in RL_ALGORITHMS},
    "dpo": ("sft", "dpo", "evaluate"),
}
# A preset runs an imported model: every stage fine-tunes pretrained weights, at rates that
# keep what they know (sft and reward: TrainConfig's auto rate for them; PPO's policy: 1e-6).
PPO_PRETRAINED_LEARNING_RATE = 1e-6
PRETRAINED_RATES = {
    "sft": {"learning_rate": PRETRAINED_LEARNING_RATE},
    "reward": {"learning_rate": PRETRAINED_LEARNING_RATE},
    "ppo": {"learning_rate": PPO_PRETRAINED_LEARNING_RATE},
    "dpo": {"learning_rate": PRETRAINED_LEARNING_RATE},
    "evaluate": {},
}
# Adapters start at zero (B = 0) and train few parameters: LoRA's usual rates are about ten
# times full fine-tuning's (PEFT's examples: 1e-4 to 2e-4 for sft).
LORA_PRETRAINED_RATES = {
    "sft": {"learning_rate": 1e-4},
    "reward": {"learning_rate": 1e-4},
    "ppo": {"learning_rate": 1e-5},
    "dpo": {"learning_rate": 1e-5},
    "evaluate": {},
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunPreset:
    """A model class on a TPU slice, with each stage's flags chosen so the memory fits.

    ``stages`` holds each stage's batch fields (names as in SFTConfig, RewardConfig,
    PPOConfig, EvalConfig); lengths, ``remat``, ``dtype`` and ``fsdp`` are the same for
    every stage, so they are pipeline-wide parameters (``pipeline_params``). Learning
    rates are the pretrained ones (``PRETRAINED_RATES``), set explicitly; with LoRA
    (``lora_rank`` > 0, set on sft, reward and ppo) ``LORA_PRETRAINED_RATES``.
    """

    model: str  # a ModelConfig preset of the model class's shape
    vocab_size: int
    example: str  # a released model of that shape
    chip: str
    chips: int
    hosts: int
    prompt_len: int
    response_len: int
    remat: str
    dtype: str
    fsdp: bool
    stages: dict[str, dict[str, Any]]
    # LoRA on sft, reward and ppo (0: full fine-tuning); evaluate loads merged models.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = ALL_LINEAR

    @property
    def slice_name(self) -> str:
        """Google's name of the slice: v5p counts TensorCores (2 per chip), v5e/v6e chips."""
        return f"{self.chip}-{self.chips * (2 if self.chip == 'v5p' else 1)}"

    def config(self) -> ModelConfig:
        """The model config every stage of this preset runs (its remat and dtype applied)."""
        return model_config(self.model, self.vocab_size, remat=self.remat, dtype=self.dtype)

    def lora(self) -> LoRASettings:
        """The preset's LoRA settings (checked as a stage config checks them)."""
        return LoRASettings(
            lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, lora_targets=self.lora_targets
        )

    def adapter_params(self) -> int:
        """Adapter parameters of one network (0 with full fine-tuning)."""
        lora = self.lora()
        return memory.adapter_param_count(self.config(), lora.lora_rank, lora.lora_target_modules())

    def flags(self, stage: str) -> dict[str, Any]:
        """The stage's config fields: its batch fields, lengths, remat, dtype and fsdp (and for
        ``shard``, the token lengths and the eval split's minimum)."""
        if stage == "shard":
            return {
                "max_prompt_tokens": self.prompt_len,
                "max_response_tokens": self.response_len,
                # One eval batch of each: the shard stage refuses a smaller eval split.
                "min_eval_pairs": max(self.stages[s]["batch_size"] for s in ("sft", "reward")),
            }
        numerics = {"remat": self.remat, "dtype": self.dtype, "fsdp": self.fsdp}
        if self.lora_rank:
            numerics |= dataclasses.asdict(self.lora())
        if stage in ("sft", "reward", "dpo"):
            # The shape of a fresh model; a base policy brings its own.
            lengths = {"preset": self.model, "max_len": self.prompt_len + self.response_len}
        elif stage == "ppo":
            lengths = {"prompt_len": self.prompt_len, "max_new_tokens": self.response_len}
        else:  # evaluate: prompts come from the data, cut to the shard stage's length
            lengths, numerics = {"max_new_tokens": self.response_len}, {"fsdp": self.fsdp}
        rates = (LORA_PRETRAINED_RATES if self.lora_rank else PRETRAINED_RATES)[stage]
        return {**self.stages[stage], **rates, **lengths, **numerics}

    def pipeline_params(self) -> dict[str, Any]:
        """The pipeline parameters that run this preset, read off the parameter table
        (pipelines/dag/param_table.py): each parameter whose stage config fields the preset sets."""
        return params_for({stage: self.flags(stage) for stage in ("shard", *STAGES)})


def params_for(stage_fields: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Pipeline parameters from stage config fields (stage -> field -> value), through each
    parameter's targets; a parameter that sets a field in several stages must get one value."""
    values: dict[str, Any] = {}
    for param in param_table.PARAMS:
        given = {
            (stage, field): stage_fields[stage][field]
            for stage, field in param.targets
            if field in stage_fields.get(stage, {})
        }
        if len(set(map(repr, given.values()))) > 1:
            raise ValueError(
                f"parameter {param.name} sets {', '.join(f'{s}.{f}' for s, f in given)} alike, "
                f"but the preset gives them {sorted(map(repr, given.values()))}; give the "
                "stages one value"
            )
        if given:
            values[param.name] = next(iter(given.values()))
    return values


def state_bytes(preset: RunPreset, stage: str) -> tuple[float, float]:
    """(frozen, trained) bytes of the networks ``stage`` (the ppo stage: an RL algorithm's
    name) holds, before fsdp divides them."""
    config = preset.config()
    n = memory.param_count(config)
    if not preset.lora_rank or stage == "evaluate":  # evaluate loads merged models
        trained, frozen = memory.FULL_MODELS[stage]
        frozen_bytes = frozen * memory.FROZEN_BYTES_PER_PARAM * n
        return frozen_bytes, trained * memory.TRAINED_BYTES_PER_PARAM * n
    head, adapters = config.dim + 1, preset.adapter_params()
    # Trained: an adapter set per network trained, and the reward or critic head; PPO's
    # reward head is frozen beside the bases.
    trained = {
        "sft": adapters, "reward": adapters + head, "dpo": adapters, "ppo": 2 * adapters + head,
        "grpo": adapters, "rloo": adapters,
    }[stage]  # fmt: skip
    rl = stage in RL_ALGORITHMS
    frozen = memory.LORA_BASES[stage] * n + (head if rl else 0)
    return frozen * memory.compute_bytes(config), trained * memory.TRAINED_BYTES_PER_PARAM


def placement(preset: RunPreset) -> Placement:
    """How the preset's networks sit on its chips."""
    adapters = preset.adapter_params() if preset.lora_rank else None
    return Placement(preset.chips, preset.hosts, preset.fsdp, adapters)


def stage_phases(
    preset: RunPreset, stage: str, overrides: dict[str, Any] | None = None, *,
    algorithm: str = "ppo",
) -> list[Phase]:  # fmt: skip
    """The phases of ``stage`` (the ppo stage: of the RL ``algorithm``) under ``preset``
    with ``overrides`` of the stage's config fields (flags given over the preset)."""
    if stage == "ppo" and algorithm not in RL_ALGORITHMS:
        raise ValueError(
            f"algorithm: the ppo stage runs {', '.join(RL_ALGORITHMS)}, not {algorithm}"
        )
    flags = {"prompt_len": preset.prompt_len, **preset.flags(stage), **(overrides or {})}
    return phases.phases(
        preset.config(), algorithm if stage == "ppo" else stage, flags, placement(preset)
    )


def estimate(
    preset: RunPreset, stage: str, overrides: dict[str, Any] | None = None, *,
    algorithm: str = "ppo",
) -> dict[str, Any]:  # fmt: skip
    """Bytes per chip of ``stage`` under ``preset`` (:func:`stage_phases`): the networks'
    state (frozen + trained, fsdp's share), each phase's total, and the peak (``total``,
    in its phase ``peak``)."""
    frozen, trained = state_bytes(preset, algorithm if stage == "ppo" else stage)
    if preset.fsdp:
        frozen, trained = frozen / preset.chips, trained / preset.chips
    found = stage_phases(preset, stage, overrides, algorithm=algorithm)
    top = phases.peak(found)
    return {
        "params": memory.param_count(preset.config()),
        "frozen": frozen,
        "trained": trained,
        "state": frozen + trained,
        "phases": {phase.name: phase.total for phase in found},
        "peak": top.name,
        "total": top.total,
    }


def fits(preset: RunPreset, stage: str, *, algorithm: str = "ppo") -> bool:
    """Whether ``stage`` stays within HEADROOM (memory.py) of one chip's HBM."""
    total = estimate(preset, stage, algorithm=algorithm)["total"]
    return total <= memory.HEADROOM * memory.CHIP_HBM[preset.chip]


_BF16_FULL = {"remat": "full", "dtype": "bfloat16"}
_QWEN3_30B_A3B = dict(model="qwen3-30b-a3b", vocab_size=151936, example="Qwen/Qwen3-30B-A3B",
                      fsdp=True, **_BF16_FULL)  # fmt: skip

RUN_PRESETS: dict[str, RunPreset] = {
    "v5e-8-1b": RunPreset(
        model="1b",
        vocab_size=128256,
        example="meta-llama/Llama-3.2-1B-Instruct",
        chip="v5e",
        chips=8,
        hosts=1,
        prompt_len=512,
        response_len=256,
        fsdp=True,
        **_BF16_FULL,
        stages={
            "sft": {"batch_size": 32},
            "reward": {"batch_size": 32},
            "dpo": {"batch_size": 32},
            "ppo": {"rollout_batch_size": 64, "minibatches": 8},
            "evaluate": {"batch_size": 64},
        },
    ),
    "v5p-32-7b": RunPreset(
        model="7b",
        vocab_size=32000,
        example="meta-llama/Llama-2-7b-chat-hf",
        chip="v5p",
        chips=16,
        hosts=4,
        prompt_len=1024,
        response_len=1024,
        fsdp=True,
        **_BF16_FULL,
        stages={
            "sft": {"batch_size": 128},
            "reward": {"batch_size": 64},
            "dpo": {"batch_size": 64},
            "ppo": {"rollout_batch_size": 256, "minibatches": 4},
            "evaluate": {"batch_size": 64},  # per host: 16 sequences on each of its 4 chips
        },
    ),
    "v5e-8-0.5b": RunPreset(
        model="0.5b",
        vocab_size=151936,
        example="Qwen/Qwen2.5-0.5B-Instruct",
        chip="v5e",
        chips=8,
        hosts=1,
        prompt_len=512,
        response_len=512,
        fsdp=True,
        **_BF16_FULL,
        stages={
            "sft": {"batch_size": 32},
            "reward": {"batch_size": 32},
            "dpo": {"batch_size": 32},
            "ppo": {"rollout_batch_size": 64, "minibatches": 4},
            "evaluate": {"batch_size": 64},
        },
    ),
    "v5p-8-7b-lora": RunPreset(
        model="7b",
        vocab_size=32000,
        example="meta-llama/Llama-2-7b-chat-hf",
        chip="v5p",
        chips=4,
        hosts=1,
        prompt_len=1024,
        response_len=1024,
        fsdp=True,  # evaluate's merged float32 models need it; the training stages do not
        **_BF16_FULL,
        lora_rank=16,
        lora_alpha=32.0,  # scale alpha / rank = 2, the usual recipe
        stages={
            "sft": {"batch_size": 32},
            "reward": {"batch_size": 32},
            "dpo": {"batch_size": 32},
            "ppo": {"rollout_batch_size": 64, "minibatches": 4},
            "evaluate": {"batch_size": 64},
        },
    ),
    "v5p-16-qwen3.5-9b": RunPreset(
        model="qwen3.5-9b",
        vocab_size=248320,
        example="Qwen/Qwen3.5-9B",
        chip="v5p",
        chips=8,
        hosts=2,
        prompt_len=1024,
        response_len=1024,
        fsdp=True,
        **_BF16_FULL,
        stages={
            "sft": {"batch_size": 32},
            "reward": {"batch_size": 16},
            "dpo": {"batch_size": 16},
            "ppo": {"rollout_batch_size": 64, "minibatches": 8},
            "evaluate": {"batch_size": 32},  # per host: 8 sequences on each of its 4 chips
        },
    ),
    "v5e-32-qwen3.5-9b-lora": RunPreset(
        model="qwen3.5-9b",
        vocab_size=248320,
        example="Qwen/Qwen3.5-9B",
        chip="v5e",
        chips=32,
        hosts=8,
        prompt_len=512,
        response_len=256,
        fsdp=True,
        **_BF16_FULL,
        lora_rank=16,
        lora_alpha=32.0,
        stages={
            "sft": {"batch_size": 32},
            "reward": {"batch_size": 32},
            "dpo": {"batch_size": 32},
            "ppo": {"rollout_batch_size": 64, "minibatches": 2},
            "evaluate": {"batch_size": 16},  # per host: 4 sequences on each of its 4 chips
        },
    ),
    "v5p-16-gemma4-e4b": RunPreset(
        model="gemma4-e4b",
        vocab_size=262144,
        example="google/gemma-4-E4B-it",
        chip="v5p",
        chips=8,
        hosts=2,
        prompt_len=1024,
        response_len=1024,
        fsdp=True,
        **_BF16_FULL,
        stages={
            "sft": {"batch_size": 32},
            "reward": {"batch_size": 16},
            "dpo": {"batch_size": 16},
            "ppo": {"rollout_batch_size": 64, "minibatches": 8},
            "evaluate": {"batch_size": 32},
        },
    ),
    "v5e-16-gemma4-e4b-lora": RunPreset(
        model="gemma4-e4b",
        vocab_size=262144,
        example="google/gemma-4-E4B-it",
        chip="v5e",
        chips=16,
        hosts=4,
        prompt_len=512,
        response_len=256,
        fsdp=True,
        **_BF16_FULL,
        lora_rank=16,
        lora_alpha=32.0,
        stages={
            "sft": {"batch_size": 32},
            "reward": {"batch_size": 32},
            "dpo": {"batch_size": 32},
            "ppo": {"rollout_batch_size": 64, "minibatches": 2},
            "evaluate": {"batch_size": 16},  # per host: 4 sequences on each of its 4 chips
        },
    ),
    "v5p-64-qwen3-30b-a3b": RunPreset(
        **_QWEN3_30B_A3B,
        chip="v5p",
        chips=32,
        hosts=8,
        prompt_len=1024,
        response_len=1024,
        stages={
            "sft": {"batch_size": 32},
            "reward": {"batch_size": 32},
            "dpo": {"batch_size": 32},
            "ppo": {"rollout_batch_size": 64, "minibatches": 2},
            "evaluate": {"batch_size": 32},
        },
    ),
    "v5p-16-qwen3-30b-a3b-lora": RunPreset(
        **_QWEN3_30B_A3B,
        chip="v5p",
        chips=8,
        hosts=2,
        prompt_len=1024,
        response_len=1024,
        lora_rank=16,
        lora_alpha=32.0,
        stages={
            "sft": {"batch_size": 32},
            "reward": {"batch_size": 32},
            "dpo": {"batch_size": 32},
            "ppo": {"rollout_batch_size": 64, "minibatches": 4},
            "evaluate": {"batch_size": 32},
        },
    ),
    "v5e-128-qwen3-30b-a3b-lora": RunPreset(
        **_QWEN3_30B_A3B,
        chip="v5e",
        chips=128,
        hosts=32,
        prompt_len=512,
        response_len=256,
        lora_rank=16,
        lora_alpha=32.0,
        stages={
            "sft": {"batch_size": 128},
            "reward": {"batch_size": 128},
            "dpo": {"batch_size": 128},
            "ppo": {"rollout_batch_size": 256, "minibatches": 2},
            "evaluate": {"batch_size": 32},  # per host: 8 sequences on each of its 4 chips
        },
    ),
    # Mistral Small 4 with LoRA on its latent projections: no v5e slice holds a gathered
    # layer's 128 experts (3.2e9 parameters) beside the rest; a v5p-64 not evaluate's merged
    # float32 models (93.4 GiB a chip).
    "v5p-128-mistral-small-4-lora": RunPreset(
        model="mistral-small-4",
        vocab_size=131072,
        example="mistralai/Mistral-Small-4-119B-2603",
        chip="v5p",
        chips=64,
        hosts=16,
        prompt_len=1024,
        response_len=1024,
        fsdp=True,
        **_BF16_FULL,
        lora_rank=16,
        lora_alpha=32.0,
        stages={
            "sft": {"batch_size": 64},
            "reward": {"batch_size": 64},
            "dpo": {"batch_size": 64},
            "ppo": {"rollout_batch_size": 128, "minibatches": 2},
            "evaluate": {"batch_size": 32},  # per host: 2 sequences on each of its 4 chips
        },
    ),  # fmt: skip
    "v5e-4-1b-lora": RunPreset(
        model="1b",
        vocab_size=128256,
        example="meta-llama/Llama-3.2-1B-Instruct",
        chip="v5e",
        chips=4,
        hosts=1,
        prompt_len=512,
        response_len=512,
        fsdp=True,  # evaluate's merged float32 models need it; the training stages do not
        **_BF16_FULL,
        lora_rank=16,
        lora_alpha=32.0,
        stages={
            "sft": {"batch_size": 16},
            "reward": {"batch_size": 16},
            "dpo": {"batch_size": 16},
            "ppo": {"rollout_batch_size": 32, "minibatches": 4},
            "evaluate": {"batch_size": 32},
        },
    ),
}
