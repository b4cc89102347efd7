"""Small file helpers that accept local paths and ``gs://`` URIs alike."""

from __future__ import annotations

import glob as _glob
import os
import shutil
from typing import BinaryIO


def _is_remote(path: str) -> bool:
    return "://" in str(path)


def _gfile():
    import tensorflow as tf  # deferred: only remote paths need TensorFlow's filesystems

    return tf.io.gfile


def read_bytes(path: str) -> bytes:
    """The whole content of ``path``."""
    if _is_remote(path):
        with _gfile().GFile(path, "rb") as handle:
            return handle.read()
    with open(path, "rb") as handle:
        return handle.read()


def open_read(path: str) -> BinaryIO:
    """``path`` opened for binary reads, to read in parts (a large file, a stream of records)."""
    return _gfile().GFile(path, "rb") if _is_remote(path) else open(path, "rb")


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path``, creating parent folders."""
    if _is_remote(path):
        with _gfile().GFile(path, "wb") as handle:
            handle.write(data)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def exists(path: str) -> bool:
    return _gfile().exists(path) if _is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return _gfile().isdir(path) if _is_remote(path) else os.path.isdir(path)


def makedirs(path: str) -> None:
    if _is_remote(path):
        _gfile().makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)


def glob(pattern: str) -> list[str]:
    """Sorted matches of a glob pattern (a plain path matches itself if it exists)."""
    if _is_remote(pattern):
        return sorted(_gfile().glob(pattern))
    return sorted(_glob.glob(pattern))


def walk_files(folder: str) -> list[str]:
    """Every file under ``folder`` (at any depth), sorted, as full paths or URIs."""
    if _is_remote(folder):
        walked = ((str(root), files) for root, _, files in _gfile().walk(folder))
    else:
        walked = ((root, files) for root, _, files in os.walk(folder))
    return sorted(join(root, name) for root, files in walked for name in files)


def join(*parts: str) -> str:
    if _is_remote(parts[0]):
        return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))
    return os.path.join(*parts)


def is_within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (local paths with links resolved)."""
    if _is_remote(path) or _is_remote(folder):
        path, folder = path.rstrip("/"), folder.rstrip("/")
        return path == folder or path.startswith(folder + "/")
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def remove(path: str) -> None:
    """Delete the file ``path``."""
    if _is_remote(path):
        _gfile().remove(path)
    else:
        os.remove(path)


def remove_tree(path: str) -> None:
    if _is_remote(path):
        if _gfile().exists(path):
            _gfile().rmtree(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def copy_tree(source: str, destination: str) -> int:
    """Copy a folder (local or gs://) file by file, replacing ``destination``; returns the count."""
    if exists(destination):
        remove_tree(destination)
    if not _is_remote(source) and not _is_remote(destination):
        shutil.copytree(source, destination)
        return sum(len(names) for _, _, names in os.walk(destination))
    count = 0
    for folder, _, names in _gfile().walk(source):
        relative = os.path.relpath(folder, source) if folder != source else ""
        target = join(destination, relative) if relative else destination
        makedirs(target)
        for name in names:
            _gfile().copy(join(folder, name), join(target, name), overwrite=True)
            count += 1
    return count
