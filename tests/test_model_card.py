"""An export writes a Hugging Face model card: front matter the Hub reads, how the policy was
trained, and for a promoted version its evaluation and the gate's decision."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from components.hf.export import export_hf
from components.hf.importer import hub_id, import_hf
from components.hf.model_card import model_card

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
RECORD = {
    "blessed": True,
    "gate_judge": "gold",
    "reasons": ["win-rate lower bound (judged by the gold reward) 0.70 > 0.50: pass"],
    "run_id": "alignpipe-2026-12-04-19-54-04",
    "algorithm": "grpo",
    "version": 3,
    "time": "2026-12-04T19:59:23+00:00",
    "data": [{"uri": "gs://b/prefs/a.jsonl"}],
    "figures": {
        "num_prompts": 103.0,
        "confidence": 0.95,
        "win_rate/value": 0.7195,
        "win_rate/low": 0.6924,
        "win_rate/high": 0.7444,
        "gold/difference/value": 0.2849,
        "gold/difference/low": 0.2555,
        "gold/difference/high": 0.3121,
        "ppo_vs_best_of_n": 1.2302,
        "ppo_vs_best_of_n_interval/low": 1.0807,
        "ppo_vs_best_of_n_interval/high": 1.3691,
        "kl/per_token": 0.04489,
    },  # fmt: skip
}


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_a_promoted_versions_card_carries_its_run_figures_and_gate(tmp_path):
    artifact = import_hf(str(FIXTURES / "qwen3"), str(tmp_path / "version"))["out"]
    (Path(artifact) / "PROMOTED.json").write_text(json.dumps(RECORD))
    export_hf(artifact, str(tmp_path / "qwen3-aligned"))
    card = (tmp_path / "qwen3-aligned" / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["library_name"] == "transformers" and "base_model" not in meta  # no Hub id
    assert meta["tags"] == ["alignpipe", "rlhf", "qwen3", "grpo"]
    assert "# qwen3-aligned" in card and "base architecture: Qwen3ForCausalLM" in card
    assert "| win rate against the reference (reward model) | 0.720 [0.692, 0.744] |" in card
    assert "| gold gain | 0.285 [0.256, 0.312] |" in card
    assert "| gain over best-of-n at the same KL | 1.230 [1.081, 1.369] |" in card
    assert "Gate: promoted (blessed); judge: gold." in card
    assert "run: alignpipe-2026-12-04-19-54-04, promoted as version 3" in card
    assert "- data: `gs://b/prefs/a.jsonl`" in card and RECORD["reasons"][0] in card


def test_a_hub_cache_folder_names_its_base_model(tmp_path):
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    shutil.copytree(FIXTURES / "qwen3", snapshot)
    assert hub_id(str(snapshot)) == "Qwen/Qwen3-0.6B" and hub_id(str(FIXTURES)) is None
    artifact = import_hf(str(snapshot), str(tmp_path / "artifact"))["out"]
    export_hf(artifact, str(tmp_path / "out"))
    meta = _front_matter((tmp_path / "out" / "README.md").read_text())
    assert meta["base_model"] == "Qwen/Qwen3-0.6B"


def test_a_card_without_a_promotion_says_how_it_was_trained():
    info = {"stage": "ppo", "step": 50, "training": {"algorithm": "ppo", "kl_target": 0.045}}
    card = model_card(info, "llama", None, "aligned")
    assert "- stage: ppo, step 50" in card and "- kl_target: 0.045" in card
    assert "## Evaluation" not in card and _front_matter(card)["tags"][-1] == "ppo"
