"""tf.data readers over preference shards written here in the documented format."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from components.core.data import input_pipeline as ip
from components.core.data.prompts import left_pad, prompt_dataset, unique_prompts
from components.core.data.tokenizers import ByteTokenizer

BOS, EOS, PAD = 1, 2, 0


def _int64(values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=list(values)))


def _bytes(text: str):
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=[text.encode()]))


def example(prompt, chosen, rejected, margin=1.0, prompt_hash=0) -> bytes:
    """One serialized record in the shard stage's documented format."""
    features = {
        "prompt_ids": _int64(prompt),
        "chosen_ids": _int64(chosen),
        "rejected_ids": _int64(rejected),
        "prompt": _bytes("p"),
        "chosen": _bytes("c"),
        "rejected": _bytes("r"),
        "margin": tf.train.Feature(float_list=tf.train.FloatList(value=[margin])),
        "prompt_hash": _int64([prompt_hash]),
    }
    return tf.train.Example(features=tf.train.Features(feature=features)).SerializeToString()


def write_shards(root, records_by_split: dict[str, list[list[bytes]]]) -> str:
    """A shards folder: manifest.json and ``<split>/shard-i-of-n.tfrecord`` per records list."""
    num_shards = len(next(iter(records_by_split.values())))
    splits = {}
    for split, shards in records_by_split.items():
        os.makedirs(os.path.join(root, split), exist_ok=True)
        listed = []
        for index, records in enumerate(shards):
            name = f"shard-{index:05d}-of-{num_shards:05d}.tfrecord"
            with tf.io.TFRecordWriter(os.path.join(root, split, name)) as writer:
                for record in records:
                    writer.write(record)
            listed.append({"file": f"{split}/{name}", "pairs": len(records)})
        splits[split] = {"pairs": sum(len(s) for s in shards), "shards": listed}
    manifest = {
        "schema_version": 1,
        "tokenizer": ByteTokenizer().info(),
        "num_shards": num_shards,
        "splits": splits,
    }
    with open(os.path.join(root, "manifest.json"), "w") as handle:
        json.dump(manifest, handle)
    return str(root)


def numbered_shards(root, num_shards: int = 4, per_shard: int = 10, vocab: int = 200) -> str:
    """Pairs whose prompt is [bos, 10 + shard, 50 + index]; two pairs per prompt."""
    shards = []
    for shard in range(num_shards):
        records = []
        for index in range(per_shard):
            prompt = [BOS, 10 + shard, 50 + index // 2]
            records.append(
                example(
                    prompt,
                    [100 + index, EOS],
                    [150, 151, EOS],
                    margin=float(index),
                    prompt_hash=shard * 1000 + index // 2,
                )
            )
        shards.append(records)
    return write_shards(root, {"train": shards, "eval": shards[:2] + shards[:2]})


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return numbered_shards(tmp_path_factory.mktemp("shards"))


def test_padding_masks_and_loss_mask(tmp_path):
    root = write_shards(tmp_path, {"train": [[example([BOS, 5, 6], [7, 8, EOS], [9, EOS], 0.5)]]})
    batch = next(
        ip.preference_dataset(
            root,
            "train",
            batch_size=1,
            max_len=8,
            seed=0,
            host_index=0,
            host_count=1,
            shuffle=False,
        )
    )
    np.testing.assert_array_equal(batch["chosen_tokens"][0], [BOS, 5, 6, 7, 8, EOS, PAD, PAD])
    np.testing.assert_array_equal(batch["chosen_mask"][0], [1, 1, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch["loss_mask"][0], [0, 0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch["rejected_tokens"][0], [BOS, 5, 6, 9, EOS, 0, 0, 0])
    np.testing.assert_array_equal(batch["rejected_mask"][0], [1, 1, 1, 1, 1, 0, 0, 0])
    assert batch["chosen_tokens"].dtype == np.int32 and batch["chosen_mask"].dtype == bool
    assert batch["margin"].tolist() == [0.5]


def test_truncation_keeps_prompt_end_and_bos(tmp_path):
    prompt = [BOS, *range(10, 20)]
    records = [
        example(prompt, [30, 31, EOS], [40, EOS]),
        example([BOS, 5], list(range(60, 80)), [4]),
    ]
    root = write_shards(tmp_path, {"train": [records]})
    batches = ip.preference_dataset(
        root, "train", batch_size=1, max_len=8, seed=0, host_index=0, host_count=1, shuffle=False
    )
    first, second = next(batches), next(batches)
    # The prompt is cut from the left (bos kept) so the whole chosen response fits.
    np.testing.assert_array_equal(first["chosen_tokens"][0], [BOS, 16, 17, 18, 19, 30, 31, EOS])
    np.testing.assert_array_equal(first["rejected_tokens"][0], [BOS, 16, 17, 18, 19, 40, EOS, PAD])
    # A long response is cut from the right; the short prompt stays whole.
    np.testing.assert_array_equal(second["chosen_tokens"][0], [BOS, 5, 60, 61, 62, 63, 64, 65])
    assert second["chosen_mask"][0].all() and second["loss_mask"][0, 2:].all()


def test_host_split_reads_every_other_shard(shards):
    manifest = ip.read_manifest(shards)
    files = ip.host_shard_files(shards, "train", manifest, 0, 2)
    assert [os.path.basename(f) for f in files] == [
        "shard-00000-of-00004.tfrecord",
        "shard-00002-of-00004.tfrecord",
    ]
    batches = ip.preference_dataset(
        shards, "train", batch_size=4, max_len=8, seed=0, host_index=1, host_count=2
    )
    seen = {int(t) for _ in range(5) for t in next(batches)["chosen_tokens"][:, 1]}
    assert seen == {11, 13}


def test_same_seed_same_batches_and_reshuffle_per_epoch(shards):
    def take(seed, count=25):
        batches = ip.preference_dataset(
            shards, "train", batch_size=4, max_len=8, seed=seed, host_index=0, host_count=1
        )
        return [next(batches)["chosen_tokens"] for _ in range(count)]

    first, again, other = take(3), take(3), take(4)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(first, other, strict=True))
    # 40 pairs / 4 = 10 batches per epoch; epoch 1 is a different order of the same pairs.
    epoch0, epoch1 = np.concatenate(first[:10]), np.concatenate(first[10:20])
    assert not np.array_equal(epoch0, epoch1)
    assert sorted(map(tuple, epoch0)) == sorted(map(tuple, epoch1))


def test_resume_from_position_gives_the_same_next_batches(shards):
    def fresh():
        return ip.preference_dataset(
            shards, "train", batch_size=4, max_len=8, seed=7, host_index=0, host_count=1
        )

    reference = fresh()
    expected = [next(reference) for _ in range(16)]
    interrupted = fresh()
    for _ in range(8):
        next(interrupted)
    position = json.loads(json.dumps(interrupted.position()))
    resumed = fresh()
    resumed.restore(position)
    for want in expected[8:]:
        got = next(resumed)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    assert resumed.position() == {"batches_total": 16, "epoch": 1, "batches_in_epoch": 6}
    # Only the lockstep total is needed: each host maps it onto its own epochs.
    from_total = fresh()
    from_total.restore({"batches_total": 13})
    assert from_total.position()["epoch"] == 1
    np.testing.assert_array_equal(next(from_total)["chosen_tokens"], expected[13]["chosen_tokens"])


def test_one_pipeline_serves_every_epoch(shards, monkeypatch):
    """Built and traced once for EPOCHS_PER_PIPELINE epochs, not per epoch (a rebuild cost
    ~0.3 s on 2 cores, and a stall while the next epoch's shuffle buffer filled)."""
    built = []
    parse_fn = ip._parse_fn
    monkeypatch.setattr(ip, "_parse_fn", lambda: built.append(1) or parse_fn())

    def read(count):
        batches = ip.preference_dataset(
            shards, "train", batch_size=4, max_len=8, seed=0, host_index=0, host_count=1
        )
        return [(next(batches), (batches.epoch, batches.batches_in_epoch)) for _ in range(count)]

    once = read(45)  # 10 batches per epoch
    assert len(built) == 1
    positions = [position for _, position in once]
    assert positions[9:12] == [(0, 10), (1, 1), (1, 2)] and positions[-1] == (4, 5)
    # Planned 2 epochs at a time: the next pipeline goes on where the last one ended.
    monkeypatch.setattr(ip, "EPOCHS_PER_PIPELINE", 2)
    replanned = read(45)
    assert len(built) == 1 + 3
    for (want, want_at), (got, got_at) in zip(once, replanned, strict=True):
        assert got_at == want_at
        np.testing.assert_array_equal(got["chosen_tokens"], want["chosen_tokens"])
    # Too few pairs for one batch: an error naming the fix, not an endless search for one.
    with pytest.raises(ip.DataError, match="fewer than batch_size=64; lower the batch size"):
        next(ip.preference_dataset(shards, "train", batch_size=64, max_len=8, seed=0))
    # Files that hold fewer pairs than their manifest lists: an error, not an empty epoch.
    listed = ip.preference_dataset(shards, "train", batch_size=4, max_len=8, seed=0)
    common = dict(pad_id=PAD, bos_id=BOS, seed=0, host_index=0, shuffle=True, repeat=True)
    short = ip.PreferenceBatches(listed.files, batch_size=64, max_len=8, pairs=640, **common)
    with pytest.raises(ip.DataError, match="fewer pairs than the manifest lists; re-shard"):
        next(short)


def test_readers_run_without_autotune(shards):
    """With autotune on, a dropped reader's destructor waited out its autotune thread's sleep
    (up to a minute) inside garbage collection: a suite test stalled 186 s in one collection,
    the readers of three in-process reward runs, 69 s after 70 s idle."""
    batches = ip.preference_dataset(shards, "train", batch_size=4, max_len=8, seed=0)
    assert batches._dataset().options().autotune.enabled is False


def test_tensorflow_comes_without_keras_and_its_objects_out_of_collections(shards):
    """A stage process's first TensorFlow import skips the Keras TensorFlow loads eagerly,
    and freezes the heap (entry.settle_heap): the objects alive then are in no collection,
    garbage made later is collected, and exit freezes what is alive again."""
    script = f"""
import atexit, gc, sys, weakref
from components.core.data import input_pipeline as ip
atexit.register(lambda: print("frozen at exit", gc.get_freeze_count() > frozen + 10000))
batches = ip.preference_dataset({shards!r}, "train", batch_size=4, max_len=8, seed=0)
print(next(batches)["chosen_tokens"].shape, "keras" in sys.modules)
frozen = gc.get_freeze_count()
print("frozen", frozen > 200000, len(gc.get_objects()) < frozen // 10)
class Node: pass
cycle = Node(); cycle.me = cycle; ref = weakref.ref(cycle); del cycle
gc.collect()
print("cycle collected", ref() is None)
kept = [[n] for n in range(20000)]  # alive at exit, tracked (lists always are)
import keras
print(keras.__name__, "keras.src.optimizers" in sys.modules)
"""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "(4, 8) False", "frozen True True", "cycle collected True", "keras True",
        "frozen at exit True",
    ]  # fmt: skip


def test_epoch_length_comes_from_the_manifest_without_reading_the_shards(shards, monkeypatch):
    listed = ip.preference_dataset(
        shards, "train", batch_size=4, max_len=8, seed=0, host_index=1, host_count=2
    )
    assert listed.pairs == 20  # shards 1 and 3, 10 pairs each
    common = dict(pad_id=PAD, bos_id=BOS, seed=0, host_index=1, shuffle=True, repeat=True)
    counted = ip.PreferenceBatches(listed.files, batch_size=3, max_len=8, **common)
    assert counted.batches_per_epoch() == 6  # a manifest without counts: 20 read, // 3

    def read(*args, **kwargs):
        raise AssertionError("the shards were read to count them")

    monkeypatch.setattr(tf.data, "TFRecordDataset", read)
    assert listed.batches_per_epoch() == 5
    # A file the manifest does not list: counted by reading it.
    manifest = ip.read_manifest(shards)
    manifest["splits"]["train"]["shards"].pop(3)
    assert ip._listed_pairs(manifest, "train", listed.files) is None


def test_no_repeat_stops_after_one_epoch(shards):
    batches = ip.preference_dataset(
        shards,
        "eval",
        batch_size=8,
        max_len=8,
        seed=0,
        host_index=0,
        host_count=1,
        shuffle=False,
        repeat=False,
    )
    assert len(list(batches)) == 5


def test_errors_name_the_file_and_fix(shards, tmp_path):
    with pytest.raises(ip.DataError, match="manifest.json not found"):
        ip.read_manifest(str(tmp_path))
    with pytest.raises(ip.DataError, match="4 shard files but there are 5 hosts"):
        ip.preference_dataset(
            shards, "train", batch_size=2, max_len=8, seed=0, host_index=0, host_count=5
        )
    root = numbered_shards(tmp_path / "broken", num_shards=2, per_shard=2)
    os.remove(os.path.join(root, "train", "shard-00001-of-00002.tfrecord"))
    with pytest.raises(ip.DataError, match="shard-00001-of-00002.tfrecord is listed"):
        ip.preference_dataset(
            root, "train", batch_size=2, max_len=8, seed=0, host_index=1, host_count=2
        )
    manifest_path = os.path.join(root, "manifest.json")
    manifest = json.load(open(manifest_path))
    json.dump({**manifest, "schema_version": 2}, open(manifest_path, "w"))
    with pytest.raises(ip.DataError, match="schema_version 2.*Re-run the shard stage"):
        ip.read_manifest(root)


def test_check_vocab(shards):
    manifest = ip.read_manifest(shards)
    ip.check_vocab(manifest, ByteTokenizer().vocab_size)
    ip.check_vocab(manifest, 32000)  # a padded embedding holds every token id
    with pytest.raises(ip.DataError, match="vocab_size 259.*expects 256"):
        ip.check_vocab(manifest, 256)


def test_prompt_dataset_unique_left_padded_resumable(shards):
    def fresh():
        return prompt_dataset(
            shards, "train", batch_size=4, prompt_len=5, seed=1, host_index=0, host_count=2
        )

    prompts = fresh()
    assert len(prompts.tokens) == 10  # shards 0 and 2, five unique prompts each
    batch = next(prompts)
    assert batch["prompt_tokens"].shape == (4, 5)
    np.testing.assert_array_equal(batch["prompt_mask"][0], [0, 0, 1, 1, 1])
    assert (batch["prompt_tokens"][:, :2] == PAD).all() and (
        batch["prompt_tokens"][:, 2] == BOS
    ).all()
    expected = [next(prompts) for _ in range(5)]
    resumed = fresh()
    resumed.restore({"batches_total": 1})
    for want in expected:
        np.testing.assert_array_equal(next(resumed)["prompt_tokens"], want["prompt_tokens"])


def test_prompt_holdout_splits_train_prompts_by_hash_and_the_stream_never_yields_it(tmp_path):
    """PPO's validation_fraction: a fixed share of the train prompts, chosen by hash, that
    the rollouts' stream never samples; the rest and the held-out part make up the whole."""
    root = numbered_shards(tmp_path / "many", num_shards=4, per_shard=100)

    def prompts(**holdout) -> set[tuple[int, ...]]:
        found = prompt_dataset(
            root, "train", batch_size=1, prompt_len=4, seed=0, host_index=0, host_count=1,
            shuffle=False, repeat=False, **holdout,
        )  # fmt: skip
        return {tuple(t[m]) for t, m in zip(found.tokens, found.masks, strict=True)}

    everything = prompts()
    rest, held = prompts(holdout=0.25), prompts(holdout=0.25, held_out=True)
    assert len(everything) == 200 and rest | held == everything and not rest & held
    assert 0.15 < len(held) / len(everything) < 0.35
    assert held < prompts(holdout=0.5, held_out=True)  # a larger share holds out more
    # The rollouts' stream: shuffled, repeating, one of two hosts, over three epochs.
    stream = prompt_dataset(
        root, "train", batch_size=4, prompt_len=4, seed=3, host_index=1, host_count=2,
        holdout=0.25,
    )  # fmt: skip
    seen = set()
    for _ in range(3 * stream.batches_per_epoch()):
        batch = next(stream)
        rows = zip(batch["prompt_tokens"], batch["prompt_mask"], strict=True)
        seen |= {tuple(t[m]) for t, m in rows}
    assert len(seen) > 50 and not seen & held
    # A share too small to hold any prompt out is named, with the setting that fixes it.
    with pytest.raises(ip.DataError, match="0 train prompts held out of 1e-09.*validation_fr"):
        prompts(holdout=1e-9, held_out=True)
    # Data without a gold reward: nothing to measure on a hold-out, refused before any model.
    from components.ppo import PPOConfig
    from components.ppo import run as ppo_run

    with pytest.raises(ValueError, match="validation_fraction: 0.2 .*names no gold reward"):
        ppo_run(PPOConfig(validation_fraction=0.2), root, "no-policy", "no-reward", "out")


def test_prompts_are_read_as_tf_data_parses_them_and_a_damaged_shard_is_named(tmp_path):
    """The TF-free prompt reader against tf.data's parse of the same shards: multi-byte and
    negative varints, an empty prompt, one prompt kept per hash."""
    records = [
        example([BOS, 300, 70000], [5], [6], prompt_hash=-(2**62)),
        example([BOS, 300, 70000], [7], [8], prompt_hash=-(2**62)),  # the same prompt again
        example([BOS] + list(range(120, 140)), [5], [6], prompt_hash=2**40 + 3),
        example([], [5], [6]),
    ]
    root = write_shards(tmp_path / "s", {"train": [records]})
    files = ip.host_shard_files(root, "train", ip.read_manifest(root), 0, 1)
    parsed = [e for e in tf.data.TFRecordDataset(files).map(ip._parse_fn()).as_numpy_iterator()]
    got = unique_prompts(files)
    assert len(got) == 3 and all(p.dtype == np.int32 for p in got)
    for prompt, want in zip(got, [parsed[0], parsed[2], parsed[3]], strict=True):
        np.testing.assert_array_equal(prompt, want["prompt_ids"])
    with open(files[0], "r+b") as handle:
        handle.seek(30)
        handle.write(b"\xff\xff")
    with pytest.raises(ip.DataError, match=f"{files[0]}: record at byte 0 is cut or corrupt"):
        unique_prompts(files)


@pytest.mark.parametrize("bos", [True, False])
def test_eval_pairs_are_built_as_tf_data_builds_them(tmp_path, bos):
    """The TF-free pair reader (evaluate) against the tf.data reader on the same shards: cut
    prompts with and without a bos, empty prompt and responses, a response longer than
    max_len, a record without a margin, over two shard files in order."""
    from components.core.data.pairs import read_pairs
    from components.core.data.tfrecord import encode_example

    no_margin = encode_example({n: ("int64", [BOS, 9, 9]) for n in ("prompt_ids", "chosen_ids")})
    records = [
        [example([BOS, *range(10, 20)], [30, 31, EOS], [40, EOS], 0.5),
         example([BOS, 5], list(range(60, 80)), [4]),
         example([7, *range(10, 20)], [30, EOS], [], -2.0),
         example([], [5, EOS], [6, EOS])],
        [example([BOS, 70000, 3], [], [8]), no_margin,
         example([BOS, *range(10, 13)], [30, 31, 32, EOS], [40, EOS])],
    ]  # fmt: skip
    root = write_shards(tmp_path / "s", {"eval": records})
    if not bos:  # a tokenizer without bos: a leading 1 is cut like any other token
        with open(os.path.join(root, "manifest.json")) as handle:
            manifest = json.load(handle)
        del manifest["tokenizer"]["bos_id"]
        with open(os.path.join(root, "manifest.json"), "w") as handle:
            json.dump(manifest, handle)
    for max_len in (7, 8):
        got = read_pairs(root, "eval", max_len=max_len)
        batches = list(ip.preference_dataset(
            root, "eval", batch_size=1, max_len=max_len, seed=0, host_index=0, host_count=1,
            shuffle=False, repeat=False,
        ))  # fmt: skip
        want = {name: np.concatenate([b[name] for b in batches]) for name in got}
        assert len(want["margin"]) == 7 and want["margin"][5] == 0.0
        for name, values in want.items():
            assert got[name].dtype == values.dtype, name
            np.testing.assert_array_equal(got[name], values, err_msg=name)
    files = ip.host_shard_files(root, "eval", ip.read_manifest(root), 0, 1)
    with open(files[1], "r+b") as handle:
        handle.truncate(os.path.getsize(files[1]) - 3)
    with pytest.raises(ip.DataError, match=f"{files[1]}: record at byte .* cut or corrupt"):
        read_pairs(root, "eval", max_len=8)
    with open(files[1], "wb"):
        pass  # an empty file where the manifest lists three pairs
    with pytest.raises(ip.DataError, match="hold 4 pairs where the manifest lists 7; re-shard"):
        read_pairs(root, "eval", max_len=8)


def test_left_pad_truncation_keeps_bos():
    tokens, mask = left_pad(np.array([BOS, 5, 6, 7, 8]), 3, PAD, BOS)
    np.testing.assert_array_equal(tokens, [BOS, 7, 8])
    assert mask.all()
    # Room for the bos alone (once a ValueError: the cut kept the whole prompt after it).
    np.testing.assert_array_equal(left_pad(np.array([BOS, 5, 6]), 1, PAD, BOS)[0], [BOS])
    np.testing.assert_array_equal(left_pad(np.array([7, 5, 6]), 2, PAD, BOS)[0], [5, 6])
    tokens, mask = left_pad(np.array([BOS, 5]), 4, PAD, BOS)
    np.testing.assert_array_equal(tokens, [PAD, PAD, BOS, 5])
    np.testing.assert_array_equal(mask, [0, 0, 1, 1])


def test_streams_resume_on_another_host_layout(shards):
    """A position saved by a host holding 2 of 4 streams restores a host holding all 4."""
    from components.core.training.trainer import StreamBatches

    def streams(own: range) -> StreamBatches:
        readers = [
            ip.preference_dataset(
                shards, "train", batch_size=2, max_len=8, seed=5, host_index=s, host_count=4
            )
            for s in own
        ]
        return StreamBatches(readers)

    first_host, whole = streams(range(2)), streams(range(4))
    for _ in range(3):
        next(first_host)
    expected = [next(whole) for _ in range(5)][3:]
    resumed = streams(range(4))
    resumed.restore(first_host.position())
    for want in expected:
        got = next(resumed)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    resumed.restore(first_host.position()["streams"][0])  # a single reader's (older PPO)
    np.testing.assert_array_equal(next(resumed)["chosen_tokens"], expected[0]["chosen_tokens"])
    with pytest.raises(ValueError, match="not in step"):
        position = first_host.position()
        position["streams"][1] = {**position["streams"][1], "batches_total": 9}
        resumed.restore(position)
