"""Config groups the stage configs share, free of JAX: reading a default imports no trainer.

Each group is a small kw_only dataclass whose fields a stage config inherits, so every
shared field (its default, its check, its help text) is defined once, here; a stage that
needs another default restates the field with :func:`group_field`, keeping the help.

Structure: a slotted class can have only one base with slot storage, so ``LoRASettings``
(also a value of its own) keeps its slots and the other groups are mixins with empty
``__slots__``; the stage config (``slots=True``) stores every field, and has no ``__dict__``.
Each group's ``__post_init__`` checks its fields; a stage's ``__post_init__`` calls them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

from components.core.flags import field
from components.core.model.adapter_targets import (
    ADAPTER_TARGETS,
    DELTA_TARGETS,
    LATENT_TARGETS,
    LORA_TARGETS,
)

ALL_LINEAR = "all-linear"
# Auto (0) learning rates of a stage that trains adapters: its full fine-tuning rate times
# this. Schulman et al., "LoRA Without Regret" (Thinking Machines, 2025), found LoRA's best
# rate about 10x full fine-tuning's, for supervised and RL training alike, across model
# sizes; measured on the built-in task: benchmarks/bench_lora.py.
LORA_LEARNING_RATE_FACTOR = 10.0


@dataclasses.dataclass(slots=True, kw_only=True)
class LoRASettings:
    """Low-rank adapters (Hu et al. 2021): train A·B·alpha/rank beside each frozen projection."""

    lora_rank: int = field(
        0,
        help="rank of the LoRA adapters on the targeted projections of a stage that starts "
        "from a model (a stage starting from a fresh preset trains every parameter); the base "
        "weights stay frozen (stored in the compute dtype) and only adapters and scalar heads "
        "train; 0 = full fine-tuning",
    )
    lora_alpha: float = field(
        16.0, help="LoRA scale: the adapters' output is multiplied by lora_alpha / lora_rank"
    )
    lora_targets: str = field(
        ALL_LINEAR,
        help="comma-separated projections that get adapters, by their Hugging Face names "
        f"({','.join(LORA_TARGETS)}; in Qwen3.5's DeltaNet layers also "
        f"{','.join(DELTA_TARGETS)}; in Mistral 4's latent attention "
        f"{','.join(LATENT_TARGETS)},o_proj); {ALL_LINEAR} = every one the model has",
    )

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank: {self.lora_rank} must be >= 0 (0 = full fine-tuning)")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha: {self.lora_alpha} must be > 0")
        self.lora_target_modules()

    def auto_rate_factor(self, *, adapting: bool) -> float:
        """What an auto learning rate is multiplied by: LORA_LEARNING_RATE_FACTOR when this
        stage trains adapters on a base (``adapting``), else 1."""
        return LORA_LEARNING_RATE_FACTOR if adapting and self.lora_rank else 1.0

    def lora_target_modules(self) -> tuple[str, ...]:
        """The targeted projections' Hugging Face names, in layer order; refuses unknown ones."""
        names = [n.strip() for n in self.lora_targets.split(",") if n.strip()]
        if names == [ALL_LINEAR]:
            return ADAPTER_TARGETS
        unknown = sorted(set(names) - set(ADAPTER_TARGETS))
        if unknown or not names:
            raise ValueError(
                f"lora_targets: {self.lora_targets!r} names {unknown or 'nothing'}; use "
                f"{ALL_LINEAR} or a comma-separated subset of {','.join(ADAPTER_TARGETS)}"
            )
        return tuple(t for t in ADAPTER_TARGETS if t in names)


def group_field(group: type, name: str, default: Any) -> Any:
    """``group``'s field ``name`` with a stage's own default; the help stays the group's."""
    return field(default, help=group.__dataclass_fields__[name].metadata["help"])


def learning_rate_field(auto: str, *, of: str = "") -> Any:
    """A peak learning rate whose 0 means auto; ``auto`` says what the stage then picks."""
    return field(
        0.0,
        help=f"peak {of}learning rate; 0 = auto: {auto} (times {LORA_LEARNING_RATE_FACTOR:g} "
        "when training LoRA adapters on a base)",
    )


def check_finite(config: Any, allow_inf: tuple[str, ...] = ()) -> None:
    """Refuse nan in any float field of ``config``, and inf outside ``allow_inf`` (fields whose
    help says inf, or for a lower bound -inf, turns a check off): a range check written
    ``value < 0`` lets both through, to fail, or train on nan, much later."""
    for spec in dataclasses.fields(config):
        value = getattr(config, spec.name)
        if isinstance(value, float) and not math.isfinite(value):
            if math.isinf(value) and spec.name in allow_inf:
                continue
            raise ValueError(f"{spec.name}: {value} must be a finite number")


def check_learning_rate(name: str, value: float) -> None:
    """Refuses a negative peak learning rate (0 is auto)."""
    if value < 0:
        raise ValueError(f"{name}: {value} must be > 0, or 0 for auto")


@dataclasses.dataclass(kw_only=True)
class NumericsSettings:
    """How the models compute and where their state lives: remat, compute dtype, fsdp."""

    __slots__ = ()

    remat: Literal["", "none", "full", "dots_saveable"] = field(
        "", help="rematerialisation policy of the layer scan ('' = the model's)"
    )
    dtype: Literal["", "float32", "bfloat16"] = field(
        "",
        help="compute dtype ('' = the model's); trained parameters stay float32 (a LoRA "
        "run's frozen base is stored in the compute dtype)",
    )
    fsdp: bool = field(
        False,
        help="shard parameters, gradients and optimizer state (of every model the stage "
        "holds) over all devices, gathering one layer at a time (ZeRO-3 inside pmap): state "
        "memory per chip / device count",
    )


@dataclasses.dataclass(kw_only=True)
class OptimizerSettings:
    """AdamW's peak rate, warmup and clipping; the stage picks the schedule's shape.

    ``warmup_steps`` and ``max_grad_norm`` are checked by the stage's ``OptimConfig``.
    """

    __slots__ = ()

    learning_rate: float = learning_rate_field("the stage's rate for its starting weights")
    warmup_steps: int = field(30, help="optimizer steps of linear warmup")
    max_grad_norm: float = field(
        1.0, help="global-norm gradient clipping (of each trained model's gradients)"
    )

    def __post_init__(self) -> None:
        check_learning_rate("learning_rate", self.learning_rate)


@dataclasses.dataclass(kw_only=True)
class CheckpointSettings:
    """How often training state is saved, and how many saves are kept."""

    __slots__ = ()

    save_every: int = field(
        100,
        help="checkpoint training state every this many steps (ppo: iterations) and at the "
        "end; a resume, or a ppo guard restoration, goes back to the last one",
    )
    keep_checkpoints: int = field(2, help="training checkpoints kept")

    def __post_init__(self) -> None:
        for name in ("save_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be at least 1")


@dataclasses.dataclass(kw_only=True)
class ReproducibilitySettings:
    """What makes a run repeatable: the seed, and data readers fixed across host counts."""

    __slots__ = ()

    seed: int = field(0, help="random seed: initialisation, data order, sampling")
    data_streams: int = field(
        0,
        help="independent data readers each batch is drawn from, spread over hosts "
        "(0 = one per host); fix it to get the same run on any number of hosts",
    )

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed: {self.seed} must be >= 0")
        if self.data_streams < 0:
            raise ValueError(f"data_streams: {self.data_streams} must be >= 0 (0 = one per host)")


@dataclasses.dataclass(kw_only=True)
class TrackingSettings:
    """Where a stage reports its figures: TensorBoard, W&B, MLflow, Vertex AI Experiments
    (``components/core/training/trackers.py``)."""

    __slots__ = ()

    report_to: str = field(
        "tensorboard",
        help="experiment trackers, comma-separated (TRL's report_to): tensorboard, wandb, "
        "mlflow, vertex; all (those installed) or none. metrics.jsonl is always written",
    )
    tracker_project: str = field(
        "alignpipe", help="W&B project, MLflow experiment, Vertex AI experiment the runs go to"
    )
    vertex_tensorboard: str = field(
        "",
        help="report_to vertex: the Vertex TensorBoard (projects/P/locations/L/tensorboards/ID) "
        "its time series go to; '' = the experiment's default backing TensorBoard",
    )

    def __post_init__(self) -> None:
        from components.core.training.trackers import parse_report_to

        parse_report_to(self.report_to)
        if not self.tracker_project.strip():
            raise ValueError("tracker_project: must not be empty (e.g. alignpipe)")
