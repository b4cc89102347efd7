"""Writes and claims that hold on a local disk and on gs:// alike: a folder claimed by one
caller only, a file replaced whole, a listing never cached. The promotion history
(promotion.py) is built on them.

Claiming a number: locally ``os.mkdir`` of the version folder, which fails when it exists. On
gs:// the claim is one object, ``versions/N/CLAIM-owner``, created only if absent: the
storage client's ``if_generation_match=0`` precondition, which Cloud Storage checks and
applies atomically (https://cloud.google.com/storage/docs/request-preconditions), so exactly
one claimant gets N and the others get 412 Precondition Failed. A folder an earlier alignpipe
claimed by listing (``CLAIM-<random>``) counts as taken. tf.io.gfile, which the other gs://
I/O uses, offers no preconditions (GFile writes unconditionally, and
``rename(overwrite=False)`` checks, then copies); on other remote file systems a claim is
still by listing (:func:`claim_by_listing`): write a claim of one's own, then list. The
storage client also starts faster than TensorFlow (benchmarks/bench_libraries.py).
"""

from __future__ import annotations

import datetime
import os
import random
import tempfile
import time
import uuid

from components.core import fileio

CLAIM_PREFIX = "CLAIM-"
CLAIM_OBJECT = f"{CLAIM_PREFIX}owner"  # gs://: the one object whose creation is the claim


def claim_folder(folder: str) -> bool:
    """Claim ``folder`` for this caller alone; False when another claimant has it."""
    if folder.startswith("gs://"):
        return claim_by_precondition(folder)
    if "://" in folder:
        return claim_by_listing(folder)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    try:
        os.mkdir(folder)
    except FileExistsError:
        return False
    return True


def claim_by_precondition(folder: str) -> bool:
    """Claim a gs:// ``folder`` by creating its claim object only if it does not exist."""
    from google.api_core.exceptions import PreconditionFailed
    from google.cloud import storage

    if any(name.startswith(CLAIM_PREFIX) for name in listdir(folder)):
        return False  # claimed already, possibly by listing (an earlier alignpipe)
    bucket, _, path = folder.removeprefix("gs://").partition("/")
    blob = storage.Client().bucket(bucket).blob(f"{path.strip('/')}/{CLAIM_OBJECT}")
    try:
        blob.upload_from_string(_now(), if_generation_match=0)
    except PreconditionFailed:
        return False
    return True


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")


def claim_by_listing(folder: str) -> bool:
    """Claim ``folder`` where only whole-object writes and listings are atomic (gs://).

    Write a claim of one's own, then list: the claim holds when it is the only one there.
    """
    mine = f"{CLAIM_PREFIX}{uuid.uuid4().hex}"
    fileio.write_text(fileio.join(folder, mine), _now())
    claims = [name for name in listdir(folder) if name.startswith(CLAIM_PREFIX)]
    if claims == [mine]:
        return True
    time.sleep(random.uniform(0.0, 0.2))  # when every claimant lost, try the next apart
    return False


def listdir(folder: str) -> list[str]:
    """The names in ``folder`` (none when it is missing); gs:// listings are never cached."""
    if not folder or not fileio.isdir(folder):
        return []
    if "://" not in folder:
        return os.listdir(folder)
    import tensorflow as tf  # only remote paths need TensorFlow's filesystems

    return [name.rstrip("/") for name in tf.io.gfile.listdir(folder)]


def write_atomic(path: str, text: str) -> None:
    """Write ``path`` so that a reader sees the old content or the new, never a part."""
    if "://" in path:
        fileio.write_text(path, text)  # one GCS object write is atomic
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except OSError:
        os.remove(temporary)
        raise
