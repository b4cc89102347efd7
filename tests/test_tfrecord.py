"""Hand-written Example encoding and TFRecord framing match TensorFlow byte for byte."""

import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

from components.shard.tfrecord import encode_example, frame, write_tfrecords

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
