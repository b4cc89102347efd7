"""The evaluate stage end to end on real shard, sft and reward artifacts (tiny models)."""

import dataclasses
import html.parser
import json
import logging
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components import reward, sft, shard
from components.core.data.builtin_task import GOLD_REWARD_NAME, gold_reward, write_jsonl
from components.core.data.input_pipeline import DataError
from components.core.model import eval_sampling
from components.core.model.artifact import ModelMismatchError, create_model
from components.core.training.checkpoint import ModelArtifactError
from components.evaluate import EvalConfig, generation, measures, run
from components.evaluate.gate import decide
from components.evaluate.report import format_figure
from components.evaluate.stage import gold_reward_name
from components.reward import RewardConfig
from components.sft import SFTConfig
from components.shard import ShardConfig

TRAIN = dict(
    preset="tiny", batch_size=16, max_len=96, eval_every=1000, save_every=1000, warmup_steps=2
)
# Two samples per prompt and a batch that does not divide the rows: the last batch is padded.
# The best-of-n baseline keeps its default: 16 reference samples per prompt.
CONFIG = EvalConfig(samples_per_prompt=2, max_new_tokens=32, bootstrap_samples=200, batch_size=48)
USER_GOLD = "def length_score(prompt, response):\n    return len(response.split()) / 10\n"


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


def _samples(out):
    with open(f"{out}/samples.jsonl", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


def test_writes_report_eval_json_and_flat_metrics(evaluated):
    result, out = evaluated
    record = json.load(open(f"{out}/eval.json"))
    assert record["blessed"] is result["blessed"]
    # win rate, KL, KL to the anchor, response length over the reference's, finite figures
    assert len(record["reasons"]) == 5
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
    # Each of the 2 aligned samples against each of the reference's 16 draws (best-of-16),
    # but the one drawn with its own key: 30 independent pairs a prompt.
    comparisons = result["num_prompts"] * (2 * 16 - 2)
    assert counts["wins"] + counts["ties"] + counts["losses"] == counts["pairs"] == comparisons
    assert counts["coupled"]["pairs"] == result["num_prompts"] * 2
    assert result["reward_model_accuracy"]["num_pairs"] == eval_split["pairs"]
    for policy in ("aligned", "reference"):
        assert 1 <= result["response_length"][policy]["mean"] <= CONFIG.max_new_tokens
        assert 0.0 <= result["eos_rate"][policy] <= 1.0


def test_different_policies_have_positive_kl(evaluated):
    result, _ = evaluated
    assert result["kl"]["per_token"] > 0
    assert result["win_rate"]["low"] <= result["win_rate"]["value"] <= result["win_rate"]["high"]


def test_samples_jsonl_holds_every_sample_and_agrees_with_eval_json(evaluated):
    result, out = evaluated
    rows = _samples(out)
    assert len(rows) == result["num_prompts"] * 2
    assert [(r["prompt_index"], r["sample"]) for r in rows[:3]] == [(0, 0), (0, 1), (1, 0)]
    aligned = np.array([r["aligned_reward"] for r in rows]).reshape(-1, 2)
    reference = np.array([r["reference_reward"] for r in rows]).reshape(-1, 2)
    # samples.jsonl pairs sample s with sample s: the same-key pairing's figure.
    assert measures.win_rate(aligned, reference) == result["win_rate"]["coupled"]["value"]
    assert aligned.mean() == pytest.approx(result["reward"]["aligned"]["mean"], abs=1e-6)
    for row in rows[:20]:  # gold scores are the task's own of the texts shown
        assert row["aligned_gold"] == gold_reward(row["prompt"], row["aligned_response"])
        assert row["reference_gold"] == gold_reward(row["prompt"], row["reference_response"])
    gold = np.mean([r["reference_gold"] for r in rows])
    assert gold == pytest.approx(result["gold"]["reference"]["mean"], abs=1e-9)
    # Each sample's KL and tokens add up to eval.json's KL per token and per sequence.
    kl, tokens = (np.array([r[k] for r in rows]) for k in ("aligned_kl", "aligned_tokens"))
    assert tokens.min() >= 1 and tokens.dtype.kind == "i"
    assert kl.sum() / tokens.sum() == pytest.approx(result["kl"]["per_token"], rel=1e-9)
    assert kl.mean() == pytest.approx(result["kl"]["per_sequence"], rel=1e-9)


def test_best_of_n_baseline(evaluated):
    """Best-of-1 is the mean of the reference's draws; more n, higher reward-model score."""
    result, out = evaluated
    frontier = result["best_of_n"]
    assert [p["n"] for p in frontier] == [1, 2, 4, 8, 16]
    bounds = [measures.best_of_n_kl_bound(n) for n in (1, 2, 4, 8, 16)]
    assert [p["kl_bound"] for p in frontier] == pytest.approx(bounds)
    # The exact KL of the judge's score levels: 0 at n = 1, growing with n, under the bound.
    exact = [p["kl_per_sequence"] for p in frontier]
    assert exact[0] == 0.0 and all(0 < e <= b for e, b in zip(exact[1:], bounds[1:], strict=True))
    assert exact == sorted(exact)
    rewards = [p["reward"] for p in frontier]
    assert rewards == sorted(rewards) and rewards[-1] > rewards[0]
    assert all(-1.0 <= p["gold"] <= 1.0 for p in frontier)
    # Best-of-n at the aligned KL: a real n between the frontier's, whose KL is the
    # aligned policy's, and the ratio as eval.json states it, from its own figures.
    at_kl = result["best_of_n_at_kl"]
    assert at_kl["kl_per_sequence"] == pytest.approx(result["kl"]["per_sequence"])
    kls = [p["kl_per_sequence"] for p in frontier]
    assert result["ppo_vs_best_of_n_capped"] is (at_kl["kl_per_sequence"] > kls[-1])
    sizes, kl = [p["n"] for p in frontier], at_kl["kl_per_sequence"]
    below = [n for n, point_kl in zip(sizes, kls, strict=True) if point_kl <= kl]
    above = [n for n, point_kl in zip(sizes, kls, strict=True) if point_kl >= kl]
    assert max(below) <= at_kl["n"] <= min(above or [16])
    gain = result["ppo_vs_best_of_n_gains"]["best_of_n"]
    assert gain == pytest.approx(at_kl["gold_gain"])
    if gain > 0:
        aligned_gain = result["gold"]["difference"]["value"]
        assert result["ppo_vs_best_of_n"] == pytest.approx(aligned_gain / gain)
    else:
        assert result["ppo_vs_best_of_n"] is None
    metrics = json.load(open(f"{out}/metrics.json"))
    assert metrics["best_of_n.n16.reward"] == pytest.approx(rewards[-1])


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
        tree = tree[int(key)] if isinstance(tree, list) else tree[key]
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
    # Same seed, same row keys: identical policies sample identical responses, so the
    # same-key pairs all tie (the old estimand's 0.5 [0.5, 0.5] whatever the policies).
    assert result["kl"] == {"per_sequence": 0.0, "per_token": 0.0}
    pairs = result["num_prompts"] * 2
    assert result["win_rate"]["coupled"] == {"value": 0.5, "ties": pairs, "pairs": pairs}
    # Independent pairs: the reward model's continuous scores tie only where two draws are
    # the same text, and 0.5 lies within sampling error (about 3 standard errors: the
    # interval spans about 4), as no policy beats itself in expectation.
    for win_rate in (result["win_rate"], result["gold"]["win_rate"]):
        assert abs(win_rate["value"] - 0.5) < 0.75 * (win_rate["high"] - win_rate["low"])
    assert result["win_rate"]["ties"] < result["win_rate"]["pairs"] / 4
    assert result["reward"]["difference"]["value"] == 0.0  # common keys: a paired 0
    assert result["ppo_vs_best_of_n"] is None  # KL 0: best-of-n gains nothing there either


# Slow tier: responses independent of batching are in make test (test_eval_sampling.py).
@pytest.mark.slow
def test_results_do_not_depend_on_the_batch_size_or_sharding(
    artifacts, evaluated, sharded_placements, tmp_path
):
    """Batches of 16, the models in chunks over the devices (fsdp), a user's gold reward:
    the same figures, and gold measures by the user's function."""
    a = artifacts
    (tmp_path / "my_gold.py").write_text(USER_GOLD)
    config = EvalConfig(
        samples_per_prompt=2, max_new_tokens=32, bootstrap_samples=200, batch_size=16, fsdp=True,
        gold_reward=f"{tmp_path}/my_gold.py:length_score", best_of_n="1,4,16",
    )  # fmt: skip
    out = a["root"] + "/b16"
    result = run(config, a["shards"], a["aligned"], a["reference"], a["rm"], out)
    assert len(sharded_placements) == 3 and all(sharded_placements)  # policy, reference, RM
    first, _ = evaluated
    assert result["win_rate"] == first["win_rate"]
    assert result["kl"]["per_token"] == pytest.approx(first["kl"]["per_token"], abs=1e-6)
    assert [p["reward"] for p in result["best_of_n"]] == pytest.approx(
        [first["best_of_n"][i]["reward"] for i in (0, 2, 4)], abs=1e-6
    )
    rows = _samples(out)
    assert result["gold"]["name"] == config.gold_reward
    lengths = [len(r["aligned_response"].split()) / 10 for r in rows]
    assert [r["aligned_gold"] for r in rows] == pytest.approx(lengths)
    assert result["gold"]["aligned"]["mean"] == pytest.approx(np.mean(lengths))
    assert result["gold"]["aligned"]["mean"] > 0.1  # the responses hold words


@pytest.fixture(scope="module")
def gold_judged(artifacts):
    """The stage without a reward model ('' as reward_dir): the built-in gold reward judges."""
    out = artifacts["root"] + "/gold_judged"
    a = artifacts
    return run(CONFIG, a["shards"], a["aligned"], a["reference"], "", out), out


def test_without_a_reward_model_the_gold_reward_judges(gold_judged, evaluated):
    result, out = gold_judged
    with_rm, rm_out = evaluated
    assert result["judge"] == "gold" and with_rm["judge"] == "reward_model"
    # Same seed, same policies: the same samples, so the same gold figures as with a reward
    # model, and now the head-to-head win rate and rewards are those gold figures.
    assert result["gold"] == with_rm["gold"]
    assert result["win_rate"] == result["gold"]["win_rate"] == with_rm["gold"]["win_rate"]
    assert result["reward"]["difference"] == result["gold"]["difference"]
    assert result["kl"] == with_rm["kl"]
    assert result["reward_model_accuracy"] is None
    rows = _samples(out)
    assert all(r["aligned_reward"] == r["aligned_gold"] for r in rows)
    assert all(r["reference_reward"] == r["reference_gold"] for r in rows)
    record = json.load(open(f"{out}/eval.json"))
    assert record["summary"]["judge"] == "gold"
    assert json.load(open(f"{rm_out}/eval.json"))["summary"]["judge"] == "reward_model"
    assert json.load(open(f"{out}/metrics.json"))["judge_is_gold"] == 1.0
    assert json.load(open(f"{rm_out}/metrics.json"))["judge_is_gold"] == 0.0


def test_without_a_reward_model_blessing_and_best_of_n_are_by_gold(gold_judged):
    result, out = gold_judged
    gold_low = result["gold"]["win_rate"]["low"]
    record = json.load(open(f"{out}/eval.json"))
    reason = f"win-rate lower bound (judged by the gold reward) {gold_low:.2f}"
    assert record["reasons"][0].startswith(reason)
    passes = gold_low > CONFIG.min_win_rate_lower and result["kl"]["per_token"] <= CONFIG.max_kl
    assert result["blessed"] is passes
    # Thresholds either side of the gold win rate's lower bound flip the verdict.
    summary = record["summary"]
    assert decide(summary, dataclasses.replace(CONFIG, min_win_rate_lower=gold_low - 0.01)).blessed
    assert not decide(summary, dataclasses.replace(CONFIG, min_win_rate_lower=gold_low)).blessed
    # The oracle baseline: the gold reward picks, so each point's reward is its gold, and
    # the best of more samples is never worse (these tiny policies rarely score off 0).
    frontier = result["best_of_n"]
    assert [p["n"] for p in frontier] == [1, 2, 4, 8, 16]
    assert all(p["reward"] == p["gold"] for p in frontier)
    golds = [p["gold"] for p in frontier]
    assert golds == sorted(golds)
    page = open(f"{out}/report.html", encoding="utf-8").read()
    figures = _Figures()
    figures.feed(page)
    assert figures.blessed is record["blessed"]
    for path, shown in figures.figures.items():
        assert shown == format_figure(_at(record["summary"], path)), path
    assert f'data-gate-judge="gold">Judge: the gold reward {GOLD_REWARD_NAME}' in page
    assert "no reward model" in page and "oracle baseline" in page


def test_no_reward_model_and_no_gold_reward_is_refused_before_loading(artifacts, tmp_path):
    shards = str(tmp_path / "shards")
    shutil.copytree(artifacts["shards"], shards)
    manifest = _manifest({"shards": shards})
    manifest["gold_reward"] = None  # data without a built-in gold reward
    json.dump(manifest, open(f"{shards}/manifest.json", "w"))
    missing = str(tmp_path / "no_model")  # never read: the check comes first
    with pytest.raises(
        ValueError, match=r"pass --reward-model \(a reward model folder\) or --gold"
    ):
        run(CONFIG, shards, missing, missing, "", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_map_batches_pads_the_last_batch_and_drops_the_padding():
    rows = np.arange(13)
    calls = []

    def step(batch):
        calls.append(batch["x"].shape)
        return (batch["x"] * 10,)

    (out,) = eval_sampling.map_local_batches(step, {"x": rows}, batch_size=8)
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
    # An --output that is a file: refused before any model loads, not after the sampling.
    (tmp_path / "file").write_text("x")
    started = time.monotonic()
    with pytest.raises(NotADirectoryError, match="--output .*file is a file; pass a folder"):
        run(CONFIG, a["shards"], a["aligned"], a["reference"], a["rm"], str(tmp_path / "file"))
    assert time.monotonic() - started < 5.0


def test_gold_reward_comes_from_the_config_else_a_known_manifest_name(caplog):
    assert gold_reward_name(EvalConfig(), {"gold_reward": GOLD_REWARD_NAME}) == GOLD_REWARD_NAME
    assert gold_reward_name(EvalConfig(), {"gold_reward": None}) == ""
    chosen = EvalConfig(gold_reward=GOLD_REWARD_NAME)
    assert gold_reward_name(chosen, {"gold_reward": None}) == GOLD_REWARD_NAME
    with caplog.at_level(logging.WARNING):
        assert gold_reward_name(EvalConfig(), {"gold_reward": "someone/else"}) == ""
        # Code named by the data never runs: only the user's config may name a function.
        assert gold_reward_name(EvalConfig(), {"gold_reward": "os:getcwd"}) == ""
    assert "gold reward 'someone/else', which is not built in" in caplog.text
    assert "'os:getcwd', which is not built in" in caplog.text


def test_kl_log_probs_use_the_sampling_temperature():
    """policy_logprobs at T: log softmax(logits / T) of the sampled tokens; T = 1 untempered."""
    model = create_model("tiny", 40, scalar_head=False, seed=0)
    loaded = generation.prepare(model)
    rng = np.random.default_rng(0)
    prompts = eval_sampling.Prompts(
        rng.integers(4, 40, (3, 5)).astype(np.int32), np.ones((3, 5), bool)
    )
    responses = eval_sampling.Responses(
        rng.integers(4, 40, (3, 2, 4)).astype(np.int32), np.ones((3, 2, 4), np.int32)
    )
    tokens = np.concatenate([np.repeat(prompts.tokens, 2, 0), responses.tokens.reshape(6, 4)], 1)
    logits = model.lm_logits(model(jnp.asarray(tokens), jnp.ones_like(tokens)))[:, 4:-1]
    picked = responses.tokens.reshape(6, 4, 1)
    for temperature in (1.0, 0.5):
        want = jnp.take_along_axis(jax.nn.log_softmax(logits / temperature), picked, -1)[..., 0]
        got = generation.policy_logprobs(
            loaded, prompts, responses, temperature=temperature, batch_size=8
        )
        np.testing.assert_allclose(got.reshape(6, 4), want, atol=1e-5)
    # T = 1 (and greedy decoding) read the model's own untempered log-probs.
    untempered = model.token_logprobs(jnp.asarray(tokens), jnp.ones_like(tokens))[:, 4:]
    one = generation.policy_logprobs(loaded, prompts, responses, temperature=1.0, batch_size=8)
    np.testing.assert_allclose(one.reshape(6, 4), untempered, atol=1e-5)
    assert np.abs(got - one).max() > 0.01  # T = 0.5 differs from T = 1


def test_drift_from_an_anchor_is_measured_reported_and_gated(artifacts, evaluated):
    a = artifacts
    base, _ = evaluated
    # Without an anchor the reference is it: its figures, nothing measured again.
    assert base["anchor"]["same_as_reference"] and base["anchor"]["kl"] == base["kl"]
    assert base["anchor"]["uri"] == a["reference"]
    out = a["root"] + "/anchored"
    past = [{"label": "version 1", "anchor_kl": 0.0123, "kl": 0.0123}]
    config = dataclasses.replace(CONFIG, max_anchor_kl=0.0)
    result = run(config, a["shards"], a["aligned"], a["reference"], a["rm"], out,
                 anchor_dir=a["aligned"], past=past)  # fmt: skip
    drift = result["anchor"]
    # The aligned policy against itself as the anchor: the same forward pass, KL exactly 0.
    assert drift["kl"] == {"per_sequence": 0.0, "per_token": 0.0}
    assert drift["same_as_reference"] is False and drift["uri"] == a["aligned"]
    assert drift["samples_per_prompt"] == 1 and drift["past"] == past
    assert 0.0 <= drift["win_rate"]["low"] <= drift["win_rate"]["high"] <= 1.0
    assert drift["gold"]["difference"]["value"] is not None
    assert result["kl"] == base["kl"]  # the reference's figures do not move
    with open(f"{out}/eval.json") as handle:
        reasons = json.load(handle)["reasons"]
    assert "KL to the anchor 0.00 nats/token ≤ 0.00 nats/token: pass" in reasons
    with open(f"{out}/metrics.json") as handle:
        assert json.load(handle)["anchor.kl.per_token"] == 0.0
    with open(f"{out}/report.html", encoding="utf-8") as handle:
        page = handle.read()
    assert "Drift from the anchor" in page and "version 1" in page and "0.0123" in page
