"""TFRecord files from the shard job, through Beam's filesystems (local or ``gs://``).

The framing and the ``tf.train.Example`` encoding are core's
(:mod:`components.core.data.tfrecord`): the stages read what this writes.
"""

from __future__ import annotations

from collections.abc import Iterable

from components.core.data.tfrecord import frame


def write_tfrecords(path: str, records: Iterable[bytes]) -> None:
    """Write ``records`` as a TFRecord file at ``path`` (local or any Beam filesystem)."""
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path) as handle:
        for record in records:
            handle.write(frame(record))
