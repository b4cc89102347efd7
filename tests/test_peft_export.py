"""LoRA export: merged weights, PEFT adapter files and logits against real ``peft``.

``tests/make_peft_fixtures.py`` (run by hand; needs torch, transformers and peft) builds
the policy below with :func:`lora_policy`, exports it with ``export_peft``, loads the base
with transformers and the adapter with ``peft.PeftModel.from_pretrained``, and stores the
adapter files peft loaded and peft's logits under ``tests/fixtures/peft``.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from components.core.config import LORA_TARGETS
from components.core.model import lora
from components.core.model.artifact import load_model, save_model
from components.core.model.transformer import Transformer
from components.hf import safetensors_io
from components.hf.export import ExportError, export_hf
from components.hf.importer import import_hf
from components.hf.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    export_peft,
    load_adapter,
    read_adapter_config,
)
from pipelines.cli.main import main

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
PEFT_FIXTURE = FIXTURES / "peft"
RANK, ALPHA = 4, 8.0
TARGETS = LORA_TARGETS  # all seven projections of an attention layer
BASE_MODEL = "alignpipe-tests/tiny-llama-base"  # the fixture's base_model_name_or_path
ADAPTER_STD = 0.2  # the adapters move the logits by up to ~9 (base vs peft, measured)
# Our fp32 logits vs peft's on the fixture tokens; make_peft_fixtures.py measured a max
# |difference| of 5.3e-6 (torch 2.13 cpu, transformers 5.24, peft 0.21.2).
LOGIT_ATOL = 1e-4


def lora_policy(root: str) -> tuple[str, str]:
    """The fixture's LoRA policy: the llama HF fixture with rank-4 adapters on every
    projection, A and B drawn from NumPy seed 0 (B nonzero, so the adapters matter).

    Returns (policy artifact, tokenizer folder).
    """
    base = f"{root}/base_artifact"
    import_hf(str(FIXTURES / "hf" / "llama"), base, dtype="float32")
    model, info = load_model(base)
    model = lora.attach(model, rank=RANK, alpha=ALPHA, targets=TARGETS, seed=0)
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    rng = np.random.default_rng(0)  # NumPy, not JAX's init: values pinned across versions
    for target in TARGETS:
        attn_or_mlp, name = lora.TARGET_PATHS[target]
        adapter = pure["blocks"][attn_or_mlp][name]["lora"]
        for matrix in ("lora_a", "lora_b"):
            shape = adapter[matrix].shape
            adapter[matrix] = (ADAPTER_STD * rng.standard_normal(shape)).astype(np.float32)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    policy = f"{root}/policy"
    save_model(
        policy,
        model,
        nnx.state(model, nnx.Param),
        tokenizer=info["tokenizer"],
        stage="sft",
        training={},
        step=1,
        hf=info["hf"],
    )
    return policy, f"{base}/tokenizer"


def logits(model: Transformer, tokens: np.ndarray) -> np.ndarray:
    """fp32 logits of ``tokens`` [B, T] (no padding)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    return np.asarray(model.lm_logits(model(tokens, jnp.ones_like(tokens))))


def read_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    names = list(safetensors_io.tensor_infos([str(path)]))
    return dict(safetensors_io.read_file_tensors(str(path), names))


def folder_tensors(folder: pathlib.Path) -> dict[str, np.ndarray]:
    tensors = {}
    for path in safetensors_io.checkpoint_files(str(folder)):
        tensors.update(read_tensors(pathlib.Path(path)))
    return tensors


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[str, str, pathlib.Path]:
    """(policy artifact, tokenizer folder, export folder written with --adapter's code)."""
    root = tmp_path_factory.mktemp("peft")
    policy, tokenizer = lora_policy(str(root))
    out = root / "hf"
    export_peft(policy, str(out), tokenizer_dir=tokenizer, dtype="float32", base_model=BASE_MODEL)
    return policy, tokenizer, out


def test_adapter_files_are_the_ones_peft_loaded(exported):
    adapter = exported[2] / "adapter"
    assert (adapter / ADAPTER_WEIGHTS).read_bytes() == (PEFT_FIXTURE / ADAPTER_WEIGHTS).read_bytes()
    ours, theirs = (
        read_tensors(adapter / ADAPTER_WEIGHTS),
        read_tensors(PEFT_FIXTURE / ADAPTER_WEIGHTS),
    )
    assert sorted(ours) == sorted(theirs)
    assert ours["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (RANK, 64)
    assert ours["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, RANK)
    for name, array in theirs.items():
        np.testing.assert_array_equal(ours[name], array, err_msg=name)
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert config == json.loads((PEFT_FIXTURE / ADAPTER_CONFIG).read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert config["base_model_name_or_path"] == BASE_MODEL


def test_our_logits_match_peft(exported):
    reference = np.load(PEFT_FIXTURE / "reference.npz")
    model, _ = load_model(exported[0])
    ours = logits(model, reference["tokens"])
    np.testing.assert_allclose(ours, reference["logits"], atol=LOGIT_ATOL, rtol=0)
    # The adapters really move the logits: the base alone is far from peft's.
    base, _ = load_model(str(exported[2].parent / "base_artifact"))
    base = logits(base, reference["tokens"])
    assert np.abs(base - reference["logits"]).max() > 0.1


def test_peft_adapter_reads_back_to_the_same_logits(exported):
    reference = np.load(PEFT_FIXTURE / "reference.npz")
    base, _ = load_model(str(exported[2].parent / "base_artifact"))
    adapted = load_adapter(base, str(PEFT_FIXTURE))
    assert adapted.config.lora_rank == RANK and adapted.config.lora_targets == TARGETS
    ours = logits(adapted, reference["tokens"])
    np.testing.assert_allclose(ours, reference["logits"], atol=LOGIT_ATOL, rtol=0)


def test_base_folder_is_the_base_and_merged_export_is_the_merged_model(exported, tmp_path):
    policy, tokenizer, out = exported
    original = folder_tensors(FIXTURES / "hf" / "llama")
    base = folder_tensors(out / "base")
    assert sorted(base) == sorted(original)
    for name, array in original.items():  # bf16 weights, exported as float32: exact
        np.testing.assert_array_equal(base[name], array.astype(np.float32), err_msg=name)
    model, info = load_model(policy)
    merged = lora.merge(model)
    save_model(
        str(tmp_path / "merged"),
        merged,
        nnx.state(merged, nnx.Param),
        tokenizer=info["tokenizer"],
        stage="sft",
        training={},
        step=1,
    )
    export_hf(str(tmp_path / "merged"), str(tmp_path / "hf"), tokenizer_dir=tokenizer,
              dtype="float32")  # fmt: skip
    expected, ours = folder_tensors(tmp_path / "hf"), folder_tensors(out)
    assert sorted(ours) == sorted(expected)
    for name, array in expected.items():
        np.testing.assert_array_equal(ours[name], array, err_msg=name)
    assert not np.array_equal(ours["model.layers.0.self_attn.q_proj.weight"],
                              base["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip


def test_refusals(exported, tmp_path):
    base_artifact = str(exported[2].parent / "base_artifact")
    with pytest.raises(ExportError, match="no LoRA adapters.*without --adapter"):
        export_peft(base_artifact, str(tmp_path / "out"))
    config = json.loads((PEFT_FIXTURE / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_rslora": True}))
    with pytest.raises(AdapterError, match="use_rslora"):
        read_adapter_config(str(tmp_path))
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "target_modules": "q_proj"}))
    with pytest.raises(AdapterError, match="target_modules"):
        read_adapter_config(str(tmp_path))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter_config(str(tmp_path / "missing"))


def test_cli_export_with_adapter(exported, tmp_path, capsys):
    policy, tokenizer, _ = exported
    out = tmp_path / "hf"
    args = ["model", "export", policy, str(out), "--tokenizer", tokenizer, "--adapter"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["adapter"] == str(out / "adapter") and summary["lora_rank"] == RANK
    config = json.loads((out / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["base_model_name_or_path"] == str((out / "base").resolve())
    assert (out / "config.json").exists() and (out / "base" / "tokenizer.json").exists()
    assert main(["model", "export", policy, str(tmp_path / "x"), "--base-model", "m"]) == 2
    assert "add --adapter" in capsys.readouterr().err
    base_artifact = str(exported[2].parent / "base_artifact")
    assert main(["model", "export", base_artifact, str(tmp_path / "y"), "--adapter"]) == 2
    assert "no LoRA adapters" in capsys.readouterr().err
