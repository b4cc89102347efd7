"""Hand-written Example encoding and TFRecord framing match TensorFlow byte for byte, and
the hand-written reader gives back what TensorFlow's reads."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from components.core.data.tfrecord import (
    CorruptRecordError,
    decode_example,
    encode_example,
    frame,
    read_records,
)
from components.shard.tfrecord import write_tfrecords

int64s = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=6)
floats = st.lists(st.floats(allow_nan=False, width=32), max_size=4)
blobs = st.lists(st.binary(max_size=12), max_size=3)


def _reference(features) -> bytes:
    def feature(kind, values):
        if kind == "int64":
            return tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        if kind == "float":
            return tf.train.Feature(float_list=tf.train.FloatList(value=values))
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))

    proto = {name: feature(kind, values) for name, (kind, values) in features.items()}
    example = tf.train.Example(features=tf.train.Features(feature=proto))
    return example.SerializeToString(deterministic=True)


@settings(max_examples=200, deadline=None)
@given(ints=int64s, reals=floats, texts=blobs, names=st.permutations(["a", "prompt_ids", "zz"]))
def test_example_encoding_is_protobuf_deterministic_serialization(ints, reals, texts, names):
    features = {names[0]: ("int64", ints), names[1]: ("float", reals), names[2]: ("bytes", texts)}
    assert encode_example(features) == _reference(features)


def test_tfrecord_file_equals_tensorflow_writer(tmp_path):
    records = [b"", b"x", bytes(range(256)) * 5]
    ours, theirs = tmp_path / "ours.tfrecord", tmp_path / "theirs.tfrecord"
    write_tfrecords(str(ours), records)
    with tf.io.TFRecordWriter(str(theirs)) as writer:
        for record in records:
            writer.write(record)
    assert ours.read_bytes() == theirs.read_bytes() == b"".join(frame(r) for r in records)
    assert [r.numpy() for r in tf.data.TFRecordDataset(str(ours))] == records


def _as_lists(features: dict) -> dict:
    return {k: v if isinstance(v, list) else v.tolist() for k, v in features.items()}


@settings(max_examples=200, deadline=None)
@given(ints=int64s, reals=floats, texts=blobs, names=st.permutations(["a", "prompt_ids", "zz"]))
def test_decoding_gives_back_what_tensorflow_encoded(ints, reals, texts, names):
    features = {names[0]: ("int64", ints), names[1]: ("float", reals), names[2]: ("bytes", texts)}
    want = {name: values for name, (_, values) in features.items()}
    # TensorFlow's own serialization (map order not fixed) and ours decode alike.
    for record in (_reference(features), encode_example(features)):
        decoded = decode_example(record)
        assert _as_lists(decoded) == want
        assert decoded[names[0]].dtype == np.int64 and decoded[names[1]].dtype == np.float32
        assert isinstance(decoded[names[2]], list)
        assert _as_lists(decode_example(record, {names[0], "absent"})) == {names[0]: ints}


def _length_delimited(tag: int, payload: bytes) -> bytes:
    return bytes([tag, len(payload)]) + payload  # payloads under 128 bytes


def test_unpacked_lists_decode_too():
    """Writers other than TensorFlow may send repeated numbers one per field (proto2 style)."""
    int_list = b"\x08\x05" + b"\x08" + bytes([0xAC, 0x02])  # 5, 300: one varint field each
    float_list = b"\x0d" + np.float32(1.5).tobytes()  # one fixed32 field
    entries = [
        _length_delimited(
            0x0A, b"\x0a\x01a" + _length_delimited(0x12, _length_delimited(0x1A, int_list))
        ),
        _length_delimited(
            0x0A, b"\x0a\x01b" + _length_delimited(0x12, _length_delimited(0x12, float_list))
        ),
    ]
    record = _length_delimited(0x0A, b"".join(entries))
    parsed = tf.io.parse_single_example(
        record, {"a": tf.io.RaggedFeature(tf.int64), "b": tf.io.RaggedFeature(tf.float32)}
    )
    decoded = decode_example(record)
    assert decoded["a"].tolist() == parsed["a"].numpy().tolist() == [5, 300]
    assert decoded["b"].tolist() == parsed["b"].numpy().tolist() == [1.5]


def test_records_read_as_tensorflow_reads_them_and_damage_is_named(tmp_path):
    records = [b"", b"x", bytes(range(256)) * 5]
    path = tmp_path / "data.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    assert list(read_records(str(path))) == records
    data = path.read_bytes()
    for damaged in (data[:-3], data[:20] + b"\xff" + data[21:], data + b"\x01\x02"):
        path.write_bytes(damaged)
        with pytest.raises(CorruptRecordError, match=f"{path}.*re-shard"):
            list(read_records(str(path)))
