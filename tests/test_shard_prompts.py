"""Prompt-only datasets (TRL's ``{"prompt": ...}`` records, standard and conversational)
through the shard stage: columns kept beside the prompt, rejected records with their
reasons and counts conserved, the split by prompt hash, the manifest's kind; the RL
stages' prompt reader takes them, the pair-training stages refuse them by name. And TRL's
prompt-completion records, which train sft alone."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import pytest
import tensorflow as tf

from components.core.data.input_pipeline import DataError, preference_dataset, require_pairs
from components.core.data.prompts import prompt_dataset
from components.core.rewards.builtin import exact_match
from components.shard import ShardConfig, ShardError, run
from components.shard.formats import Invalid, detect_format, to_text_pair
from components.shard.records import decode_example, place, prompt_hash

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"


def _records(count: int) -> list[dict]:
    return [
        {"prompt": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1), "level": i % 3}
        for i in range(count)
    ]


def _write(path: pathlib.Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _examples(output: str) -> list[dict]:
    files = sorted(pathlib.Path(output).glob("*/*.tfrecord"))
    return [
        {**decode_example(bytes(raw)), "split": f.parent.name}
        for f in files
        for raw in tf.data.TFRecordDataset(str(f)).as_numpy_iterator()
    ]


def test_formats_detect_prompt_only_records_and_keep_their_columns():
    assert detect_format({"prompt": "Hi", "answer": "1"}) == "prompt"
    assert detect_format({"prompt": [{"role": "user", "content": "Hi"}]}) == (
        "conversational_prompt"
    )
    # A pair, or a prompt-completion record, is not a prompt alone.
    assert detect_format({"prompt": "Hi", "chosen": "a", "rejected": "b"}) == "explicit"
    assert detect_format({"prompt": "Hi", "completion": "a"}) == "prompt_completion"
    assert detect_format({"prompt": [], "completion": []}) == "conversational_completion"
    # TRL's unpaired preference (KTO) records: sft must not learn the ones labelled bad.
    kto = {"prompt": "Hi", "completion": "Go away.", "label": False}
    with pytest.raises(Invalid, match="unpaired preference \\(KTO\\)"):
        to_text_pair(kto, detect_format(kto), None)
    pair = to_text_pair({"prompt": "Add 2 and 3.", "answer": 5, "tests": ["x"]}, "prompt", None)
    assert pair.prompt_only and pair.prompt == "Add 2 and 3." and not pair.chosen
    assert json.loads(pair.columns) == {"answer": 5, "tests": ["x"]}
    with pytest.raises(Invalid) as empty:
        to_text_pair({"prompt": "  "}, "prompt", None)
    assert empty.value.reason == "empty_prompt"
    with pytest.raises(Invalid) as wrong:
        to_text_pair({"prompt": 7}, "prompt", None)
    assert wrong.value.reason == "wrong_type"


def test_a_prompt_dataset_shards_with_its_columns_and_rejected_records(tmp_path):
    good = _records(60)
    bad = ["{not json", {"prompt": ""}, {"prompt": 3, "answer": "x"}, [1, 2]]
    source = _write(tmp_path / "prompts.jsonl", [*good, good[0], *bad])  # one duplicate
    output = str(tmp_path / "shards")
    config = ShardConfig(num_shards=2, eval_fraction=0.2, min_eval_pairs=1,
                         max_invalid_fraction=0.1)  # fmt: skip
    manifest = run(config, [source], output)
    assert manifest["kind"] == "prompt_shards"
    counts = manifest["counts"]
    assert counts["input_records"] == 65 and counts["duplicates"] == 1
    assert counts["train"] + counts["eval"] == 60 == counts["prompt_only"]
    assert manifest["rejected_by_reason"] == {
        "empty_prompt": 1, "not_json": 1, "not_object": 1, "wrong_type": 1,
    }  # fmt: skip
    rejected = (tmp_path / "shards" / "rejected" / "rejected.jsonl").read_text().splitlines()
    assert len(rejected) == 4 and all(json.loads(line)["reason"] for line in rejected)
    examples = _examples(output)
    assert len(examples) == 60
    by_prompt = {e["prompt"]: e for e in examples}
    for record in good:
        example = by_prompt[record["prompt"]]
        assert example["columns"] == {"answer": record["answer"], "level": record["level"]}
        assert "chosen_ids" not in example and example["prompt_ids"]
        # The split is the prompt hash's, as for pairs.
        hashed = prompt_hash(record["prompt"])
        assert example["prompt_hash"] == hashed
        assert example["split"] == place(hashed, 0.2, 2)[0]
    # The RL stages' prompt reader takes them; the pair-training stages refuse them.
    batches = prompt_dataset(output, "train", batch_size=4, prompt_len=32, seed=0)
    assert next(iter(batches))["prompt_tokens"].shape == (4, 32)
    with pytest.raises(DataError, match="prompt-only records"):
        preference_dataset(output, "train", batch_size=4, max_len=32, seed=0)


def test_gsm8k_rows_shard_as_prompts_with_their_columns_renamed(tmp_path):
    """openai/gsm8k's rows ({"question", "answer"}: a worked solution ending '#### N') match
    no format as written; with columns '{"question": "prompt"}' the file is read as prompts
    (the format detected on the renamed row), the answer kept for builtin/exact-match; a row
    that has a prompt too is rejected (column_clash)."""
    rows = [
        {"question": f"Tom has {i} apples and buys {i + 1}. How many?",
         "answer": f"{i}+{i + 1}=<<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}\n#### {2 * i + 1}"}
        for i in range(40)
    ]  # fmt: skip
    clash = {"question": "q", "prompt": "p", "answer": "1"}
    source = _write(tmp_path / "gsm8k.jsonl", [*rows, clash])
    config = ShardConfig(num_shards=2, eval_fraction=0.2, min_eval_pairs=1,
                         max_invalid_fraction=0.1)  # fmt: skip
    with pytest.raises(ShardError, match="rejected"):  # as written, every row is rejected
        run(config, [source], str(tmp_path / "as_written"))
    config = dataclasses.replace(config, columns='{"question": "prompt"}')
    manifest = run(config, [source], str(tmp_path / "shards"))
    assert manifest["kind"] == "prompt_shards"
    assert manifest["counts"]["prompt_only"] == 40
    assert manifest["rejected_by_reason"] == {"column_clash": 1}
    by_prompt = {e["prompt"]: e for e in _examples(str(tmp_path / "shards"))}
    answers = [by_prompt[r["question"]]["columns"]["answer"] for r in rows]
    assert answers == [r["answer"] for r in rows]
    assert (
        exact_match([""] * 40, [f"so {2 * i + 1}" for i in range(40)], answer=answers) == [1.0] * 40
    )


def test_conversational_prompts_render_up_to_the_models_turn(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": f"Name colour {i}."}], "answer": f"c{i}"}
        for i in range(24)
    ]
    source = _write(tmp_path / "chat.jsonl", rows)
    output = str(tmp_path / "shards")
    config = ShardConfig(
        tokenizer=str(FIXTURES / "qwen3"), num_shards=1, eval_fraction=0.25, min_eval_pairs=1,
        chat_template_kwargs='{"enable_thinking": false}',
    )  # fmt: skip
    manifest = run(config, [source], output)
    assert manifest["kind"] == "prompt_shards"
    assert [s["format"] for s in manifest["sources"]] == ["conversational_prompt"]
    example = _examples(output)[0]
    assert example["prompt"].startswith("<|im_start|>user\nName colour")
    assert example["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert example["columns"]["answer"].startswith("c")


def test_pairs_and_prompts_in_one_output_are_refused(tmp_path):
    pairs = [{"prompt": f"p{i}", "chosen": "good", "rejected": "bad"} for i in range(20)]
    first = _write(tmp_path / "pairs.jsonl", pairs)
    second = _write(tmp_path / "prompts.jsonl", _records(20))
    config = ShardConfig(num_shards=1, eval_fraction=0.2, min_eval_pairs=1)
    with pytest.raises(ShardError, match="mix 20 prompt-only records and 20 preference pairs"):
        run(config, [first, second], str(tmp_path / "shards"))


def test_prompt_completion_records_shard_for_sft_alone(tmp_path):
    """TRL's prompt-completion records: the completion is the one response (``chosen``),
    read by sft's pair reader; the reward and dpo stages refuse them by name."""
    rows = [{"prompt": f"Count to {i}:", "completion": " ".join(map(str, range(i)))}
            for i in range(1, 31)]  # fmt: skip
    source = _write(tmp_path / "sft.jsonl", [*rows, {"prompt": "x", "completion": ""}])
    output = str(tmp_path / "shards")
    config = ShardConfig(num_shards=1, eval_fraction=0.2, min_eval_pairs=1,
                         max_invalid_fraction=0.1)  # fmt: skip
    manifest = run(config, [source], output)
    assert manifest["kind"] == "completion_shards"
    assert manifest["counts"]["completions"] == 30
    assert manifest["rejected_by_reason"] == {"empty_response": 1}
    example = _examples(output)[0]
    assert example["chosen_ids"] and example["rejected_ids"] == []
    assert example["chosen"].strip() and example["rejected"] == ""
    batch = next(iter(preference_dataset(output, "train", batch_size=4, max_len=64, seed=0)))
    assert batch["loss_mask"].sum() > 0  # the completion's tokens are sft's targets
    require_pairs(manifest, output, "sft")
    for stage in ("reward", "dpo"):
        with pytest.raises(DataError, match=f"prompt-completion records .* the {stage} stage"):
            require_pairs(manifest, output, stage)
    pairs = _write(tmp_path / "pairs.jsonl", [
        {"prompt": f"p{i}", "chosen": "good", "rejected": "bad"} for i in range(10)
    ])  # fmt: skip
    with pytest.raises(ShardError, match="mix 30 prompt-completion records and 10 preference"):
        run(config, [source, pairs], str(tmp_path / "mixed"))


def test_messages_records_shard_as_their_last_assistant_turn(tmp_path):
    """TRL's ``{"messages": [...]}`` records (its SFTTrainer's): the last turn, the
    assistant's, is the completion, the turns before it the prompt rendered with the model's
    template, as the same conversation given as prompt and completion; a conversation that
    does not end with the assistant, or is that turn alone, goes to rejected.jsonl."""
    from components.core.data.tokenizers import load_tokenizer

    say = lambda role, text: {"role": role, "content": text}  # noqa: E731
    rows = [
        {"messages": [say("system", "Be brief."), say("user", f"Count to {i}."),
                      say("assistant", "1 2"), say("user", "Go on."),
                      say("assistant", " ".join(map(str, range(i))))]}
        for i in range(3, 23)
    ]  # fmt: skip
    bad = [{"messages": [say("user", "Hi"), say("assistant", "Hello"), say("user", "Bye")]},
           {"messages": [say("assistant", "Hello")]}]  # fmt: skip
    assert detect_format(rows[0]) == "messages"
    # A prompt beside the messages: prompt-only, unless it repeats the first user turn of a
    # conversation the assistant ends (HuggingFaceH4/ultrachat_200k's rows, sft data).
    assert detect_format({"prompt": "Hi", "messages": rows[0]["messages"]}) == "prompt"
    ultrachat = {"prompt": "Count to 3.", "prompt_id": "9e1", **rows[0]}
    assert detect_format(ultrachat) == "messages"
    assert detect_format({**ultrachat, "messages": rows[0]["messages"][:-1]}) == "prompt"
    tokenizer = load_tokenizer(str(FIXTURES / "qwen3"))
    turns = rows[0]["messages"]
    given = {"prompt": turns[:-1], "completion": turns[-1:]}
    pair = to_text_pair(rows[0], "messages", tokenizer)
    assert pair == to_text_pair(given, "conversational_completion", tokenizer)
    # Qwen3's template opens the last assistant turn with an empty think block.
    think = "<think>\n\n</think>\n\n"
    assert pair.prompt.count("<|im_start|>user") == 2 and pair.chosen == f"{think}0 1 2<|im_end|>\n"
    # ShareGPT's conversations: the same record ("human" the user, "gpt" the assistant).
    speakers = {"user": "human", "assistant": "gpt", "system": "system"}
    shared = [{"from": speakers[t["role"]], "value": t["content"]} for t in turns]
    assert detect_format({"conversations": shared}) == "messages"
    assert to_text_pair({"conversations": shared}, "messages", tokenizer) == pair
    source = _write(tmp_path / "chats.jsonl", [*rows, *bad])
    output = str(tmp_path / "shards")
    config = ShardConfig(num_shards=1, eval_fraction=0.2, min_eval_pairs=1,
                         max_invalid_fraction=0.1, tokenizer=str(FIXTURES / "qwen3"))  # fmt: skip
    manifest = run(config, [source], output)
    assert manifest["kind"] == "completion_shards" and manifest["counts"]["completions"] == 20
    assert manifest["rejected_by_reason"] == {"empty_response": 1, "empty_prompt": 1}
    assert {e["chosen"] for e in _examples(output)} == {
        think + " ".join(map(str, range(i))) + "<|im_end|>\n" for i in range(3, 23)
    }


def test_alpaca_records_are_the_conversation_llama_factory_makes_of_them():
    """tatsu-lab/alpaca's ``instruction``/``input``/``output`` (with ``system`` and a
    ``history`` of [query, answer] pairs, as LLaMA-Factory reads them): the instruction and
    the input joined by a newline are the user's turn, after the history; the output is the
    completion."""
    from components.core.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(str(FIXTURES / "qwen3"))
    say = lambda role, text: {"role": role, "content": text}  # noqa: E731
    row = {"instruction": "Add the numbers.", "input": "2 3", "output": "5",
           "system": "Be brief.", "history": [["Hi", "Hello."]]}  # fmt: skip
    assert detect_format(row) == "alpaca"
    turns = [say("system", "Be brief."), say("user", "Hi"), say("assistant", "Hello."),
             say("user", "Add the numbers.\n2 3"), say("assistant", "5")]  # fmt: skip
    expected = to_text_pair({"messages": turns}, "messages", tokenizer)
    assert to_text_pair(row, "alpaca", tokenizer) == expected
    plain = {"instruction": "Add 2 and 3.", "input": "", "output": "5"}
    alone = [say("user", "Add 2 and 3."), say("assistant", "5")]
    assert to_text_pair(plain, "alpaca", tokenizer) == to_text_pair(
        {"messages": alone}, "messages", tokenizer
    )
    for bad in ({**plain, "history": [["Hi"]]}, {**plain, "output": 5}):
        with pytest.raises(Invalid) as refused:
            to_text_pair(bad, "alpaca", tokenizer)
        assert refused.value.reason == "wrong_type"


def test_sft_learns_from_prompt_completion_shards(tmp_path):
    """The built-in task's chosen replies as prompt-completion records: sft trains on them
    (its eval loss falls, and ends well below a uniform guess over the vocabulary)."""
    from components.core.data.builtin_task import generate_pairs
    from components.core.training.checkpoint import read_model_config
    from components.core.training.metrics import read_metrics
    from components.sft import SFTConfig
    from components.sft import run as run_sft

    rows = [{"prompt": p["prompt"], "completion": p["chosen"]} for p in generate_pairs(2000)]
    source = _write(tmp_path / "sft.jsonl", rows)
    shards = str(tmp_path / "shards")
    run(ShardConfig(num_shards=2, tokenizer="builtin-words"), [source], shards)
    out = str(tmp_path / "sft")
    config = SFTConfig(preset="tiny", max_len=24, batch_size=32, steps=40, eval_every=20,
                       save_every=40, learning_rate=3e-3, warmup_steps=5, seed=0)  # fmt: skip
    summary = run_sft(config, shards, out)
    evals = [r["eval/loss"] for r in read_metrics(out) if "eval/loss" in r]
    assert len(evals) == 2 and evals[-1] < evals[0]
    vocab = read_model_config(out)["tokenizer"]["vocab_size"]
    assert summary["eval/loss"] < math.log(vocab) - 1.0  # well below a uniform guess
