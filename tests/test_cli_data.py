"""``alignpipe data generate | shard | validate`` as a user runs them."""

import json
import os

import pytest

from pipelines.cli.main import main


def test_generate_then_shard_writes_eight_shards_per_split(tmp_path, capsys):
    data, out = tmp_path / "p.jsonl", tmp_path / "shards"
    assert main(["data", "generate", "--out", str(data), "--pairs", "400", "--seed", "1"]) == 0
    assert len(data.read_text().splitlines()) == 400
    code = main(["data", "shard", "--input", str(data), "--output", str(out), "--num-shards", "8"])
    assert code == 0
    for split in ("train", "eval"):
        assert len(os.listdir(out / split)) == 8
    manifest = json.loads((out / "manifest.json").read_text())
    counts = manifest["counts"]
    assert counts["train"] + counts["eval"] + counts["rejected"] + counts["duplicates"] == 400
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["train"] == counts["train"]


def test_shard_passes_unknown_options_to_beam(tmp_path):
    data = tmp_path / "p.jsonl"
    main(["data", "generate", "--out", str(data), "--pairs", "50"])
    args = [
        "data",
        "shard",
        "--input",
        str(data),
        "--output",
        str(tmp_path / "o"),
        "--num-shards",
        "2",
        "--min-eval-pairs",
        "0",  # 50 pairs: a handful in eval
    ]
    assert main(args + ["--direct_runner_bundle_repeat=0"]) == 0


def test_validate_prints_counts_per_reason_and_fails_above_threshold(tmp_path, capsys):
    good = [json.dumps({"prompt": f"q{i}", "chosen": "yes", "rejected": "no"}) for i in range(10)]
    bad = ["not json", "[]", '{"prompt": "q", "chosen": "a", "rejected": "a"}']
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(good + bad) + "\n")
    assert main(["data", "validate", str(path)]) == 1
    out = capsys.readouterr().out
    assert "rejected 3" in out and "FAIL" in out
    for reason in ("not_json", "not_object", "identical_responses"):
        assert reason in out
    lenient = ["--max-invalid-fraction", "0.5", "--min-eval-pairs", "0"]
    assert main(["data", "validate", str(path), *lenient]) == 0
    assert not any(p.name != "mixed.jsonl" for p in tmp_path.iterdir())  # wrote nothing


def test_validate_fails_an_eval_split_the_shard_stage_would_refuse(tmp_path, capsys):
    lines = [
        json.dumps({"prompt": f"q{i % 20}", "chosen": f"yes {i}", "rejected": f"no {i}"})
        for i in range(400)
    ]
    path = tmp_path / "few_prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert main(["data", "validate", str(path), "--eval-fraction", "0"]) == 1
    out = capsys.readouterr().out
    assert "eval split 0 pairs of 20 unique prompts (min_eval_pairs 8)" in out
    assert "Raise eval_fraction to at least" in out and "FAIL" in out
    # The fraction it names is enough: validate and shard then both accept the data.
    least = out.split("Raise eval_fraction to at least ")[1].split()[0]
    assert main(["data", "validate", str(path), "--eval-fraction", least]) == 0
    shard = ["data", "shard", "--input", str(path), "--output", str(tmp_path / "o")]
    assert main([*shard, "--num-shards", "2", "--eval-fraction", least]) == 0


def test_validate_missing_file_is_a_clear_error(tmp_path, capsys):
    assert main(["data", "validate", str(tmp_path / "none.jsonl")]) == 2
    assert "matches no file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # beta < 0 would label the worse response chosen (5.6% right at -10), nan at random.
        (["--beta", "-10"], "--beta must be a finite number > 0, got -10.0"),
        (["--beta", "nan"], "--beta must be a finite number > 0, got nan"),
        (["--out", "."], "--out .: Is a directory"),
    ],
)
def test_generate_refuses_what_would_write_wrong_labels_or_nothing(flags, message, capsys):
    assert main(["data", "generate", "--out", "unused.jsonl", "--pairs", "5", *flags]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert not os.path.exists("unused.jsonl")


def test_shard_output_that_is_a_file_is_a_one_line_error(tmp_path, capsys):
    data, taken = tmp_path / "p.jsonl", tmp_path / "taken"
    assert main(["data", "generate", "--out", str(data), "--pairs", "50"]) == 0
    taken.write_text("")
    assert main(["data", "shard", "--input", str(data), "--output", str(taken)]) == 1
    assert capsys.readouterr().err.strip().endswith(f"Not a directory: '{taken}/tokenizer'")


def test_help_describes_shard_flags(capsys):
    with pytest.raises(SystemExit) as done:
        main(["data", "shard", "--help"])
    assert done.value.code == 0
    assert "--max-invalid-fraction" in capsys.readouterr().out
