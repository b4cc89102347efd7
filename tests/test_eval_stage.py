"""The evaluate stage end to end on real shard, sft and reward artifacts (tiny models)."""

import html.parser
import json
import logging
import shutil

import numpy as np
import pytest

from components import reward, sft, shard
from components.core.builtin_task import GOLD_REWARD_NAME, write_jsonl
from components.core.checkpoint import ModelArtifactError
from components.core.input_pipeline import DataError
from components.core.model_io import ModelMismatchError
from components.evaluate import EvalConfig, run
from components.evaluate.generation import map_batches
from components.evaluate.report import format_figure
from components.evaluate.stage import gold_reward_name
from components.reward import RewardConfig
from components.sft import SFTConfig
from components.shard import ShardConfig

TRAIN = dict(
    preset="tiny", batch_size=16, max_len=96, eval_every=1000, save_every=1000, warmup_steps=2
)
# Two samples per prompt and a batch that does not divide the rows: the last batch is padded.
CONFIG = EvalConfig(samples_per_prompt=2, max_new_tokens=32, bootstrap_samples=200, batch_size=48)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Shards of the built-in task, two sft policies trained for different steps, a reward model."""
    root = tmp_path_factory.mktemp("eval_artifacts")
    write_jsonl(str(root / "pairs.jsonl"), 400)
    paths = {name: str(root / name) for name in ("shards", "aligned", "reference", "rm")}
    shard.run(
        ShardConfig(num_shards=2, eval_fraction=0.2), [str(root / "pairs.jsonl")], paths["shards"]
    )
    sft.run(SFTConfig(steps=2, **TRAIN), paths["shards"], paths["reference"])
    sft.run(SFTConfig(steps=10, learning_rate=3e-3, **TRAIN), paths["shards"], paths["aligned"])
    reward.run(RewardConfig(steps=6, **TRAIN), paths["shards"], paths["rm"])
    paths["root"] = str(root)
    return paths


@pytest.fixture(scope="module")
def evaluated(artifacts):
    """The stage on aligned vs reference: its result and its output folder."""
    out = artifacts["root"] + "/eval"
    a = artifacts
    result = run(CONFIG, a["shards"], a["aligned"], a["reference"], a["rm"], out)
    return result, out


def _manifest(artifacts):
    with open(artifacts["shards"] + "/manifest.json") as handle:
        return json.load(handle)


def test_writes_report_eval_json_and_flat_metrics(evaluated):
    result, out = evaluated
    record = json.load(open(f"{out}/eval.json"))
    assert record["blessed"] is result["blessed"]
    assert len(record["reasons"]) == 3
    assert record["summary"]["win_rate"] == result["win_rate"]
    metrics = json.load(open(f"{out}/metrics.json"))
    assert metrics["blessed"] == float(result["blessed"])
    assert metrics["win_rate.value"] == result["win_rate"]["value"]
    assert metrics["kl.per_token"] == result["kl"]["per_token"]
    assert all(isinstance(value, float) for value in metrics.values())
    assert not any(key.startswith("reward_histogram") for key in metrics)


def test_every_eval_prompt_and_pair_is_measured(evaluated, artifacts):
    result, _ = evaluated
    eval_split = _manifest(artifacts)["splits"]["eval"]
    assert result["num_prompts"] == eval_split["unique_prompts"]  # none lost to batching
    assert result["samples_per_prompt"] == 2
    counts = result["win_rate"]
    assert counts["wins"] + counts["ties"] + counts["losses"] == result["num_prompts"]
    assert result["reward_model_accuracy"]["num_pairs"] == eval_split["pairs"]
    for policy in ("aligned", "reference"):
        assert 1 <= result["response_length"][policy]["mean"] <= CONFIG.max_new_tokens
        assert 0.0 <= result["eos_rate"][policy] <= 1.0


def test_different_policies_have_positive_kl(evaluated):
    result, _ = evaluated
    assert result["kl"]["per_token"] > 0
    assert result["win_rate"]["low"] <= result["win_rate"]["value"] <= result["win_rate"]["high"]


def test_gold_measures_for_the_builtin_task(evaluated):
    result, out = evaluated
    gold = result["gold"]
    assert gold["name"] == GOLD_REWARD_NAME
    assert -1.0 <= gold["aligned"]["mean"] <= 1.5
    assert 0.0 <= gold["win_rate"]["value"] <= 1.0
    page = open(f"{out}/report.html", encoding="utf-8").read()
    assert f"win rate ({GOLD_REWARD_NAME})" in page


class _Figures(html.parser.HTMLParser):
    """Text of every element carrying data-key, and the verdict's data-blessed."""

    def __init__(self):
        super().__init__()
        self.figures, self.blessed, self._key = {}, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self._key = attrs.get("data-key")
        if "data-blessed" in attrs:
            self.blessed = attrs["data-blessed"] == "true"

    def handle_data(self, data):
        if self._key is not None:
            self.figures[self._key] = data
            self._key = None


def _at(tree, path):
    for key in path.split("."):
        tree = tree[key]
    return tree


def test_report_verdict_and_figures_match_eval_json(evaluated):
    _, out = evaluated
    record = json.load(open(f"{out}/eval.json"))
    page = _Figures()
    page.feed(open(f"{out}/report.html", encoding="utf-8").read())
    assert page.blessed is record["blessed"]
    assert {"win_rate.value", "kl.per_token", "gold.win_rate.value"} <= set(page.figures)
    for path, shown in page.figures.items():
        assert shown == format_figure(_at(record["summary"], path)), path
    text = open(f"{out}/report.html", encoding="utf-8").read()
    assert "no reward-model metrics given" not in text  # the reward stage's curve is drawn


def test_identical_policies_tie_everywhere_with_zero_kl(artifacts):
    a = artifacts
    out = a["root"] + "/identical"
    result = run(CONFIG, a["shards"], a["reference"], a["reference"], a["rm"], out)
    # Same seed, same row keys: identical policies sample identical responses.
    assert result["kl"] == {"per_sequence": 0.0, "per_token": 0.0}
    assert result["win_rate"]["value"] == 0.5
    assert result["win_rate"]["ties"] == result["num_prompts"]
    assert result["reward"]["difference"]["value"] == 0.0
    assert result["gold"]["win_rate"]["value"] == 0.5
    assert result["blessed"]  # win-rate lower bound 0.5 ≥ 0.5 and KL 0


def test_results_do_not_depend_on_the_batch_size_or_sharding(
    artifacts, evaluated, sharded_placements
):
    """Batches of 16 and the models in chunks over the devices (fsdp): the same figures."""
    a = artifacts
    config = EvalConfig(
        samples_per_prompt=2, max_new_tokens=32, bootstrap_samples=200, batch_size=16, fsdp=True
    )
    result = run(config, a["shards"], a["aligned"], a["reference"], a["rm"], a["root"] + "/b16")
    assert len(sharded_placements) == 3 and all(sharded_placements)  # policy, reference, RM
    first, _ = evaluated
    assert result["win_rate"] == first["win_rate"]
    assert result["kl"]["per_token"] == pytest.approx(first["kl"]["per_token"], abs=1e-6)


def test_map_batches_pads_the_last_batch_and_drops_the_padding():
    rows = np.arange(13)
    calls = []

    def step(batch):
        calls.append(batch["x"].shape)
        return (batch["x"] * 10,)

    (out,) = map_batches(step, {"x": rows}, batch_size=8)
    np.testing.assert_array_equal(out, rows * 10)
    assert calls == [(8, 1), (8, 1)]  # 8 devices x 1 row, twice: 16 rows for 13


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.load(open(f"{dst}/config.json"))
    for key, value in changes.items():
        config[key] = value
    json.dump(config, open(f"{dst}/config.json", "w"))
    return dst


def test_refuses_a_model_with_another_tokenizer(artifacts, tmp_path):
    a = artifacts
    info = json.load(open(a["rm"] + "/config.json"))
    foreign = _copy_with_config(
        a["rm"], str(tmp_path / "rm"), tokenizer={**info["tokenizer"], "fingerprint": "0" * 16}
    )
    with pytest.raises(ModelMismatchError, match="trained with tokenizer 0000"):
        run(CONFIG, a["shards"], a["aligned"], a["reference"], foreign, str(tmp_path / "o"))


def test_missing_or_misplaced_inputs_are_clear_errors(artifacts, tmp_path):
    a = artifacts
    out = str(tmp_path / "o")
    with pytest.raises(ModelArtifactError, match="config.json not found"):
        run(CONFIG, a["shards"], str(tmp_path / "none"), a["reference"], a["rm"], out)
    with pytest.raises(DataError, match="not a preference-shards folder"):
        run(CONFIG, str(tmp_path), a["aligned"], a["reference"], a["rm"], out)
    with pytest.raises(ModelMismatchError, match="no reward head"):
        run(CONFIG, a["shards"], a["aligned"], a["reference"], a["reference"], out)
    with pytest.raises(ModelMismatchError, match="is a reward model"):
        run(CONFIG, a["shards"], a["rm"], a["reference"], a["rm"], out)
    with pytest.raises(ValueError, match="max_new_tokens: 200 leaves no room"):
        run(EvalConfig(max_new_tokens=200), a["shards"], a["aligned"], a["reference"], a["rm"], out)


def test_gold_reward_comes_from_the_config_else_a_known_manifest_name(caplog):
    assert gold_reward_name(EvalConfig(), {"gold_reward": GOLD_REWARD_NAME}) == GOLD_REWARD_NAME
    assert gold_reward_name(EvalConfig(), {"gold_reward": None}) == ""
    chosen = EvalConfig(gold_reward=GOLD_REWARD_NAME)
    assert gold_reward_name(chosen, {"gold_reward": None}) == GOLD_REWARD_NAME
    with caplog.at_level(logging.WARNING):
        assert gold_reward_name(EvalConfig(), {"gold_reward": "someone/else"}) == ""
    assert "unknown gold reward 'someone/else'" in caplog.text
