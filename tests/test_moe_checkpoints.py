"""Mixture-of-experts checkpoints (components/hf/moe.py, qwen3_next.py): the fixtures
(tests/fixtures/hf: qwen3_moe, qwen2_moe and mixtral, per-expert tensors as transformers 5
saves them, Mixtral's under its own names; qwen3_5_moe_mm, fused as Qwen3.5 MoE's releases
store them; qwen3_vl_moe, fused and transposed as Qwen3-VL MoE's; qwen3_next, its DeltaNet
projections fused; gemma4_moe) exported back and loaded by transformers as its MoE classes;
the stored layouts read alike; Qwen3-Next's round trip; class defaults of configs that
leave fields out; the planner's parameter count against the model's and the published ones
(Qwen3-30B-A3B 30.5B, Mixtral 8x7B 46.7B, Qwen1.5-MoE-A2.7B 14.3B, Qwen3-Next-80B-A3B 80B);
what is refused. The layers themselves: test_moe.py.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from components.core.model.artifact import load_model
from components.core.model.transformer import Transformer
from components.hf import qwen3_next, safetensors_io
from components.hf.export import export_hf
from components.hf.families import HFImportError, family_of_config, model_config_from_hf
from components.hf.importer import import_hf
from components.hf.safetensors_io import TensorInfo
from pipelines.dag.memory import param_count

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"


def _assert_import_alike(first: pathlib.Path, second: pathlib.Path, tmp_path) -> None:
    """Two checkpoint folders import into the same parameters, bit for bit."""
    models = [
        load_model(import_hf(str(folder), str(tmp_path / name))["out"])[0]
        for folder, name in ((first, "first"), (second, "second"))
    ]
    leaves = [jax.tree.leaves(nnx.state(model, nnx.Param)) for model in models]
    for a, b in zip(*leaves, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    ("fixture", "architecture", "stored"),
    [
        ("qwen3_moe", "Qwen3MoeForCausalLM", "model.layers.1.mlp.experts.7.down_proj.weight"),
        ("qwen2_moe", "Qwen2MoeForCausalLM", "model.layers.1.mlp.shared_expert_gate.weight"),
        # Mixtral's own names, which transformers 5 renames on load and back on save.
        ("mixtral", "MixtralForCausalLM", "model.layers.1.block_sparse_moe.experts.7.w3.weight"),
        # Qwen3-Next back as itself: its DeltaNet projections fused again.
        ("qwen3_next", "Qwen3NextForCausalLM", "model.layers.2.linear_attn.in_proj_qkvz.weight"),
        # Qwen3-VL MoE's language model is a Qwen3 MoE (its experts read transposed).
        ("qwen3_vl_moe", "Qwen3MoeForCausalLM", "model.layers.1.mlp.experts.7.up_proj.weight"),
        ("qwen3_5_moe_mm", "Qwen3_5MoeForCausalLM", "model.layers.1.mlp.experts.7.up_proj.weight"),
        # transformers has no conversion for Gemma 4's experts: saved and loaded fused.
        ("gemma4_moe", "Gemma4ForCausalLM", "model.layers.1.experts.gate_up_proj"),
    ],
)
def test_the_export_loads_in_transformers_as_its_moe_class(fixture, architecture, stored, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    imported = import_hf(str(FIXTURES / fixture), str(tmp_path / "imported"))["out"]
    out = tmp_path / "export"
    export_hf(imported, str(out), dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert config.get("num_experts", config.get("num_local_experts")) == 8
    names = safetensors_io.tensor_infos(safetensors_io.checkpoint_files(str(out)))
    assert stored in names  # as transformers saves them
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reference = np.load(FIXTURES / fixture / "reference.npz")
    with torch.no_grad():
        logits = model(torch.tensor(reference["tokens"])).logits.numpy()
    np.testing.assert_allclose(logits, reference["logits"], atol=1e-4)


def test_fused_and_per_expert_layouts_import_alike(tmp_path):
    """Qwen3.5 MoE's releases fuse each layer's experts (gate_up_proj [E, 2F, D], down_proj
    [E, D, F]); transformers 5 saves them one by one. Both read into the same params."""
    folder = tmp_path / "per_expert"
    shutil.copytree(FIXTURES / "qwen3_5_moe_mm", folder)
    path = folder / "model.safetensors"
    names = list(safetensors_io.tensor_infos([str(path)]))
    tensors = dict(safetensors_io.read_file_tensors(str(path), names))
    split = {}
    for name, value in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            head, half = name.removesuffix(".gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                split[f"{head}.{e}.gate_proj.weight"] = value[e, :half]
                split[f"{head}.{e}.up_proj.weight"] = value[e, half:]
        elif name.endswith(".mlp.experts.down_proj"):
            head = name.removesuffix(".down_proj")
            for e in range(value.shape[0]):
                split[f"{head}.{e}.down_proj.weight"] = value[e]
        else:
            split[name] = value
    safetensors_io.write_file(str(path), split)
    _assert_import_alike(FIXTURES / "qwen3_5_moe_mm", folder, tmp_path)


# Qwen/Qwen3-30B-A3B's config.json (its model card: 30.5B parameters, 3.3B activated).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
}  # fmt: skip


# mistralai/Mixtral-8x7B-v0.1's config.json (its model card: 46.7B parameters, 12.9B a token).
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "max_position_embeddings": 32768, "num_local_experts": 8,
    "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
    "router_aux_loss_coef": 0.02, "output_router_logits": False,
}  # fmt: skip


# Qwen/Qwen1.5-MoE-A2.7B's config.json (its model card: 14.3B parameters, 2.7B activated).
QWEN1_5_MOE_A2_7B = {
    "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
    "vocab_size": 151936, "max_position_embeddings": 8192, "num_experts": 60,
    "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1,
    "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "hidden_act": "silu",
}  # fmt: skip


# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (its model card: 80B parameters, 3B activated;
# its multi-token-prediction layer, left out on import, is not counted).
QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "intermediate_size": 5120,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "vocab_size": 151936, "max_position_embeddings": 262144,
    "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "partial_rotary_factor": 0.25, "rope_theta": 10000000,
    "rope_scaling": None, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
    "attention_bias": False, "use_sliding_window": False, "hidden_act": "silu",
}  # fmt: skip


def test_the_planner_counts_every_expert():
    fixtures = (
        "qwen3_moe", "qwen3_5_moe_mm", "gemma4_moe", "mixtral", "qwen2_moe", "qwen3_next",
        "qwen3_vl_moe",
    )  # fmt: skip
    for fixture in fixtures:
        hf = json.loads((FIXTURES / fixture / "config.json").read_text())
        config = model_config_from_hf(hf, dtype="float32")
        abstract = nnx.eval_shape(lambda c=config: Transformer(c, rngs=nnx.Rngs(0)))
        count = sum(p.size for p in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
        assert param_count(config) == count, fixture
    big = model_config_from_hf(QWEN3_30B_A3B, dtype="bfloat16")
    assert (big.n_experts, big.experts_per_token, big.expert_dim) == (128, 8, 768)
    assert abs(param_count(big) / 30.5e9 - 1) < 0.005  # 30.53B
    mixtral = model_config_from_hf(MIXTRAL_8X7B, dtype="bfloat16")
    assert (mixtral.n_experts, mixtral.experts_per_token, mixtral.expert_dim) == (8, 2, 14336)
    assert mixtral.norm_topk_prob and not mixtral.tie_embeddings
    assert abs(param_count(mixtral) / 46.7e9 - 1) < 0.005  # 46.70B
    qwen2 = model_config_from_hf(QWEN1_5_MOE_A2_7B, dtype="bfloat16")
    assert (qwen2.n_experts, qwen2.shared_expert_dim, qwen2.qkv_bias) == (60, 5632, True)
    assert not qwen2.norm_topk_prob and qwen2.sliding_window is None
    assert abs(param_count(qwen2) / 14.3e9 - 1) < 0.005  # 14.32B
    qwen3_next = model_config_from_hf(QWEN3_NEXT_80B_A3B, dtype="bfloat16")
    assert qwen3_next.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert (qwen3_next.rotary_fraction, qwen3_next.n_experts) == (0.25, 512)
    assert abs(param_count(qwen3_next) / 80e9 - 1) < 0.005  # 79.67B


@pytest.mark.parametrize(
    ("fixture", "changes", "named"),
    [
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
        ("qwen3_moe", {"shared_expert_intermediate_size": 16}, "a shared expert in a Qwen3 MoE"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "experts_per_token (9)"),
        ("qwen3_5_moe_mm", {"shared_expert_intermediate_size": 0}, "without its shared expert"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "lacks 'moe_intermediate_size'"),
        ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "Qwen2 MoE without its shared"),
        ("qwen2_moe", {"qkv_bias": False}, "qkv_bias=false"),
        ("qwen2_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ("mixtral", {"num_local_experts": None}, "lacks 'num_local_experts'"),
        ("mixtral", {"shared_expert_intermediate_size": 16}, "a shared expert in a Mixtral"),
        ("qwen2_moe", {"num_experts": 0}, "Qwen2 MoE with no experts"),
    ],
)
def test_unmodelled_or_broken_expert_configs_are_refused_by_name(fixture, changes, named):
    hf = json.loads((FIXTURES / fixture / "config.json").read_text())
    target = hf["text_config"] if "text_config" in hf else hf
    for key, value in changes.items():
        if value is None:
            del target[key]
        else:
            target[key] = value
    with pytest.raises(HFImportError, match=re.escape(named)):
        model_config_from_hf(hf, dtype="float32")


def test_a_qwen3_moe_config_that_does_not_say_is_untied():
    """Qwen3MoeConfig's tie_word_embeddings default is false, Qwen3Config's true: a config
    without the key keeps its own lm_head (tied, the head would be dropped)."""
    hf = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    del hf["tie_word_embeddings"]
    assert not model_config_from_hf(hf, dtype="float32").tie_embeddings
    dense = json.loads((FIXTURES / "qwen3" / "config.json").read_text())
    del dense["tie_word_embeddings"]
    assert model_config_from_hf(dense, dtype="float32").tie_embeddings


def test_a_multimodal_qwen3_5_moe_text_config_takes_its_own_class_defaults():
    """Fields a Qwen3_5MoeForConditionalGeneration text_config leaves out are
    Qwen3_5MoeTextConfig's (35B-A3B's shape), not the dense Qwen3.5's."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.Qwen3_5MoeTextConfig()
    hf = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": {}}
    ours = model_config_from_hf(hf, dtype="bfloat16")
    assert (ours.dim, ours.n_layers, ours.n_kv_heads) == (
        theirs.hidden_size,
        theirs.num_hidden_layers,
        theirs.num_key_value_heads,
    )
    assert (ours.n_experts, ours.experts_per_token, ours.expert_dim, ours.shared_expert_dim) == (
        theirs.num_experts, theirs.num_experts_per_tok, theirs.moe_intermediate_size,
        theirs.shared_expert_intermediate_size,
    )  # fmt: skip


def test_qwen3_vl_moe_text_config_defaults_are_its_class_defaults():
    """Fields a Qwen3VLMoeForConditionalGeneration text_config leaves out are
    Qwen3VLMoeTextConfig's (head_dim derived from the width, as that class derives it)."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.Qwen3VLMoeTextConfig(hidden_size=1024, num_attention_heads=16)
    hf = {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "text_config": {"hidden_size": 1024, "num_attention_heads": 16},
    }
    ours = model_config_from_hf(hf, dtype="bfloat16")
    assert (ours.resolved_head_dim, ours.n_layers, ours.n_experts, ours.expert_dim) == (
        theirs.head_dim, theirs.num_hidden_layers, theirs.num_experts,
        theirs.moe_intermediate_size,
    )  # fmt: skip
    assert ours.norm_topk_prob and not ours.tie_embeddings


def test_transposed_and_untransposed_fused_experts_import_alike(tmp_path):
    """Qwen3-VL MoE's releases store the fused experts transposed ([E, D, 2F], [E, F, D]);
    transformers 5 saves them as it holds them ([E, 2F, D], [E, D, F]) and reads either by
    shape. So does the import."""
    folder = tmp_path / "untransposed"
    shutil.copytree(FIXTURES / "qwen3_vl_moe", folder)
    path = folder / "model.safetensors"
    tensors = dict(
        safetensors_io.read_file_tensors(str(path), list(safetensors_io.tensor_infos([str(path)])))
    )
    fused = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
    assert any(name.endswith(fused) for name in tensors)
    safetensors_io.write_file(
        str(path), {n: v.transpose(0, 2, 1) if n.endswith(fused) else v for n, v in tensors.items()}
    )
    _assert_import_alike(FIXTURES / "qwen3_vl_moe", folder, tmp_path)


def test_a_mixtral_in_transformers_5s_own_layout_imports_alike(tmp_path):
    """transformers 5 loads a Mixtral saved with save_original_format=False (mlp.gate, fused
    mlp.experts.gate_up_proj / down_proj); it reads into the same params as Mixtral's names.
    A Mixtral config without a rotary base has MixtralConfig's, 1e6."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "fused"
    model = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / "mixtral")
    model.to(torch.bfloat16).save_pretrained(folder, save_original_format=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(FIXTURES / "mixtral" / name, folder / name)
    names = safetensors_io.tensor_infos(safetensors_io.checkpoint_files(str(folder)))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    _assert_import_alike(folder, FIXTURES / "mixtral", tmp_path)
    hf = json.loads((FIXTURES / "mixtral" / "config.json").read_text())
    del hf["rope_parameters"]
    assert model_config_from_hf(hf, dtype="float32").rope_theta == 1e6


def test_a_qwen3_next_round_trip_is_exact(tmp_path):
    """Imported and exported as it was saved (bfloat16): the same tensors, bit for bit
    (its DeltaNet projections fused back), and Qwen3-Next's config fields."""
    imported = import_hf(str(FIXTURES / "qwen3_next"), str(tmp_path / "imported"))["out"]
    export_hf(imported, str(tmp_path / "export"), dtype="bfloat16")
    original = FIXTURES / "qwen3_next" / "model.safetensors"
    names = list(safetensors_io.tensor_infos([str(original)]))
    exported = dict(
        safetensors_io.read_file_tensors(str(tmp_path / "export" / "model.safetensors"), names)
    )
    for name, value in safetensors_io.read_file_tensors(str(original), names):
        np.testing.assert_array_equal(exported.pop(name), value, err_msg=name)
    assert not exported
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    hf = json.loads((FIXTURES / "qwen3_next" / "config.json").read_text())
    for key in ("model_type", "layer_types", "rope_parameters", "norm_topk_prob", "head_dim"):
        assert config[key] == hf[key], key
    # transformers 4.57's Qwen3NextConfig reads the base from rope_theta alone (default 1e4).
    assert config["rope_theta"] == hf["rope_parameters"]["rope_theta"] == 1e7


def test_qwen3_next_routes_as_its_config_says_and_exports_only_renormalised():
    """Qwen3-Next reads norm_topk_prob (default true); Qwen3.5 MoE, its export, always
    renormalises, so a Qwen3-Next that does not has no architecture to export as."""
    hf = json.loads((FIXTURES / "qwen3_next" / "config.json").read_text())
    assert model_config_from_hf(hf, dtype="float32").norm_topk_prob
    del hf["norm_topk_prob"]
    assert model_config_from_hf(hf, dtype="float32").norm_topk_prob
    raw = model_config_from_hf({**hf, "norm_topk_prob": False}, dtype="float32")
    assert not raw.norm_topk_prob
    with pytest.raises(ValueError, match="no Hugging Face architecture"):
        family_of_config(raw, "qwen3_5")


def test_qwen3_next_fused_projections_split_into_qwen3_5_rows():
    """Per key head, in_proj_qkvz holds q, k, its value heads' v and z; in_proj_ba their b
    and a. Qwen3.5's in_proj_qkv is every q, then every k, then every v."""
    hf = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 1,
          "linear_value_head_dim": 1}  # fmt: skip
    infos = {
        "l.linear_attn.in_proj_qkvz.weight": TensorInfo("f", "F32", (12, 3)),
        "l.linear_attn.in_proj_ba.weight": TensorInfo("f", "F32", (8, 3)),
    }
    split = qwen3_next.split_projections(infos, hf)
    # group 0: rows q0 k0 v0 v1 z0 z1; group 1: q1 k1 v2 v3 z2 z3 (rows 6-11)
    assert split["l.linear_attn.in_proj_qkv.weight"].rows == (0, 6, 1, 7, 2, 3, 8, 9)
    assert split["l.linear_attn.in_proj_z.weight"].rows == (4, 5, 10, 11)
    assert split["l.linear_attn.in_proj_b.weight"].rows == (0, 1, 4, 5)
    assert split["l.linear_attn.in_proj_a.weight"].rows == (2, 3, 6, 7)
    assert (
        split["l.linear_attn.in_proj_qkv.weight"].stored_as == "l.linear_attn.in_proj_qkvz.weight"
    )
    wrong = {"l.linear_attn.in_proj_qkvz.weight": TensorInfo("f", "F32", (13, 3))}
    assert qwen3_next.split_projections(wrong, hf) == wrong  # left for the shape check to name
