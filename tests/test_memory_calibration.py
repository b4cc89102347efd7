"""The planner's train steps (sft, reward, dpo's reference pass and step) within 15% of what
XLA's compiled programs hold, at three shapes that vary vocabulary, length and batch
(tests/memory_shapes.py). The RL algorithms: test_memory_calibration_rl.py."""

from __future__ import annotations

import pytest
from memory_shapes import SHAPES, TOLERANCE, ratios, tiered


@pytest.mark.parametrize("shape", [tiered(shape) for shape in SHAPES])
@pytest.mark.parametrize("algorithm", ["sft", "reward", "dpo"])
def test_the_planner_is_within_15_percent_of_xla(algorithm, shape):
    found = ratios(algorithm, shape)
    assert set(found) == ({"reference", "update"} if algorithm == "dpo" else {"update"})
    for program, ratio in found.items():
        assert abs(ratio - 1) <= TOLERANCE, f"{algorithm} {program} at {shape}: {ratio:.3f}x"


@pytest.mark.parametrize("shape", [tiered("base"), tiered("length and batch x2")])
def test_a_hybrid_stack_is_planned_within_15_percent(shape):
    """Qwen3.5's stack: a period of three Gated DeltaNet layers and one attention layer
    recomputed at once in sft's step. (dpo's reference pass, forward only, is over by
    1.14-1.30x at these shapes: on the safe side, and never the peak.)"""
    found = ratios("sft", shape, hybrid=True)
    assert abs(found["update"] - 1) <= TOLERANCE, f"hybrid sft at {shape}: {found['update']:.3f}x"
