"""Record formats and every rejection reason, record by record (no Beam)."""

import json
import math

import pytest

from components.core.data.tokenizers import ByteTokenizer
from components.shard.config import ShardConfig
from components.shard.formats import Invalid, detect_format, to_text_pair
from components.shard.invalid import REASONS
from components.shard.messages import with_system_message
from components.shard.records import (
    Rejection,
    TokenPair,
    place,
    process_item,
    prompt_hash,
)

TOKENIZER = ByteTokenizer()


class NoSystemRole(ByteTokenizer):
    """A template that refuses a system role, as Gemma 2's does."""

    chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )


CONFIG = ShardConfig(max_prompt_tokens=32, max_response_tokens=16)


def convert(obj):
    return to_text_pair(obj, detect_format(obj), TOKENIZER)


def test_explicit_format_with_margin():
    pair = convert({"prompt": "Hi?", "chosen": "Yes.", "rejected": "No.", "margin": 1.5})
    assert (pair.prompt, pair.chosen, pair.rejected, pair.margin) == ("Hi?", "Yes.", "No.", 1.5)


def test_implicit_hh_prompt_is_shared_prefix_through_last_shared_assistant_turn():
    shared = "\n\nHuman: Hi\n\nAssistant: Hello\n\nHuman: Tell a joke\n\nAssistant:"
    pair = convert({"chosen": shared + " A pun.", "rejected": shared + " No."})
    assert pair.prompt == shared
    assert (pair.chosen, pair.rejected) == (" A pun.", " No.")


def test_conversational_format_rendered_with_default_template():
    obj = {
        "prompt": [{"role": "user", "content": "Hi"}],
        "chosen": [{"role": "assistant", "content": "Hello!"}],
        "rejected": [{"role": "assistant", "content": "Go away."}],
    }
    pair = convert(obj)
    assert pair.prompt == "<|user|>\nHi\n<|assistant|>\n"
    assert pair.chosen == "Hello!\n" and pair.rejected == "Go away.\n"


def test_conversational_implicit_prompt_is_shared_messages():
    user = {"role": "user", "content": "Hi"}
    obj = {
        "chosen": [user, {"role": "assistant", "content": "Hello!"}],
        "rejected": [user, {"role": "assistant", "content": "Bye."}],
    }
    pair = convert(obj)
    assert pair.prompt.endswith("<|assistant|>\n") and pair.chosen == "Hello!\n"


def test_a_text_prompt_beside_conversations_is_their_shared_turns_as_trl_takes_it():
    """HuggingFaceH4/ultrafeedback_binarized's rows: a text prompt, and chosen and rejected
    that open with the same user turn (TRL's maybe_extract_prompt takes the shared turns)."""
    user = {"role": "user", "content": "What color is the sky?"}
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    explicit = convert({"prompt": [user], "chosen": reply("Blue."), "rejected": reply("Green.")})
    row = {
        "prompt": user["content"], "prompt_id": "0f3a", "chosen": [user, *reply("Blue.")],
        "rejected": [user, *reply("Green.")], "messages": [user, *reply("Blue.")],
        "score_chosen": 8.0, "score_rejected": 5.0,
    }  # fmt: skip
    assert detect_format(row) == "conversational" and convert(row) == explicit
    # Nothing shared: the text is the user's turn (TRL would leave the prompt empty).
    assert convert({**row, "chosen": reply("Blue."), "rejected": reply("Green.")}) == explicit
    with pytest.raises(Invalid, match="field 'prompt' must be list"):
        convert({**row, "prompt": 3})
    # ShareGPT's messages ("human" the user, "gpt" the assistant) say the same.
    share = lambda turns: [  # noqa: E731
        {"from": {"user": "human", "assistant": "gpt"}[t["role"]], "value": t["content"]}
        for t in turns
    ]
    assert convert({k: share(row[k]) for k in ("chosen", "rejected")}) == explicit
    with pytest.raises(Invalid, match="a string 'role' \\(or ShareGPT's 'from' and 'value'\\)"):
        convert({"chosen": [{"value": "Hi"}], "rejected": [{"value": "Yo"}]})


@pytest.mark.parametrize("choice", [0, 1])
def test_vertex_format_choice_picks_chosen(choice):
    obj = {"input_text": "Q", "candidate_0": "zero", "candidate_1": "one", "choice": choice}
    pair = convert(obj)
    assert pair.prompt == "Q"
    assert pair.chosen == ["zero", "one"][choice]
    assert pair.rejected == ["zero", "one"][1 - choice]


GOOD = {"prompt": "Hello there", "chosen": "good answer", "rejected": "bad answer"}
CASES = {
    "not_json": ('{"prompt": ', "explicit"),
    "not_object": ("[1, 2, 3]", "explicit"),
    "unknown_format": ('{"question": "x", "answer": "y"}', None),
    "missing_field": (json.dumps({"prompt": "p", "chosen": "c"}), "explicit"),
    "wrong_type": (json.dumps({**GOOD, "chosen": 7}), "explicit"),
    "no_common_prompt": (json.dumps({"chosen": "abc", "rejected": "xyz"}), "implicit"),
    "empty_prompt": (json.dumps({**GOOD, "prompt": "   "}), "explicit"),
    "empty_response": (json.dumps({**GOOD, "rejected": ""}), "explicit"),
    "identical_responses": (json.dumps({**GOOD, "rejected": "good answer"}), "explicit"),
    "too_long": (json.dumps({**GOOD, "chosen": "x" * 40}), "explicit"),
    "invalid_choice": (
        json.dumps({"input_text": "q", "candidate_0": "a", "candidate_1": "b", "choice": 2}),
        "vertex",
    ),
    "non_finite_margin": (
        '{"prompt": "p", "chosen": "c", "rejected": "r", "margin": NaN}',
        "explicit",
    ),
    "chat_template": (
        json.dumps(
            {
                "prompt": [
                    {"role": "system", "content": "Be kind."},
                    {"role": "user", "content": "Hi"},
                ],
                "chosen": [{"role": "assistant", "content": "Hello!"}],
                "rejected": [{"role": "assistant", "content": "Go."}],
            }
        ),
        "conversational",
    ),
    "unsupported_content": (
        json.dumps(
            {
                "prompt": [{"role": "user", "content": [{"type": "image", "url": "a.png"}]}],
                "chosen": [{"role": "assistant", "content": "A cat."}],
                "rejected": [{"role": "assistant", "content": "A dog."}],
            }
        ),
        "conversational",
    ),
    # With columns '{"question": "prompt"}' (CLASHING), a record that has a prompt too.
    "column_clash": (
        json.dumps({"question": "q", "prompt": "p", "chosen": "a", "rejected": "b"}),
        "explicit",
    ),
}
CLASHING = '{"question": "prompt"}'


def test_every_reason_has_a_case():
    assert set(CASES) == set(REASONS)


@pytest.mark.parametrize("reason", sorted(CASES))
def test_each_rejection_reason(reason):
    raw, fmt = CASES[reason]
    columns = CLASHING if reason == "column_clash" else ""
    config = ShardConfig(
        max_prompt_tokens=32, max_response_tokens=16, too_long="reject", columns=columns
    )
    tokenizer = NoSystemRole() if reason == "chat_template" else TOKENIZER
    result = process_item((7, raw, None, fmt), "data.jsonl", tokenizer, config)
    assert isinstance(result, Rejection)
    assert (result.reason, result.source, result.line, result.raw) == (reason, "data.jsonl", 7, raw)
    assert result.detail


def test_bool_choice_and_bool_margin_are_refused():
    with pytest.raises(Invalid) as choice:
        convert({"input_text": "q", "candidate_0": "a", "candidate_1": "b", "choice": True})
    assert choice.value.reason == "invalid_choice"
    with pytest.raises(Invalid) as margin:
        convert({**GOOD, "margin": True})
    assert margin.value.reason == "wrong_type"


def test_truncation_keeps_prompt_end_and_response_start():
    config = ShardConfig(max_prompt_tokens=8, max_response_tokens=5, too_long="truncate")
    raw = json.dumps({"prompt": "0123456789abc", "chosen": "ABCDEFGH", "rejected": "abcdefgh"})
    pair = process_item((1, raw, None, "explicit"), "f", TOKENIZER, config)
    assert isinstance(pair, TokenPair) and pair.truncated
    assert pair.prompt_ids[0] == TOKENIZER.bos_id and len(pair.prompt_ids) == 8
    assert TOKENIZER.decode(pair.prompt_ids) == "6789abc"
    assert TOKENIZER.decode(pair.chosen_ids) == "ABCDE"  # no eos: marks a cut response
    assert TOKENIZER.eos_id not in pair.chosen_ids


def test_token_layout_bos_prompt_and_eos_responses():
    pair = process_item((1, json.dumps(GOOD), None, "explicit"), "f", TOKENIZER, CONFIG)
    assert pair.prompt_ids == [TOKENIZER.bos_id] + TOKENIZER.encode("Hello there")
    assert pair.chosen_ids == TOKENIZER.encode("good answer") + [TOKENIZER.eos_id]
    assert not pair.truncated


def test_prompt_hash_is_stable_and_normalized():
    assert prompt_hash("Hello  world\n") == prompt_hash("Hello world")
    # A fixed value guards against any change of hashing: shards would move between splits.
    assert prompt_hash("Hello world") == 0x64EC88CA00B268E5 >> 1
    assert 0 <= prompt_hash("x") < 2**63


def test_place_respects_eval_fraction_and_shard_range():
    hashes = [prompt_hash(f"prompt {i}") for i in range(4000)]
    placed = [place(h, 0.25, 5) for h in hashes]
    eval_share = sum(split == "eval" for split, _ in placed) / len(placed)
    assert math.isclose(eval_share, 0.25, abs_tol=0.03)
    assert {shard for _, shard in placed} == set(range(5))
    assert all(split == "train" for split, _ in (place(h, 0.0, 3) for h in hashes))


@pytest.mark.parametrize("mode", ["fold", "drop"])
def test_a_system_message_folds_into_the_first_user_turn_or_drops(mode):
    """For a template without a system role: 'fold' puts its text before the first user
    turn's (as Gemma 3's template does), 'drop' leaves it out; the template then renders."""
    system = {"role": "system", "content": "Be kind."}
    record = json.loads(CASES["chat_template"][0])
    with pytest.raises(Invalid, match="System role not supported"):
        to_text_pair(record, "conversational", NoSystemRole())
    pair = to_text_pair(record, "conversational", NoSystemRole(), system_message=mode)
    expected = "<user>Be kind.\n\nHi\n<assistant>" if mode == "fold" else "<user>Hi\n<assistant>"
    assert pair.prompt == expected and pair.chosen == "Hello!\n"
    assert with_system_message([system], mode) == []


def test_columns_are_renamed_before_the_format_is_read():
    """openai/gsm8k's rows ({"question", "answer"}) as prompt-only records (the answer kept
    for the reward functions), or as sft's prompt-completion records; a swap is a rename."""
    row = {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}
    as_prompts = ShardConfig(columns='{"question": "prompt"}')
    result = process_item(
        (1, json.dumps(row), None, "prompt"), "gsm8k.jsonl", TOKENIZER, as_prompts
    )
    assert isinstance(result, TokenPair)
    assert result.text.prompt == "What is 2+2?"
    assert json.loads(result.text.columns) == {"answer": "2+2=4\n#### 4"}
    config = ShardConfig(columns='{"question": "prompt", "answer": "completion"}')
    renamed = {"prompt": row["question"], "completion": row["answer"]}
    result = process_item((1, json.dumps(row), None, "prompt_completion"), "g", TOKENIZER, config)
    assert result.text == to_text_pair(renamed, "prompt_completion", TOKENIZER)
    swap = ShardConfig(columns='{"chosen": "rejected", "rejected": "chosen"}')
    pair = {"prompt": "p", "chosen": "good", "rejected": "bad"}
    result = process_item((1, json.dumps(pair), None, "explicit"), "s", TOKENIZER, swap)
    assert (result.text.chosen, result.text.rejected) == ("bad", "good")


@pytest.mark.parametrize(
    ("columns", "named"),
    [
        ("question", "not JSON"),
        ('["question"]', "must map column names"),
        ('{"question": ""}', "must map column names"),
        ('{"a": "prompt", "b": "prompt"}', "the same new name"),
    ],
)
def test_bad_columns_are_refused_by_name(columns, named):
    with pytest.raises(ValueError, match=f"columns: .*{named}"):
        ShardConfig(columns=columns)
