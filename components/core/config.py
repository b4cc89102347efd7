"""Config groups the stage configs share, free of JAX: reading a default imports no trainer.

Each group is a small kw_only dataclass whose fields a stage config inherits, so every
shared field (its default, its check, its help text) is defined once, here.
"""

from __future__ import annotations

import dataclasses

from components.core.flags import field

# Hugging Face's names of the projections an adapter can wrap (PEFT's target_modules),
# in the order of a decoder layer.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"


@dataclasses.dataclass(slots=True, kw_only=True)
class LoRASettings:
    """Low-rank adapters (Hu et al. 2021): train A·B·alpha/rank beside each frozen projection."""

    lora_rank: int = field(
        0,
        help="rank of the LoRA adapters on the targeted projections; the base weights stay "
        "frozen (stored in the compute dtype) and only adapters and scalar heads train; "
        "0 = full fine-tuning",
    )
    lora_alpha: float = field(
        16.0, help="LoRA scale: the adapters' output is multiplied by lora_alpha / lora_rank"
    )
    lora_targets: str = field(
        ALL_LINEAR,
        help="comma-separated projections that get adapters, by their Hugging Face names "
        f"({','.join(LORA_TARGETS)}); {ALL_LINEAR} = all seven",
    )

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank: {self.lora_rank} must be >= 0 (0 = full fine-tuning)")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha: {self.lora_alpha} must be > 0")
        self.lora_target_modules()

    def lora_target_modules(self) -> tuple[str, ...]:
        """The targeted projections' Hugging Face names, in layer order; refuses unknown ones."""
        names = [n.strip() for n in self.lora_targets.split(",") if n.strip()]
        if names == [ALL_LINEAR]:
            return LORA_TARGETS
        unknown = sorted(set(names) - set(LORA_TARGETS))
        if unknown or not names:
            raise ValueError(
                f"lora_targets: {self.lora_targets!r} names {unknown or 'nothing'}; use "
                f"{ALL_LINEAR} or a comma-separated subset of {','.join(LORA_TARGETS)}"
            )
        return tuple(t for t in LORA_TARGETS if t in names)
