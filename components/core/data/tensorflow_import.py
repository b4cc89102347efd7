"""TensorFlow for tf.data, imported without the Keras its ``__init__`` loads eagerly."""

from __future__ import annotations

import sys


def import_tensorflow():
    """The ``tensorflow`` module; imported here the first time without Keras.

    Nothing in alignpipe uses Keras, and it is about a fifth of TensorFlow's import (1.1 of
    4.8 s on 2 cores) in every stage process that reads shards. ``keras`` is held off in
    ``sys.modules`` for that one import (TensorFlow's ``__init__`` skips it on ImportError
    and keeps ``tf.keras`` lazy), then released: a later ``import keras`` loads as usual.
    A process that has imported either already gets them as they are.

    The first import also settles the heap (``entry.settle_heap``): TensorFlow's modules
    are over half of a stage's long-lived objects.
    """
    if "tensorflow" not in sys.modules and "keras" not in sys.modules:
        sys.modules["keras"] = None  # type: ignore[assignment]
        try:
            import tensorflow  # noqa: F401
        finally:
            if sys.modules.get("keras", False) is None:
                del sys.modules["keras"]
        from components.core.entry import settle_heap

        settle_heap()
    import tensorflow as tf

    return tf
