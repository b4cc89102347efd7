"""The held-out reward model's own data (``--heldout-input``, pipeline ``heldout_data_uri``):
pairs from other annotators, all in the heldout split, beside the run's data (real Beam)."""

from __future__ import annotations

import glob
import json

import pytest

from components.core.data.builtin_task import write_jsonl
from components.core.data.input_pipeline import read_manifest
from components.core.data.tfrecord import read_records
from components.shard import ShardConfig
from components.shard import run as shard
from components.shard.__main__ import main as shard_main
from components.shard.records import decode_example, place, prompt_hash
from components.shard.sources import InputError

CONFIG = dict(num_shards=2, tokenizer="builtin-words", eval_fraction=0.2, min_eval_pairs=0)


def _prompts(folder: str, split: str) -> list[str]:
    files = sorted(glob.glob(f"{folder}/{split}/*.tfrecord"))
    return [decode_example(r)["prompt"] for f in files for r in read_records(f)]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("heldout_input")
    write_jsonl(str(root / "pairs.jsonl"), 300, seed=0)
    write_jsonl(str(root / "other.jsonl"), 120, seed=1)
    with open(root / "other.jsonl", "a") as handle:
        handle.write('{"prompt": "Tell me about the lake.", "chosen": "good"}\n')  # no rejected
    return {"root": str(root), "pairs": str(root / "pairs.jsonl"), "other": str(handle.name)}


def test_every_heldout_input_pair_goes_to_the_heldout_split(data):
    out = f"{data['root']}/shards"
    manifest = shard(ShardConfig(**CONFIG), [data["pairs"]], out, heldout_inputs=[data["other"]])
    counts = manifest["counts"]
    assert manifest["heldout_sources"] == [data["other"]]
    # The run's data fills train and eval as without held-out data; the other annotators'
    # pairs all land in heldout (less their duplicates), their bad record in rejected/.
    alone = shard(ShardConfig(**CONFIG), [data["pairs"]], f"{data['root']}/alone")
    assert (counts["train"], counts["eval"]) == (alone["counts"]["train"], alone["counts"]["eval"])
    assert "heldout" not in alone["counts"] and "heldout_sources" not in alone
    assert counts["input_records"] == 300 + 121
    assert counts["heldout"] + counts["duplicates"] == 120 + alone["counts"]["duplicates"]
    assert counts["rejected"] == 1
    rejected = [json.loads(line) for line in open(f"{out}/rejected/rejected.jsonl")]
    assert rejected[0]["source"] == data["other"]
    # Its prompts keep their hash's shard, but not its split: by hash some would be eval's.
    heldout = _prompts(out, "heldout")
    assert len(heldout) == counts["heldout"]
    by_hash = {place(prompt_hash(p), 0.2, 2)[0] for p in heldout}
    assert by_hash == {"train", "eval"}
    assert read_manifest(out)["splits"]["heldout"]["pairs"] == counts["heldout"]


def test_heldout_input_adds_to_a_heldout_share(data):
    config = ShardConfig(**CONFIG, heldout_fraction=0.3)
    share = shard(config, [data["pairs"]], f"{data['root']}/share")
    both = shard(config, [data["pairs"]], f"{data['root']}/both", heldout_inputs=[data["other"]])
    assert both["counts"]["train"] == share["counts"]["train"]
    assert both["counts"]["heldout"] > share["counts"]["heldout"] + 100


def test_a_file_given_as_both_or_a_missing_one_is_named(data, capsys):
    out = f"{data['root']}/refused"
    with pytest.raises(InputError, match="both the run's data and held-out data"):
        shard(ShardConfig(**CONFIG), [data["pairs"]], out, heldout_inputs=[data["pairs"]])
    with pytest.raises(InputError, match="heldout_input: .*matches no file"):
        shard(ShardConfig(**CONFIG), [data["pairs"]], out, heldout_inputs=[f"{out}.jsonl"])
    argv = ["--input", data["pairs"], "--heldout-input", data["other"], "--output",
            f"{data['root']}/cli", "--tokenizer", "builtin-words", "--num-shards", "2"]  # fmt: skip
    assert shard_main(argv) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["heldout"] > 100


def test_the_pipeline_finds_heldout_data_and_checks_it(data):
    from pipelines.dag import params
    from pipelines.dag.run_components import find_data

    found = json.loads(find_data(data["pairs"], "", data["other"]))
    assert [(s["uri"], s.get("role", "")) for s in found] == [
        (data["pairs"], ""),
        (data["other"], "heldout"),
    ]
    with pytest.raises(FileNotFoundError, match="heldout_data_uri .* matches no file"):
        find_data(data["pairs"], "", f"{data['root']}/none/*.jsonl")
    given = {"data_uri": data["pairs"], "heldout_data_uri": data["other"]}
    assert params.held_out(params.validate(given, chips=8))
    for values, message in [
        ({"heldout_data_uri": data["other"]}, "heldout_data_uri: the built-in tasks"),
        ({**given, "fsdp": True}, "heldout_data_uri or reward_ensemble with fsdp"),
        (
            {**given, "train_reward_model": False, "reward_functions": "builtin/length-penalty"},
            "trains none",
        ),
    ]:
        with pytest.raises(params.ParamError, match=message):
            params.validate(values, chips=8)
