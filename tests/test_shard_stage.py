"""The shard stage end to end on real Beam (DirectRunner): conservation, shards, determinism."""

import dataclasses
import hashlib
import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow as tf

from components.core.data.builtin_task import GOLD_REWARD_NAME, generate_pairs
from components.shard import ShardConfig, ShardError, run
from components.shard.records import decode_example, place, prompt_hash, split_position
from components.shard.sources import InputError

NUM_SHARDS = 4
BAD_LINES = [
    "{not json",
    "[1, 2]",
    '{"prompt": "p", "chosen": "c"}',
    '{"prompt": "p", "chosen": 1, "rejected": "r"}',
]


def _write_inputs(folder):
    pairs = list(generate_pairs(300, seed=3))
    explicit = [json.dumps(p) for p in pairs] + [json.dumps(pairs[0]), json.dumps(pairs[1])]
    explicit[10:10] = BAD_LINES + [""]  # bad records and a blank line in the middle
    (folder / "explicit.jsonl").write_text("\n".join(explicit) + "\n")
    hh = [
        {
            "chosen": f"\n\nHuman: q{i}?\n\nAssistant: fine {i}",
            "rejected": f"\n\nHuman: q{i}?\n\nAssistant: bad",
        }
        for i in range(20)
    ]
    (folder / "hh.jsonl").write_text("\n".join(json.dumps(r) for r in hh) + "\n")
    conv = [
        {
            "prompt": [{"role": "user", "content": f"hello {i}"}],
            "chosen": [{"role": "assistant", "content": "kind words"}],
            "rejected": [{"role": "assistant", "content": "harsh words"}],
        }
        for i in range(15)
    ]
    (folder / "conv.jsonl").write_text("\n".join(json.dumps(r) for r in conv) + "\n")
    vertex = {
        "input_text": [f"question {i}" for i in range(25)],
        "candidate_0": ["yes"] * 25,
        "candidate_1": ["no"] * 25,
        "choice": [i % 2 for i in range(25)],
    }
    pq.write_table(pa.table(vertex), folder / "vertex.parquet")
    return 302 + len(BAD_LINES) + 20 + 15 + 25  # records (blank lines are not records)


def _shard_files(output):
    files = {}
    for split in ("train", "eval"):
        for name in sorted(os.listdir(os.path.join(output, split))):
            with open(os.path.join(output, split, name), "rb") as handle:
                files[f"{split}/{name}"] = handle.read()
    return files


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    expected_records = _write_inputs(folder)
    outputs = {}
    for name, workers in (("first", 1), ("second", 1), ("two_workers", 2)):
        out = str(tmp_path_factory.mktemp(name))
        cfg = ShardConfig(
            num_shards=NUM_SHARDS, eval_fraction=0.2, max_invalid_fraction=0.1, num_workers=workers
        )
        outputs[name] = (out, run(cfg, [str(folder / "*.jsonl"), str(folder / "*.parquet")], out))
    return folder, expected_records, outputs


def test_counts_add_up(sharded):
    _, expected_records, outputs = sharded
    counts = outputs["first"][1]["counts"]
    assert counts["input_records"] == expected_records
    assert counts["blank_lines"] == 1
    assert counts["rejected"] == len(BAD_LINES)
    assert counts["duplicates"] == 2
    assert (
        counts["train"] + counts["eval"] + counts["rejected"] + counts["duplicates"]
        == expected_records
    )
    assert counts["eval"] > 0 and counts["train"] > counts["eval"]


def test_manifest_records_sources_tokenizer_shards_and_lengths(sharded):
    folder, _, outputs = sharded
    out, manifest = outputs["first"]
    assert json.loads(open(os.path.join(out, "manifest.json")).read()) == manifest
    by_uri = {os.path.basename(s["uri"]): s for s in manifest["sources"]}
    assert set(by_uri) == {"explicit.jsonl", "hh.jsonl", "conv.jsonl", "vertex.parquet"}
    data = (folder / "explicit.jsonl").read_bytes()
    assert by_uri["explicit.jsonl"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert by_uri["explicit.jsonl"]["bytes"] == len(data)
    assert {s["format"] for s in by_uri.values()} == {
        "explicit",
        "implicit",
        "conversational",
        "vertex",
    }
    assert manifest["tokenizer"]["kind"] == "byte"
    assert manifest["tokenizer"]["pad_id"] != manifest["tokenizer"]["eos_id"]
    assert manifest["rejected_by_reason"] == {
        "missing_field": 1,
        "not_json": 1,
        "not_object": 1,
        "wrong_type": 1,
    }
    assert manifest["gold_reward"] is None  # only part of the data declares it
    for split in ("train", "eval"):
        info = manifest["splits"][split]
        assert len(info["shards"]) == NUM_SHARDS
        assert sum(s["pairs"] for s in info["shards"]) == info["pairs"]
        assert 0 < info["balance"]["min_max_ratio"] <= 1
        lengths = info["token_lengths"]["prompt"]
        assert 0 < lengths["p50"] <= lengths["p90"] <= lengths["p99"] <= lengths["max"]
    assert os.path.exists(os.path.join(out, "tokenizer", "alignpipe_tokenizer.json"))


def test_rejected_file_keeps_every_bad_record_with_source_line_reason_raw(sharded):
    out, _ = sharded[2]["first"]
    rows = [json.loads(line) for line in open(os.path.join(out, "rejected", "rejected.jsonl"))]
    assert [r["raw"] for r in rows] == BAD_LINES
    assert [r["line"] for r in rows] == [11, 12, 13, 14]
    assert all(r["source"].endswith("explicit.jsonl") and r["reason"] and r["detail"] for r in rows)


def _read_split(out, split):
    feature = {
        "prompt_ids": tf.io.RaggedFeature(tf.int64),
        "chosen_ids": tf.io.RaggedFeature(tf.int64),
        "rejected_ids": tf.io.RaggedFeature(tf.int64),
        "prompt": tf.io.FixedLenFeature([], tf.string),
        "chosen": tf.io.FixedLenFeature([], tf.string),
        "rejected": tf.io.FixedLenFeature([], tf.string),
        "margin": tf.io.FixedLenFeature([], tf.float32),
        "prompt_hash": tf.io.FixedLenFeature([], tf.int64),
    }
    by_shard = {}
    for name in sorted(os.listdir(os.path.join(out, split))):
        dataset = tf.data.TFRecordDataset(os.path.join(out, split, name)).map(
            lambda x: tf.io.parse_single_example(x, feature)
        )
        by_shard[name] = list(dataset.as_numpy_iterator())
    return by_shard


def test_shards_readable_with_tf_data_and_prompts_never_span_splits_or_shards(sharded):
    out, manifest = sharded[2]["first"]
    names = {}
    for split in ("train", "eval"):
        by_shard = _read_split(out, split)
        assert sorted(by_shard) == [
            f"shard-{i:05d}-of-{NUM_SHARDS:05d}.tfrecord" for i in range(NUM_SHARDS)
        ]
        assert sum(len(v) for v in by_shard.values()) == manifest["counts"][split]
        for shard, records in by_shard.items():
            for record in records:
                names.setdefault(int(record["prompt_hash"]), set()).add((split, shard))
                ids = record["chosen_ids"]
                assert ids[-1] == manifest["tokenizer"]["eos_id"]
    assert all(len(places) == 1 for places in names.values())


def test_same_output_on_rerun_and_with_two_workers(sharded):
    outputs = sharded[2]
    first = _shard_files(outputs["first"][0])
    assert first == _shard_files(outputs["second"][0])
    assert first == _shard_files(outputs["two_workers"][0])
    rejected = [
        open(os.path.join(o, "rejected", "rejected.jsonl")).read() for o, _ in outputs.values()
    ]
    assert rejected[0] == rejected[1] == rejected[2]


def test_examples_round_trip_text_and_ids(sharded):
    out, _ = sharded[2]["first"]
    path = os.path.join(out, "train", f"shard-00000-of-{NUM_SHARDS:05d}.tfrecord")
    record = decode_example(next(iter(tf.data.TFRecordDataset(path))).numpy())
    from components.core.data.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    assert tok.decode(record["prompt_ids"]) == record["prompt"]
    assert tok.decode(record["chosen_ids"]) == record["chosen"]


def test_threshold_failure_writes_no_manifest_and_names_the_fix(tmp_path):
    lines = [json.dumps(p) for p in generate_pairs(20, seed=1)] + BAD_LINES * 2
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    with pytest.raises(ShardError, match="max_invalid_fraction") as error:
        run(ShardConfig(num_shards=2), [str(tmp_path / "bad.jsonl")], str(out))
    assert "rejected.jsonl" in str(error.value)
    assert not (out / "manifest.json").exists()
    assert len((out / "rejected" / "rejected.jsonl").read_text().splitlines()) == 8


def test_nothing_valid_is_an_error(tmp_path):
    (tmp_path / "junk.jsonl").write_text("\n".join(BAD_LINES) + "\n")
    with pytest.raises(ShardError, match="no valid preference pair"):
        run(
            ShardConfig(num_shards=2, max_invalid_fraction=1.0),
            [str(tmp_path / "junk.jsonl")],
            str(tmp_path / "o"),
        )


def test_unmatched_input_is_an_error(tmp_path):
    with pytest.raises(InputError, match="matches no file"):
        run(ShardConfig(), [str(tmp_path / "missing-*.jsonl")], str(tmp_path / "o"))
    (tmp_path / "data").mkdir()
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "kept").write_text("")
    # A folder is a Hugging Face dataset; one with no data file is refused before anything
    # runs: the output folder keeps what it held.
    with pytest.raises(InputError, match=r"data'? holds no data file .* pass the files"):
        run(ShardConfig(), [str(tmp_path / "data")], str(tmp_path / "o"))
    assert os.listdir(tmp_path / "o") == ["kept"]


def test_builtin_task_declares_its_gold_reward(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(p) for p in generate_pairs(50)) + "\n")
    config = ShardConfig(num_shards=2, min_eval_pairs=0)  # 50 pairs: ~5 in eval
    manifest = run(config, [str(tmp_path / "p.jsonl")], str(tmp_path / "o"))
    assert manifest["gold_reward"] == GOLD_REWARD_NAME


def _train_only_prompts(count: int, eval_fraction: float) -> list[str]:
    """``count`` prompts whose hashes all place them in train at ``eval_fraction``."""
    prompts = (f"question {i}" for i in range(10_000))
    chosen = [p for p in prompts if place(prompt_hash(p), eval_fraction, 1)[0] == "train"]
    return chosen[:count]


def test_eval_split_below_one_batch_is_refused_naming_the_eval_fraction_that_fits(tmp_path):
    """The new user's data: 3,000 pairs over 32 prompts, none of which landed in eval."""
    prompts = _train_only_prompts(32, 0.05)
    lines = [
        json.dumps({"prompt": prompts[i % 32], "chosen": f"yes {i}", "rejected": f"no {i}"})
        for i in range(3000)
    ]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    config = ShardConfig(num_shards=2, eval_fraction=0.05, min_eval_pairs=64)
    with pytest.raises(ShardError) as error:
        run(config, [str(tmp_path / "p.jsonl")], str(out))
    message = str(error.value)
    assert "eval split has 0 pairs (32 unique prompts, eval_fraction 0.05)" in message
    assert "fewer than min_eval_pairs 64" in message and "add prompts" in message
    assert not (out / "manifest.json").exists()  # nothing downstream can start from it
    assert (out / "rejected" / "summary.json").exists()
    # The fraction named is the least that holds 64 pairs: the lowest-placed prompt's 94.
    lowest = min(split_position(prompt_hash(p)) for p in prompts)
    least = math.ceil((lowest + 1) / 2**32 * 1e4) / 1e4
    assert f"Raise eval_fraction to at least {least:g} or add prompts" in message
    fixed = run(
        dataclasses.replace(config, eval_fraction=least), [str(tmp_path / "p.jsonl")], str(out)
    )
    assert fixed["counts"]["eval"] >= 64 and (out / "manifest.json").exists()


def test_too_little_data_for_any_eval_fraction_says_add_prompts(tmp_path):
    lines = [json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) for i in range(5)]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ShardError, match="No eval_fraction below 1 holds that many pairs"):
        run(ShardConfig(num_shards=1), [str(tmp_path / "p.jsonl")], str(tmp_path / "o"))
    config = ShardConfig(num_shards=1, min_eval_pairs=0)  # 0: no minimum
    counts = run(config, [str(tmp_path / "p.jsonl")], str(tmp_path / "o"))["counts"]
    assert counts["train"] + counts["eval"] == 5


def test_records_python_cannot_read_or_encode_are_rejected_not_fatal(tmp_path):
    """Each of these once stopped the Beam job (an unpicklable rejection, an exception no
    check caught) instead of going to the rejected file with its reason."""
    good = [json.dumps(p).encode() for p in generate_pairs(60, seed=5)]
    bad = {
        b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}': "not_json",  # not UTF-8
        b'{"prompt": "p", "chosen": "a", "rejected": "b", "n": ' + b"7" * 5000 + b"}": "not_json",
        b'{"prompt": "p \\ud800", "chosen": "a", "rejected": "b"}': "not_json",  # lone surrogate
        b'{"prompt": "p", "chosen": "a", "rejected": "b", "margin": ' + b"9" * 400 + b"}": (
            "non_finite_margin"
        ),
        b'{"prompt": "p", "chosen": "a", "rejected": "b", "margin": 1e39}': "non_finite_margin",
    }
    (tmp_path / "in.jsonl").write_bytes(b"\n".join(good + list(bad)) + b"\n")
    config = ShardConfig(num_shards=2, max_invalid_fraction=0.1, min_eval_pairs=0)
    manifest = run(config, [str(tmp_path / "in.jsonl")], str(tmp_path / "o"))
    assert manifest["counts"]["rejected"] == len(bad)
    rows = [json.loads(line) for line in open(tmp_path / "o" / "rejected" / "rejected.jsonl")]
    assert [r["line"] for r in rows] == list(range(61, 61 + len(bad)))
    assert [r["reason"] for r in rows] == list(bad.values())
    assert "UTF-8" in rows[0]["detail"] and "Unicode" in rows[2]["detail"]
    assert "float32" in rows[4]["detail"] and "400 digits" in rows[3]["detail"]
