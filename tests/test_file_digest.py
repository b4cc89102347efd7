"""The cache keys and the resume keys see a Hugging Face folder's weights, not only its
config and index: replacing the weights behind the same names changes them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from components.core import file_digest
from components.core.training.checkpoint import input_fingerprint
from components.sft.config import SFTConfig
from pipelines import stage_io

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.fixture
def model(tmp_path) -> Path:
    """A copy of the llama fixture (sharded: an index and two safetensors files)."""
    folder = tmp_path / "llama"
    shutil.copytree(FIXTURES / "llama", folder)
    return folder


def _fine_tune(folder: Path) -> None:
    """Replace one tensor's values in place: the same names, shapes, dtypes and index, so
    every safetensors header and the config stay byte for byte."""
    path = folder / "model-00002-of-00002.safetensors"
    header = path.read_bytes()[: 8 + int.from_bytes(path.read_bytes()[:8], "little")]
    tensors = load_file(path)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + np.ones_like(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})
    assert path.read_bytes()[: len(header)] == header  # the header did not move


def test_changed_weights_change_every_key(model):
    before = (stage_io.fingerprint(str(model)), input_fingerprint(str(model)))
    config = (model / "config.json").read_bytes()
    index = (model / "model.safetensors.index.json").read_bytes()
    _fine_tune(model)
    assert (model / "config.json").read_bytes() == config
    assert (model / "model.safetensors.index.json").read_bytes() == index
    after = (stage_io.fingerprint(str(model)), input_fingerprint(str(model)))
    assert after[0] != before[0]  # the pipeline's reference: a cache miss downstream
    assert after[1] != before[1]  # a checkpoint's input: a resume on them is refused
    # The durable-state key of a task that reads it moves with it.
    config = SFTConfig(base_policy=str(model))
    keys = [stage_io.state_key(config, {"base_policy": stage_io.reference(str(model), f)})
            for f in (before[0], after[0])]  # fmt: skip
    assert keys[0] != keys[1]


def test_a_copy_keeps_the_digest_and_the_cache_spares_a_second_read(model, tmp_path, monkeypatch):
    monkeypatch.setenv(file_digest.CACHE_ENV, str(tmp_path / "digests.json"))
    digest = file_digest.weights_digest(str(model))
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert file_digest.weights_digest(str(copy)) == digest
    assert input_fingerprint(str(copy)) == input_fingerprint(str(model))
    # Unchanged files (same size, time and inode) are read from the cache, not hashed again.
    reads = []
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda path, *a, **k: reads.append(str(path)) or real_open(path, *a, **k),
    )
    assert file_digest.weights_digest(str(model)) == digest
    assert not [path for path in reads if path.endswith(".safetensors")]


def test_a_folder_without_weights_has_no_weight_digest(tmp_path, monkeypatch):
    monkeypatch.setenv(file_digest.CACHE_ENV, str(tmp_path / "digests.json"))
    assert file_digest.weights_digest(str(tmp_path)) == ""
    (tmp_path / "damaged.json").write_text("{")
    monkeypatch.setenv(file_digest.CACHE_ENV, str(tmp_path / "damaged.json"))
    weights = tmp_path / "m" / "model.safetensors"
    weights.parent.mkdir()
    save_file({"w": np.zeros(3, np.float32)}, str(weights))
    assert file_digest.weights_digest(str(weights.parent))  # a damaged cache is started again
    assert os.path.getsize(tmp_path / "damaged.json") > 2
