"""The built-in reasoning task (core/data/reasoning_task.py): its problems and split, its
tokenizer against the exact-match reward, and its writers."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from components.core.data import reasoning_task as task
from components.core.rewards.builtin import BUILTIN, extract_answer

EXACT_MATCH = BUILTIN[task.REWARD_FUNCTIONS]


def real_tokenizer(config: task.ArithmeticConfig = task.DEFAULT_CONFIG) -> Tokenizer:
    tokenizer_json, tokenizer_config = task.reasoning_tokenizer_files(config)
    assert json.loads(tokenizer_config)["eos_token"] == "</s>"
    return Tokenizer.from_str(tokenizer_json.decode("utf-8"))


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_default_problem_set_counts_and_answer_range():
    problems = task.all_problems()
    assert len(problems) == 100 + 55  # plus: 10 x 10; minus: left >= right
    assert len(set(problems)) == len(problems)
    assert {p.answer for p in problems} == set(range(19))
    assert task.Problem(7, "plus", 5).prompt == "What is 7 plus 5 ?"
    assert task.Problem(9, "minus", 4).answer == 5
    # Every operation's words and numbers, whichever a config picks: times reaches 81.
    assert len(task.reasoning_vocabulary()) == 3 + len(task.OPERATIONS) + 2 + 82


def test_split_is_deterministic_disjoint_and_by_problem():
    train, held_out = task.split_problems()
    assert (len(train), len(held_out)) == (124, 31)
    assert set(train).isdisjoint(held_out)
    assert set(train) | set(held_out) == set(task.all_problems())
    assert task.split_problems() == (train, held_out)
    other_train, _ = task.split_problems(task.ArithmeticConfig(split_seed=1))
    assert other_train != train


@pytest.mark.parametrize("split_seed", range(12))
def test_every_answer_keeps_a_train_problem(split_seed):
    config = task.ArithmeticConfig(split_seed=split_seed, held_out_fraction=0.5)
    train, held_out = task.split_problems(config)
    assert len(held_out) == round(0.5 * len(task.all_problems(config)))
    assert {p.answer for p in train} == {p.answer for p in task.all_problems(config)}


@pytest.mark.parametrize("operations", [("plus", "minus"), ("plus", "minus", "times")])
def test_vocabulary_covers_every_prompt_and_completion(operations):
    config = task.ArithmeticConfig(operations=operations)
    tokenizer = real_tokenizer(config)
    unk = tokenizer.token_to_id("<unk>")
    for problem in task.all_problems(config):
        for text in (problem.prompt, task.format_completion(problem.answer)):
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            assert unk not in ids, text
            assert len(ids) == len(text.split()), text  # one token per word, tags included


def test_decoded_completion_scores_with_exact_match():
    tokenizer = real_tokenizer()
    eos, pad = tokenizer.token_to_id("</s>"), tokenizer.token_to_id("<pad>")
    problems = task.all_problems()
    prompts = [p.prompt for p in problems]
    # As a rollout decodes it: the completion's ids, then eos and padding, specials dropped.
    decoded = [
        tokenizer.decode(
            tokenizer.encode(task.format_completion(p.answer), add_special_tokens=False).ids
            + [eos, pad],
            skip_special_tokens=True,
        )
        for p in problems
    ]
    assert decoded[0] == task.format_completion(problems[0].answer)
    assert all(
        extract_answer(text) == str(p.answer) for text, p in zip(decoded, problems, strict=True)
    )
    right = [str(p.answer) for p in problems]
    wrong = [str(p.answer + 1) for p in problems]
    assert EXACT_MATCH(prompts, decoded, answer=right) == [1.0] * len(problems)
    assert EXACT_MATCH(prompts, decoded, answer=wrong) == [0.0] * len(problems)


def test_prompt_writer_counts_fields_split_and_seed(tmp_path):
    train, held_out = task.split_problems()
    path = tmp_path / "prompts.jsonl"
    assert task.write_prompts_jsonl(str(path), 300, seed=3) == 300
    records = read_jsonl(path)
    assert len(records) == 300
    assert all(set(r) == {"prompt", "answer"} for r in records)
    answers = {p.prompt: str(p.answer) for p in train}
    assert all(answers[r["prompt"]] == r["answer"] for r in records)  # train problems only
    assert len({r["prompt"] for r in records[: len(train)]}) == len(train)  # a pass each
    again = tmp_path / "again.jsonl"
    task.write_prompts_jsonl(str(again), 300, seed=3)
    assert again.read_bytes() == path.read_bytes()
    task.write_prompts_jsonl(str(again), 300, seed=4)
    assert again.read_bytes() != path.read_bytes()

    task.write_prompts_jsonl(str(again), 10, split="held_out")
    assert {r["prompt"] for r in read_jsonl(again)} <= {p.prompt for p in held_out}


def test_sft_writer_counts_fields_split_and_seed(tmp_path):
    train, _ = task.split_problems()
    answers = {p.prompt: p.answer for p in train}
    path = tmp_path / "sft.jsonl"
    assert task.write_sft_jsonl(str(path), seed=5) == task.SFT_COUNT
    records = read_jsonl(path)
    assert len(records) == task.SFT_COUNT
    assert all(set(r) == {"prompt", "completion"} for r in records)
    assert len({r["prompt"] for r in records}) == task.SFT_COUNT  # distinct problems
    for record in records:  # train problems only, each with its right solution
        assert record["completion"] == task.format_completion(answers[record["prompt"]])
    again = tmp_path / "again.jsonl"
    task.write_sft_jsonl(str(again), seed=5)
    assert again.read_bytes() == path.read_bytes()
    assert task.write_sft_jsonl(str(again), 0) == 0 and again.read_text() == ""


def test_records_through_the_shard_stage_and_back(tmp_path):
    """As the pipeline reads them: the shard stage's formats and tokenization with the
    project's tokenizer, then a rollout's decode of the completion, scored."""
    from components.core.data.tokenizers import HFTokenizer
    from components.shard.config import ShardConfig
    from components.shard.formats import detect_format, to_text_pair
    from components.shard.records import tokenize

    tokenizer = HFTokenizer(*task.reasoning_tokenizer_files())
    config = ShardConfig(max_prompt_tokens=8, max_response_tokens=4, too_long="reject")
    prompts, sft = tmp_path / "prompts.jsonl", tmp_path / "sft.jsonl"
    task.write_prompts_jsonl(str(prompts), 5)
    task.write_sft_jsonl(str(sft), 5)
    for record in read_jsonl(prompts):
        pair = to_text_pair(record, detect_format(record), tokenizer)
        assert pair.prompt_only and json.loads(pair.columns) == {"answer": record["answer"]}
        prompt_ids, _, _, truncated = tokenize(pair, tokenizer, config)
        assert prompt_ids[0] == tokenizer.bos_id and len(prompt_ids) == 7 and not truncated
    for record in read_jsonl(sft):
        assert detect_format(record) == "prompt_completion"
        pair = to_text_pair(record, "prompt_completion", tokenizer)
        _, completion_ids, _, _ = tokenize(pair, tokenizer, config)
        assert len(completion_ids) == 4 and completion_ids[-1] == tokenizer.eos_id
        answer = str(task.Problem(*_operands(record["prompt"])).answer)
        decoded = tokenizer.decode(completion_ids + [tokenizer.pad_id])
        assert EXACT_MATCH([pair.prompt], [decoded], answer=[answer]) == [1.0]


def _operands(prompt: str) -> tuple[int, str, int]:
    _, _, left, operation, right, _ = prompt.split()
    return int(left), operation, int(right)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_operand": 0}, "max_operand"),
        ({"operations": ("plus", "divide")}, "operations"),
        ({"operations": ()}, "operations"),
        ({"held_out_fraction": 1.0}, "held_out_fraction"),
    ],
)
def test_config_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        task.ArithmeticConfig(**kwargs)


def test_writer_errors_name_the_input(tmp_path):
    path = str(tmp_path / "out.jsonl")
    with pytest.raises(ValueError, match="count must be in 0..124"):
        task.write_sft_jsonl(path, 125)
    with pytest.raises(ValueError, match="split must be one of"):
        task.write_prompts_jsonl(path, 5, split="eval")
    empty_held_out = task.ArithmeticConfig(held_out_fraction=0.0)
    with pytest.raises(ValueError, match="split is empty"):
        task.write_prompts_jsonl(path, 5, split="held_out", config=empty_held_out)
