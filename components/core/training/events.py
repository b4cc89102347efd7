"""TensorBoard event files, written without TensorFlow.

An event file is TFRecord-framed ``Event`` protos: first one naming the file version, then
one per logged step, whose ``Summary`` holds a scalar tensor per metric with the scalars
plugin's metadata (what ``tf.summary.write`` writes, and what TensorBoard reads). Encoding
them here keeps TensorFlow out of stages that need it for nothing else (PPO: 3-4 s of its
start on 2 cores); tests read the files back with TensorFlow's own ``Event`` parser.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Mapping

from components.core import fileio
from components.core.data.tfrecord import frame, length_delimited, varint

DT_FLOAT = 1  # tensorflow.DataType
# How often a remote file (re-written whole: object stores do not append) is rewritten;
# TensorFlow's summary writer flushes as often by default.
REMOTE_FLUSH_SECONDS = 120.0


def _event(wall_time: float, step: int, payload: bytes) -> bytes:
    """An ``Event``: wall_time (field 1, double), step (2, varint), then ``payload`` (its
    file_version or summary field)."""
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + varint(step) + payload


def _scalar(tag: str, value: float) -> bytes:
    """A ``Summary.Value``: tag (1), a float32 scalar ``TensorProto`` (8: dtype, an empty
    shape, float_val packed) and the scalars plugin's ``SummaryMetadata`` (9)."""
    tensor = b"\x08" + varint(DT_FLOAT) + length_delimited(2, b"")
    tensor += length_delimited(5, struct.pack("<f", value))
    metadata = length_delimited(1, length_delimited(1, b"scalars"))
    return (
        length_delimited(1, tag.encode("utf-8"))
        + length_delimited(8, tensor)
        + length_delimited(9, metadata)
    )


class EventWriter:
    """Scalars of each step into a new event file in ``log_dir`` (local or ``gs://``)."""

    def __init__(self, log_dir: str) -> None:
        fileio.makedirs(log_dir)
        stamp, host = int(time.time()), socket.gethostname()
        self.path = fileio.join(
            log_dir, f"events.out.tfevents.{stamp:010d}.{host}.{os.getpid()}.v2"
        )
        self._remote = "://" in log_dir
        self._handle = None if self._remote else open(self.path, "ab")
        self._written: bytearray = bytearray()  # remote: the whole file so far
        self._flushed_at = time.monotonic()
        self._write(_event(time.time(), 0, length_delimited(3, b"brain.Event:2")))
        self.flush()

    def _write(self, event: bytes) -> None:
        if self._handle is not None:
            self._handle.write(frame(event))
        else:
            self._written += frame(event)

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """One event at ``step`` holding every ``values`` entry as a scalar summary."""
        summary = b"".join(length_delimited(1, _scalar(tag, v)) for tag, v in values.items())
        self._write(_event(time.time(), int(step), length_delimited(5, summary)))
        if not self._remote or time.monotonic() - self._flushed_at > REMOTE_FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Make what was written readable (a remote file is written whole again)."""
        if self._handle is not None:
            self._handle.flush()
        else:
            fileio.write_bytes(self.path, bytes(self._written))
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self._handle is not None:
            self._handle.close()
            self._handle = None
