"""The HTML report: well-formed, self-contained, escaped, and in agreement with eval.json."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from html.parser import HTMLParser

import numpy as np
import pytest

from components.core.data import builtin_task
from components.evaluate import measures, report, run_info
from components.evaluate.config import EvalConfig
from components.evaluate.gate import decide
from components.evaluate.outputs import flat_figures

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VOID = {"meta", "img", "br", "hr", "input", "link"}
SCRIPT = "<script>alert(1)</script>"
GOLD = builtin_task.GOLD_REWARD_NAME


class PageParser(HTMLParser):
    """Checks that tags balance; collects images and elements that carry a data-key."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.images: list[dict] = []
        self.figures: dict[str, str] = {}
        self.blessed: str | None = None
        self._key: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attributes = dict(attrs)
        if tag == "img":
            self.images.append(attributes)
        if "data-blessed" in attributes:
            self.blessed = attributes["data-blessed"]
        if "data-key" in attributes:
            self._key = attributes["data-key"]
            self.figures[self._key] = ""
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()
        self._key = None

    def handle_data(self, data: str) -> None:
        if self._key is not None:
            self.figures[self._key] += data


def parse(page: str) -> PageParser:
    parser = PageParser()
    parser.feed(page)
    parser.close()
    assert parser.errors == [] and parser.stack == []
    return parser


def make_summary(nan_kl: bool = False, gold: bool = True) -> dict:
    rng = np.random.default_rng(0)
    prompts, t = 32, 8
    lengths = rng.integers(1, t + 1, size=(2, prompts))
    masks = np.arange(t)[None, None, :] < lengths[..., None]
    outputs = [
        measures.PolicyOutputs(
            rewards=rng.normal(mu, 1, prompts),
            response_mask=masks[i],
            ended_with_eos=lengths[i] < t,
            gold_rewards=rng.normal(mu, 0.5, prompts) if gold else None,
        )
        for i, mu in enumerate((0.8, 0.0))
    ]
    logp = -rng.random((prompts, t))
    # Best-of-n draws whose gold follows the reward model: gold gain grows with n.
    draw_rewards = rng.normal(0, 1, (prompts, 16))
    draws = measures.BestOfNDraws(draw_rewards, 0.3 * draw_rewards if gold else None)
    return measures.summarize(
        *outputs,
        aligned_logprobs=logp,
        reference_logprobs=np.full_like(logp, np.nan) if nan_kl else logp - 0.05,
        config=EvalConfig(bootstrap_samples=200),
        chosen_rewards=rng.normal(1, 1, 50),
        rejected_rewards=rng.normal(0, 1, 50),
        gold_name=GOLD if gold else "",
        best_of_n_draws=draws,
    )


SAMPLES = report.select_samples(
    ['Tell me about the "river" & <b>sea</b>.', "Describe the city."],
    [SCRIPT, "good city."],
    ["bad river.", "</td></tr></table>"],
    [1.5, 0.25],
    [-0.5, 0.0],
    num=5,
    seed=0,
    aligned_gold=[0.0, 1.5],
    reference_gold=[-1.0, -1.0],
)
PPO = [
    {"step": 10 * i, "objective/scores": 0.1 * i, "objective/kl_per_token": 0.01 * i}
    for i in range(8)
]
RM = [{"step": i, "loss": 1 / (i + 1), "accuracy": 0.5 + i / 40} for i in range(8)]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """report.html and eval.json from one full write_report call."""
    summary = make_summary()
    gate = decide(summary, EvalConfig())
    out = tmp_path_factory.mktemp("eval")
    paths = report.write_report(
        str(out), summary, gate, ppo_metrics=PPO, reward_metrics=RM, samples=SAMPLES
    )
    assert paths == report.ReportPaths(str(out / "report.html"), str(out / "eval.json"))
    with open(paths.report, encoding="utf-8") as handle:
        page = handle.read()
    with open(paths.eval_json, encoding="utf-8") as handle:
        record = json.load(handle)
    return page, record


def test_report_is_balanced_html_with_the_verdict_first(written: tuple[str, dict]) -> None:
    page, _ = written
    assert page.startswith("<!DOCTYPE html>")
    parse(page)
    assert page.index("data-blessed") < page.index("<table")


def test_every_image_is_an_inline_png(written: tuple[str, dict]) -> None:
    from PIL import Image

    images = parse(written[0]).images
    assert len(images) == 5  # win rates, rewards, best-of-n frontier, PPO and RM curves
    for image in images:
        prefix = "data:image/png;base64,"
        assert image["src"].startswith(prefix)
        data = base64.b64decode(image["src"][len(prefix) :], validate=True)
        assert data.startswith(PNG_MAGIC)
        with Image.open(io.BytesIO(data)) as png:
            png.verify()
            assert png.format == "PNG" and png.size[0] > 100


def test_user_text_is_escaped(written: tuple[str, dict]) -> None:
    page, _ = written
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;/td&gt;&lt;/tr&gt;&lt;/table&gt;" in page
    assert "Tell me about the &quot;river&quot; &amp; &lt;b&gt;sea&lt;/b&gt;." in page


def test_report_figures_and_verdict_match_eval_json(written: tuple[str, dict]) -> None:
    page, record = written
    parser = parse(page)
    assert parser.blessed == ("true" if record["blessed"] else "false")
    for reason in record["reasons"]:
        assert f"<li>{html.escape(reason)}</li>" in page  # "0.62 > 0.50" is escaped, too
    assert len(parser.figures) > 25
    for path, text in parser.figures.items():
        value = record["summary"]
        for key in path.split("."):
            value = value[int(key)] if isinstance(value, list) else value[key]
        if value is None:
            assert text == "n/a", path
        else:
            assert float(text) == pytest.approx(value, rel=1e-3, abs=1e-9), path
    for path in ("win_rate.low", "kl.per_token", "gold.win_rate.value", "eos_rate.reference"):
        assert path in parser.figures
    for path in ("best_of_n.4.n", "best_of_n.4.gold", "ppo_vs_best_of_n"):
        assert path in parser.figures


def test_best_of_n_section_states_the_ratio(written: tuple[str, dict]) -> None:
    page, record = written
    summary = record["summary"]
    assert [p["n"] for p in summary["best_of_n"]] == [1, 2, 4, 8, 16]
    ratio = summary["ppo_vs_best_of_n"]
    gains = summary["ppo_vs_best_of_n_gains"]
    assert ratio == pytest.approx(gains["aligned"] / gains["best_of_n"])
    assert ratio > 0 and summary["ppo_vs_best_of_n_capped"] in (True, False)
    assert "<h2>Best-of-n baseline</h2>" in page
    figures = parse(page).figures
    assert figures["ppo_vs_best_of_n"] == report.format_figure(ratio)
    assert "times best-of-n's gold gain at the same KL" in page
    assert 'alt="gold (builtin/sentiment-v1) gain against KL per sequence' in page


def test_header_states_the_reward_model_as_judge(written: tuple[str, dict]) -> None:
    page, record = written
    assert record["summary"]["judge"] == "reward_model"
    assert record["summary"]["gate_judge"] == "gold"  # the gold reward decided the gate
    header = 'data-judge="reward_model" data-gate-judge="gold">Win rate judged by the reward model'
    assert page.index(header) < page.index("data-blessed")
    assert f"win-rate rule judged by the gold reward {GOLD}." in page
    assert "win rate (reward model)" in page and f"win rate ({GOLD})" in page


def gold_judged_summary() -> dict:
    """A summary as the stage writes it without a reward model: the gold scores are the rewards."""
    rng = np.random.default_rng(1)
    mask = np.ones((16, 2, 4))
    outputs = []
    for mu in (0.3, 0.0):
        gold = rng.normal(mu, 0.5, (16, 2))
        outputs.append(measures.PolicyOutputs(gold, mask, np.ones((16, 2), bool), gold))
    draws = rng.normal(0, 1, (16, 4))
    logp = -rng.random((16, 2, 4))
    return measures.summarize(
        *outputs, aligned_logprobs=logp, reference_logprobs=logp - 0.05,
        config=EvalConfig(bootstrap_samples=100, best_of_n="1,2,4"), gold_name=GOLD,
        best_of_n_draws=measures.BestOfNDraws(draws, draws), judge=measures.JUDGE_GOLD,
    )  # fmt: skip


def test_gold_as_judge_is_stated_and_not_repeated() -> None:
    summary = gold_judged_summary()
    page = report.render_report(summary, decide(summary, EvalConfig()))
    parser = parse(page)
    header = f'data-judge="gold" data-gate-judge="gold">Judge: the gold reward {GOLD}; no reward'
    assert page.index(header) < (page.index("data-blessed"))
    assert page.count(f"<th>win rate ({GOLD})") == 1  # the judge's row; no second gold row
    assert page.count(f"<th>length-controlled win rate ({GOLD})") == 1
    assert "win rate (reward model)" not in page
    assert '<td class="num missing">no reward model</td>' in page  # reward-model accuracy
    assert "oracle baseline" in page and "no reward model (the gold reward judged)" in page
    assert "gold.win_rate.value" not in parser.figures and "win_rate.value" in parser.figures
    assert len(parser.images) == 3  # win rate, gold distributions, frontier (no PPO, no RM)


def test_flat_metrics_record_the_judge_as_a_number() -> None:
    gold = gold_judged_summary()
    figures = flat_figures(gold, decide(gold, EvalConfig()))
    assert figures["judge_is_gold"] == 1.0
    assert "judge" not in figures and "gold.name" not in figures  # strings are not figures
    with_rm = make_summary()
    assert flat_figures(with_rm, decide(with_rm, EvalConfig()))["judge_is_gold"] == 0.0


def test_frontier_falls_back_to_the_reward_model_without_gold() -> None:
    summary = make_summary(gold=False)
    assert summary["best_of_n"][0]["gold"] is None and summary["ppo_vs_best_of_n"] is None
    page = report.render_report(summary, decide(summary, EvalConfig()))
    assert 'alt="reward-model score gain against KL per sequence' in page
    assert "No ratio to best-of-n: it needs a gold reward" in page
    curve = [(1, 0.0, 0.0), (2, 0.19, 0.4), (4, 0.64, 0.7)]
    png = report.plots.best_of_n_frontier(curve, (0.3, 0.5), "gold")
    assert png is not None and png.startswith(PNG_MAGIC)
    assert report.plots.best_of_n_frontier([(1, float("nan"), 0.0)], None, "gold") is None


def test_eval_json_holds_verdict_reasons_and_summary(written: tuple[str, dict]) -> None:
    _, record = written
    assert set(record) == {"schema_version", "blessed", "reasons", "gate_judge", "summary"}
    summary = make_summary()
    assert record["blessed"] == decide(summary, EvalConfig()).blessed
    # The summary has a gold part: gold's win rate decides, and the page says so.
    assert record["gate_judge"] == "gold" and "(judged by the gold reward)" in record["reasons"][0]
    assert record["summary"]["win_rate"] == summary["win_rate"]


def test_missing_metrics_and_samples_skip_their_parts() -> None:
    summary = make_summary()
    summary["gold"] = None
    summary["reward_model_accuracy"] = None
    summary["best_of_n"] = None
    page = report.render_report(summary, decide(summary, EvalConfig()), samples=[])
    parser = parse(page)
    assert len(parser.images) == 2
    assert "no best-of-n baseline measured" in page and "Best-of-n baseline" not in page
    assert "no PPO metrics given" in page and "no reward-model metrics given" in page
    assert "no samples given" in page and "not measured" in page
    # rows without usable values are skipped too; other key spellings are accepted
    assert report.plots.ppo_curves([{"step": 1, "objective/kl_per_token": "n/a"}]) is None
    assert report.plots.reward_model_curves([{"eval/accuracy": 0.7}, {"eval/accuracy": 0.8}])


def test_non_finite_figures_become_null_and_n_a() -> None:
    summary = make_summary(nan_kl=True)
    gate = decide(summary, EvalConfig())
    assert not gate.blessed
    record = json.loads(json.dumps(report.eval_record(summary, gate), allow_nan=False))
    assert record["summary"]["kl"]["per_token"] is None
    figures = parse(report.render_report(summary, gate, samples=SAMPLES)).figures
    assert figures["kl.per_token"] == "n/a"
    assert math.isnan(summary["kl"]["per_token"])  # the caller's summary is left as it was


def test_select_samples_is_seeded_and_bounded() -> None:
    rows = report.select_samples(
        ["p"] * 10, ["a"] * 10, ["r"] * 10, np.arange(10.0), np.zeros(10), num=3, seed=1
    )
    again = report.select_samples(
        ["p"] * 10, ["a"] * 10, ["r"] * 10, np.arange(10.0), np.zeros(10), num=3, seed=1
    )
    assert rows == again and len(rows) == 3
    assert [r["aligned_reward"] for r in rows] == sorted(r["aligned_reward"] for r in rows)
    assert len(SAMPLES) == 2 and "aligned_gold" in SAMPLES[0]
    with pytest.raises(ValueError, match="one entry per response pair"):
        report.select_samples(["p"], ["a", "b"], ["r"], [0.0], [0.0], num=1, seed=0)


def test_ppo_curves_mark_guard_restorations_as_events() -> None:
    """A restoration is a dashed line at its step, not a step that goes backwards."""
    from matplotlib.figure import Figure

    rows = [{"step": s, "objective/kl": 0.1 * s, "objective/scores": 0.2 * s} for s in (1, 2, 3)]
    rows.append({"step": 3, "event": "guard_restored", "iteration": 2, "restored_to": 0})
    axes = Figure().subplots()
    assert report.plots._mark_events(axes, rows) == 1
    assert [line.get_xdata()[0] for line in axes.get_lines()] == [3]
    assert report.plots.ppo_curves(rows)[:8] == b"\x89PNG\r\n\x1a\n"


def test_ppo_curves_show_the_kl_against_its_target() -> None:
    from matplotlib.figure import Figure

    rows = [
        {"step": s, "objective/kl_per_token": 0.01 * s, "objective/kl_target": 0.02}
        for s in (1, 2, 3)
    ]
    axes = Figure().subplots()
    assert report.plots.mark_kl_target(axes, rows) == 0.02
    assert [line.get_ydata()[0] for line in axes.get_lines()] == [0.02]
    assert report.plots.mark_kl_target(axes, [{"step": 1, "objective/kl_per_token": 0.1}]) is None
    assert report.plots.ppo_curves(rows)[:8] == b"\x89PNG\r\n\x1a\n"


def test_header_names_the_run_its_algorithm_model_judge_and_settings() -> None:
    summary = gold_judged_summary()
    policy = {
        "stage": "ppo", "step": 50, "base_policy": "runs/x/sft/model",
        "training": {"algorithm": "grpo", "learning_rate": 3e-5, "group_size": 4,
                     "kl_target": 0.045, "critic_learning_rate": 1e-4},
    }  # fmt: skip
    summary["run"] = run_info.describe(policy, run_info.run_id_of("runs/alignpipe-7/evaluate/e"))
    page = report.render_report(summary, decide(summary, EvalConfig()))
    header = page[page.index('<p class="run"') : page.index('<p class="judge"')]
    assert 'data-run-id="alignpipe-7"' in header and "run alignpipe-7 · evaluated 20" in header
    assert "grpo (ppo stage, step 50) · aligned from runs/x/sft/model" in header
    assert f"gate judged by the gold reward {GOLD}" in header
    # The algorithm's key settings, not every field (grpo has no critic).
    assert "learning_rate 3e-05, kl_target 0.045, group_size 4" in header
    assert "critic_learning_rate" not in header
    assert page.index(header) < page.index("data-blessed")
    gs = "gs://b/root/123/alignpipe-20261205/evaluate_42/evaluation"
    assert run_info.run_id_of(gs) == "alignpipe-20261205"
