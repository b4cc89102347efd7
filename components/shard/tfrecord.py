"""``tf.train.Example`` encoding and TFRecord files without TensorFlow.

The shard job writes millions of small records: encoding the protobuf wire
format directly is faster than building message objects, and keeps
TensorFlow out of the Beam workers. Output is byte-identical to
``Example.SerializeToString(deterministic=True)`` (features sorted by name)
and to ``tf.io.TFRecordWriter`` framing; tests check both.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

import google_crc32c

Feature = list[int] | list[float] | list[bytes]


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return bytes((value,))
    value &= (1 << 64) - 1  # negative int64 values are encoded as two's complement
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _packed_varints(values: list[int]) -> bytes:
    # Token ids below 128 are one byte each: the common case, without a Python loop per id.
    if all(0 <= v < 0x80 for v in values):
        return bytes(values)
    return b"".join(map(_varint, values))


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return bytes((number << 3 | 2,)) + _varint(len(payload)) + payload  # field numbers < 16


def _feature(values: Feature, kind: str) -> bytes:
    if kind == "bytes":
        inner = b"".join(_field(1, v) for v in values)
        return _field(1, inner)
    if kind == "float":
        packed = struct.pack(f"<{len(values)}f", *values)
        return _field(2, _field(1, packed) if values else b"")
    return _field(3, _field(1, _packed_varints(values)) if values else b"")


def encode_example(features: dict[str, tuple[str, Feature]]) -> bytes:
    """A serialized ``tf.train.Example`` of ``{name: (kind, values)}``; kind: int64|float|bytes."""
    entries = b"".join(
        _field(1, _field(1, name.encode("utf-8")) + _field(2, _feature(values, kind)))
        for name, (kind, values) in sorted(features.items())
    )
    return _field(1, entries)


def _masked_crc(data: bytes) -> bytes:
    crc = google_crc32c.value(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def frame(record: bytes) -> bytes:
    """One TFRecord: length, its masked CRC-32C, the data, its masked CRC-32C."""
    length = struct.pack("<Q", len(record))
    return length + _masked_crc(length) + record + _masked_crc(record)


def write_tfrecords(path: str, records: Iterable[bytes]) -> None:
    """Write ``records`` as a TFRecord file at ``path`` (local or any Beam filesystem)."""
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path) as handle:
        for record in records:
            handle.write(frame(record))
