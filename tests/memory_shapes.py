"""The calibration shapes of the planner (pipelines/dag/phases.py) against XLA's compiled
programs (pipelines/dag/compiled.py), shared by the two calibration test modules.

Three shapes in bf16 with remat (what the run presets run): a base, four times its
vocabulary, and twice its length and batch on a wider, deeper network. Logits tiles of
2**17 elements (16 positions at vocab 8,192) so the losses run several tiles, as they do at
real vocabularies. Within TOLERANCE of XLA's ``argument + temp`` bytes per device.
"""

from __future__ import annotations

import pytest

from components.core.model.config import ModelConfig
from components.core.model.presets import model_config
from pipelines.dag import compiled, phases

TOLERANCE = 0.15
CHIPS = 8
# name: (vocab, prompt and response tokens each, rows, layers, dim, heads)
SHAPES = {
    "base": (8192, 32, 32, 2, 64, 4),
    "vocab x4": (32768, 32, 32, 2, 64, 4),
    "length and batch x2": (8192, 64, 64, 4, 128, 8),
}


def tiered(*values: str):
    """``values`` (ending in a shape) as a parametrization: the base shape in `make test`,
    the shapes that vary vocabulary, length and batch in the slow tier (`make test-all`)."""
    return pytest.param(*values, marks=() if values[-1] == "base" else pytest.mark.slow)


# The compiled programs and the planner's phases each holds.
PROGRAM_PHASES = {"update": ("train", "update"), "reference": ("reference",),
                  "rollout": ("prefill", "decode", "scoring")}  # fmt: skip


def shape_config(shape: str, *, hybrid: bool = False) -> ModelConfig:
    """The calibration network at ``shape``; ``hybrid``: Qwen3.5's stack of four layers
    (three Gated DeltaNet, one gated attention layer with partial rotary)."""
    vocab, _, _, layers, dim, heads = SHAPES[shape]
    kinds = {}
    if hybrid:
        kinds = dict(
            n_layers=4, layer_types=("linear_attention",) * 3 + ("full_attention",),
            delta_key_heads=2, delta_value_heads=4, delta_key_dim=16, delta_value_dim=16,
            head_dim=16, qk_norm=True, norm_scale_offset=1.0, attn_output_gate=True,
            rotary_fraction=0.25,
        )  # fmt: skip
    return model_config(
        "tiny", vocab, **{
            "dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": 2,
            "hidden_dim": 2 * dim, "max_seq_len": 512, "remat": "full", "dtype": "bfloat16",
            "logits_tile": 2**17, **kinds,
        },
    )  # fmt: skip


def ratios(algorithm: str, shape: str, *, hybrid: bool = False) -> dict[str, float]:
    """The planner's figure over XLA's, per compiled program of ``algorithm`` at ``shape``."""
    config, (_, half, rows, *_) = shape_config(shape, hybrid=hybrid), SHAPES[shape]
    if algorithm in ("sft", "reward", "dpo"):
        flags = {"batch_size": rows, "max_len": 2 * half}
        programs = compiled.train_step(algorithm, config, batch_size=rows, max_len=2 * half)
    else:
        flags = {"rollout_batch_size": rows, "prompt_len": half, "max_new_tokens": half,
                 "minibatches": 2}  # fmt: skip
        programs = compiled.rl_steps(config, algorithm, **flags)
    planned = phases.phases(config, algorithm, flags, phases.Placement(chips=CHIPS))
    found = {}
    for name, figures in programs.items():
        held = [p for p in planned if p.name in PROGRAM_PHASES[name]]
        assert held, (algorithm, name)
        found[name] = max(p.program for p in held) / figures.program
        # What stays beside the program is counted alike (the same tensors, no estimate).
        resident = next(p.resident for p in held)
        assert abs(resident - figures.resident) <= 0.01 * max(figures.resident, 1), name
    return found
