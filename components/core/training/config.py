"""The configuration every training stage (sft, reward, dpo) shares, free of JAX.

Reading its defaults, building flags or pipeline parameters imports no trainer: the
optimizer, checkpoint and device-count parts are imported where a method needs them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, ClassVar, Literal

from components.core.config import (
    CheckpointSettings,
    LoRASettings,
    NumericsSettings,
    OptimizerSettings,
    ReproducibilitySettings,
    TrackingSettings,
    check_finite,
    learning_rate_field,
)
from components.core.flags import field

if TYPE_CHECKING:
    from components.core.training.checkpoint import CheckpointConfig
    from components.core.training.optim import OptimConfig

# Peak learning rates of ``learning_rate = 0`` (auto). Models trained from random weights
# (the built-in task's presets) learn at 1e-3; that rate wrecks imported or pretrained
# weights within a few steps, which fine-tune at 1e-5.
FROM_SCRATCH_LEARNING_RATE = 1e-3
PRETRAINED_LEARNING_RATE = 1e-5


@dataclasses.dataclass(slots=True, kw_only=True)
class TrainConfig(
    LoRASettings,
    NumericsSettings,
    OptimizerSettings,
    CheckpointSettings,
    ReproducibilitySettings,
    TrackingSettings,
):
    """What every training stage shares: model shape, batch, schedule, checkpoints."""

    # (from scratch, pretrained) peak rates of learning_rate = 0; a stage's config may differ.
    AUTO_LEARNING_RATES: ClassVar[tuple[float, float]] = (
        FROM_SCRATCH_LEARNING_RATE,
        PRETRAINED_LEARNING_RATE,
    )

    preset: str = field("demo", help="model preset when starting fresh: tiny, demo, 1b, 2b, 7b")
    max_len: int = field(
        0,
        help="tokens per sequence (prompt + response), padded or cut; 0 = the longest in the data",
    )
    batch_size: int = field(64, help="global batch per step over all devices and hosts")
    steps: int = field(300, help="optimizer steps")
    learning_rate: float = learning_rate_field(
        f"{PRETRAINED_LEARNING_RATE:g} when base_policy holds pretrained weights (a Hugging Face "
        f"folder, or a model descended from one), else {FROM_SCRATCH_LEARNING_RATE:g}"
    )
    decay: Literal["cosine", "linear", "constant"] = field("cosine", help="decay after warmup")
    weight_decay: float = field(0.0, help="AdamW weight decay")
    eval_every: int = field(100, help="evaluate every this many steps (and at the end)")
    eval_batches: int = field(0, help="eval batches per evaluation (0 = the whole eval split)")
    max_nonfinite_steps: int = field(5, help="abort after this many non-finite steps in a row")

    def __post_init__(self) -> None:
        check_finite(self)
        LoRASettings.__post_init__(self)
        OptimizerSettings.__post_init__(self)
        CheckpointSettings.__post_init__(self)
        ReproducibilitySettings.__post_init__(self)
        TrackingSettings.__post_init__(self)
        if self.max_len < 0:
            raise ValueError(f"max_len: {self.max_len} must be >= 0 (0 = from the data)")
        for name in ("batch_size", "steps", "eval_every", "max_nonfinite_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: {getattr(self, name)} must be at least 1")
        if self.data_streams and self.batch_size % self.data_streams:
            raise ValueError(
                f"batch_size: {self.batch_size} must be a multiple of data_streams "
                f"({self.data_streams}); change one of them"
            )
        if self.eval_batches < 0:
            raise ValueError(f"eval_batches: {self.eval_batches} must be >= 0 (0 = all)")
        # Validates the optimizer fields with their own messages.
        self._optim(self.peak_learning_rate(pretrained=False))

    def peak_learning_rate(self, *, pretrained: bool) -> float:
        """``learning_rate``, or when it is 0 (auto) the rate for the starting weights."""
        if self.learning_rate:
            return self.learning_rate
        from_scratch, from_pretrained = self.AUTO_LEARNING_RATES
        return from_pretrained if pretrained else from_scratch

    def resolved(self, *, pretrained: bool, adapting: bool = False) -> TrainConfig:
        """This config with an auto learning rate made concrete for the starting weights
        (times the LoRA factor when the stage trains adapters on a base: ``adapting``)."""
        rate = self.learning_rate
        if not rate:
            rate = self.peak_learning_rate(pretrained=pretrained)
            rate *= self.auto_rate_factor(adapting=adapting)
        return dataclasses.replace(self, learning_rate=rate)

    def optim(self) -> OptimConfig:
        """The optimizer config; an auto learning rate must be :meth:`resolved` first."""
        if not self.learning_rate:
            raise ValueError(
                "learning_rate: 0 (auto) depends on the starting model; call resolved() first"
            )
        return self._optim(self.learning_rate)

    def _optim(self, learning_rate: float) -> OptimConfig:
        from components.core.training.optim import OptimConfig

        return OptimConfig(
            learning_rate=learning_rate,
            warmup_steps=min(self.warmup_steps, self.steps),
            decay=self.decay,
            total_steps=self.steps,
            weight_decay=self.weight_decay,
            max_grad_norm=self.max_grad_norm,
        )

    def checkpoint(self) -> CheckpointConfig:
        from components.core.training.checkpoint import CheckpointConfig

        return CheckpointConfig(save_every=self.save_every, keep=self.keep_checkpoints)

    def per_host_batch(self) -> int:
        """This host's share of the global batch; refuses one that does not split evenly."""
        import jax

        devices, hosts = jax.device_count(), jax.process_count()
        if self.batch_size % devices:
            nearest = max(devices, self.batch_size // devices * devices)
            raise ValueError(
                f"batch_size: {self.batch_size} does not split over {devices} devices; "
                f"use a multiple of {devices} (e.g. {nearest})"
            )
        return self.batch_size // hosts
