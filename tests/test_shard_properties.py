"""Garbage in: no exception escapes and every line is accounted for; generator label noise."""

import json
import math
import string

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from components.core.data.builtin_task import (
    expected_label_agreement,
    generate_pairs,
    gold_reward,
)
from components.shard.config import ShardConfig
from components.shard.validate import validate_files

KEYS = [
    "prompt",
    "chosen",
    "rejected",
    "margin",
    "input_text",
    "candidate_0",
    "candidate_1",
    "choice",
    "role",
    "content",
]
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)
    ),
    max_leaves=8,
)
json_lines = st.dictionaries(st.sampled_from(KEYS), values, max_size=5).map(json.dumps)
garbage_lines = st.text(alphabet=string.printable.replace("\n", "").replace("\r", ""), max_size=40)
byte_lines = st.binary(max_size=30).filter(lambda b: b"\n" not in b)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    lines=st.lists(st.one_of(json_lines, garbage_lines, byte_lines), min_size=1, max_size=30),
    fmt=st.sampled_from(["auto", "explicit", "implicit", "conversational", "vertex"]),
)
def test_any_lines_are_accounted_for(tmp_path, lines, fmt):
    data = b"\n".join(line if isinstance(line, bytes) else line.encode() for line in lines) + b"\n"
    path = tmp_path / "input.jsonl"
    path.write_bytes(data)
    report = validate_files([str(path)], ShardConfig(format=fmt, max_response_tokens=8))
    blank = sum(1 for line in data.split(b"\n")[:-1] if not line.strip())
    assert report.records + blank == len(data.split(b"\n")) - 1
    assert report.valid + report.duplicates + report.rejected == report.records


def test_generator_labels_agree_with_gold_at_the_rate_the_noise_implies():
    pairs = list(generate_pairs(6000, seed=11))
    agree = sum(p["gold_chosen"] > p["gold_rejected"] for p in pairs) / len(pairs)
    expected = expected_label_agreement(pairs)
    tolerance = 4 * math.sqrt(expected * (1 - expected) / len(pairs))
    assert abs(agree - expected) < tolerance
    assert 0.9 < expected < 0.99  # noisy like human labels, but learnable


def test_gold_reward_documented_values():
    assert gold_reward("Tell me about the river.", "good great river.") == pytest.approx(2 / 3)
    assert gold_reward("Tell me about the river.", "good great.") == 1.0
    assert gold_reward("Tell me about the river.", "bad the.") == -0.5
    assert gold_reward("Describe the lake.", "") == -1.0
    for pair in generate_pairs(50, seed=2):
        assert pair["gold_chosen"] == round(gold_reward(pair["prompt"], pair["chosen"]), 6)


def test_generator_is_deterministic_per_seed():
    assert list(generate_pairs(20, seed=5)) == list(generate_pairs(20, seed=5))
    assert list(generate_pairs(20, seed=5)) != list(generate_pairs(20, seed=6))


def test_an_annotator_of_its_own_changes_only_the_labels():
    """``annotator`` draws the labels on its score: the same responses as gold's labels,
    gold fields unchanged; an annotator crediting "very" picks the response with more of them."""
    plain = list(generate_pairs(400, seed=7, beta=10.0))
    assert list(generate_pairs(400, seed=7, beta=10.0, annotator=gold_reward)) == plain

    def count(response: str) -> int:
        return sum(w.strip(".") == "very" for w in response.split())

    biased = list(generate_pairs(400, seed=7, beta=50.0, annotator=lambda p, r: count(r)))
    assert [p["prompt"] for p in biased] == [p["prompt"] for p in plain]
    assert [{p["chosen"], p["rejected"]} for p in biased] == [
        {p["chosen"], p["rejected"]} for p in plain
    ]
    for pair in biased:
        assert pair["gold_chosen"] == round(gold_reward(pair["prompt"], pair["chosen"]), 6)
    differ = [p for p in biased if count(p["chosen"]) != count(p["rejected"])]
    assert len(differ) > 40
    assert all(count(p["chosen"]) > count(p["rejected"]) for p in differ)
