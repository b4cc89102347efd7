"""Content digests of weight files, so a cache or a resume sees a model's weights change.

A safetensors header (names, dtypes, shapes, offsets) stays the same when a fine-tune
replaces the numbers behind it, so a digest of headers, configs or indexes cannot tell
two fine-tunes of one model apart. The digest here is a sha256 of each file's bytes:

- Local files are hashed in full (about 1 GB/s on one core) once, and the digest is kept
  in a small cache file keyed by the file's real path, size, modification time and inode;
  a later call for the same unchanged file reads the cache. A copy of the folder hashes
  again and gives the same digest.
- Remote files (gs://) are not read: a Cloud Storage object cannot change in place, and
  every new upload is a new generation with a new update time, so size and update time
  name its content; reading a 16 GB checkpoint over the network at every run would not.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

from components.core import fileio

CACHE_ENV = "ALIGNPIPE_DIGEST_CACHE"  # the cache file; default ~/.cache/alignpipe/digests.json
CHUNK = 8 * 2**20


def _cache_path() -> str:
    default = os.path.join(os.path.expanduser("~"), ".cache", "alignpipe", "digests.json")
    return os.environ.get(CACHE_ENV) or default


def _read_cache(path: str) -> dict[str, str]:
    try:
        with open(path) as handle:
            cache = json.load(handle)
    except (OSError, ValueError):  # none yet, unreadable or damaged: start again
        return {}
    return cache if isinstance(cache, dict) else {}


def _write_cache(path: str, cache: dict[str, str]) -> None:
    """Replace the cache file atomically; a cache that cannot be written is only slower."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(handle, "w") as out:
            json.dump(cache, out)
        os.replace(temporary, path)
    except OSError:
        pass


def file_digest(path: str) -> str:
    """sha256 of a local file's bytes (cached while its size, time and inode stay); for a
    remote file, its size and update time (see the module's docstring)."""
    if "://" in path:
        import tensorflow as tf  # only remote paths need TensorFlow's filesystems

        stat = tf.io.gfile.stat(path)
        return f"{stat.length}@{stat.mtime_nsec}"
    real = os.path.realpath(path)
    stat = os.stat(real)
    key = f"{real}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}"
    cache_file = _cache_path()
    cache = _read_cache(cache_file)
    if key in cache:
        return cache[key]
    digest = hashlib.sha256()
    with open(real, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    # Read again: another process may have added entries while this one hashed; this file's
    # older entries (another size, time or inode) go.
    cache = {k: v for k, v in _read_cache(cache_file).items() if not k.startswith(f"{real}|")}
    cache[key] = digest.hexdigest()
    _write_cache(cache_file, cache)
    return cache[key]


def weights_digest(folder: str) -> str:
    """One digest of every weight file directly in ``folder`` (a Hugging Face checkpoint's
    ``*.safetensors``), by name and content; '' when it holds none."""
    files = fileio.glob(fileio.join(folder, "*.safetensors"))
    if not files:
        return ""
    digest = hashlib.sha256()
    for path in files:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        digest.update(f"{name}\0{file_digest(path)}\0".encode())
    return digest.hexdigest()[:16]
