"""The planner's RL phases (the rollout's prefill, decode and scoring in one program, the
update) within 15% of what XLA's compiled programs hold, for ppo with its critic and grpo
and rloo without, at three shapes that vary vocabulary, length and batch
(tests/memory_shapes.py; the base one in `make test`). rloo's programs differ from grpo's only
in the advantages' formula: one shape, in the slow tier."""

from __future__ import annotations

import pytest
from memory_shapes import SHAPES, TOLERANCE, ratios, tiered

CASES = [tiered(a, s) for a in ("ppo", "grpo") for s in SHAPES] + [
    pytest.param("rloo", "base", marks=pytest.mark.slow)
]


@pytest.mark.parametrize(("algorithm", "shape"), CASES)
def test_the_planner_is_within_15_percent_of_xla(algorithm, shape):
    found = ratios(algorithm, shape)
    assert set(found) == {"rollout", "update"}
    for program, ratio in found.items():
        assert abs(ratio - 1) <= TOLERANCE, f"{algorithm} {program} at {shape}: {ratio:.3f}x"


@pytest.mark.parametrize("shape", [tiered("length and batch x2")])
def test_a_hybrid_stack_is_planned_within_15_percent(shape):
    """Qwen3.5's stack (Gated DeltaNet periods): PPO's rollout and update, whose two
    networks' hybrid passes XLA:CPU runs side by side (phases.py counts both); at the larger
    shape only (the base one, 56 s more, is sft's in test_memory_calibration.py)."""
    found = ratios("ppo", shape, hybrid=True)
    for program, ratio in found.items():
        assert abs(ratio - 1) <= TOLERANCE, f"hybrid ppo {program} at {shape}: {ratio:.3f}x"
