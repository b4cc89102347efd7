"""Live progress: each stage's progress lines lead with its headline figures, evaluation's
sampling reports its batches, and a local run's terminal shows them as they come, at most
every PROGRESS_SECONDS per stage."""

from __future__ import annotations

import io

import numpy as np

from components.core.model import eval_sampling
from components.core.training.metrics import MetricsLogger
from pipelines.targets.local import run as local_run
from pipelines.targets.local import run_log


def test_a_progress_line_leads_with_the_stages_headline(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(
        str(tmp_path), total_steps=2, stage="ppo", tensorboard=False, print_every=1,
        stream=stream,
    )  # fmt: skip
    with logger:
        logger.log(1, {"loss/total": 0.5, "lr": 1e-5, "objective/kl_per_token": 0.04,
                       "objective/scores": 0.25})  # fmt: skip
    line = stream.getvalue().splitlines()[0]
    assert line.startswith("[ppo] step 1/2 ")
    assert line.index("objective/scores=0.25") < line.index("objective/kl_per_token=0.04")
    assert line.index("objective/kl_per_token") < line.index("loss/total")


def test_the_terminal_shows_each_stages_progress_at_most_every_ten_seconds(tmp_path, monkeypatch):
    terminal = io.StringIO()
    watcher = local_run.TaskWatcher(stream=terminal)
    clock = iter([100.0, 103.0, 111.0, 112.0, 112.5, 113.0])
    monkeypatch.setattr(local_run.time, "monotonic", lambda: next(clock))
    lines = [
        "    [sft] step 10/300 7.60 steps/s eta 0:38 loss=3.889",
        "    [sft] step 20/300 8.24 steps/s eta 0:33 loss=3.454",  # 3 s later: not shown
        "    [sft] step 30/300 8.55 steps/s eta 0:31 loss=3.035",  # 11 s later
        "    [reward] step 10/300 9.1 steps/s eta 0:31 accuracy=0.61",  # another stage
        "    [sft] step 300/300 8.6 steps/s eta 0:00 loss=1.2",  # the last step always
        "[shard] step 2/2 14 records, 950 records/s",  # the shard stage's
        "INFO some other line",
    ]
    with run_log.capture(tmp_path / "run.log", watcher.progress):
        for line in lines:
            print(line)
    assert (tmp_path / "run.log").read_text().splitlines() == lines  # the log has them all
    shown = terminal.getvalue().splitlines()
    assert shown == [
        "[alignpipe] sft: step 10/300 7.60 steps/s eta 0:38 loss=3.889",
        "[alignpipe] sft: step 30/300 8.55 steps/s eta 0:31 loss=3.035",
        "[alignpipe] reward: step 10/300 9.1 steps/s eta 0:31 accuracy=0.61",
        "[alignpipe] sft: step 300/300 8.6 steps/s eta 0:00 loss=1.2",
        "[alignpipe] shard: step 2/2 14 records, 950 records/s",
    ]


def test_evaluation_sampling_reports_each_batch(capsys):
    arrays = {"x": np.arange(20, dtype=np.float32)}
    doubled = eval_sampling.map_global_batches(
        lambda batch: (batch["x"] * 2,), arrays, 8, ("evaluate", "sampling 20 rows")
    )
    assert np.array_equal(doubled[0], arrays["x"] * 2)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "[evaluate] step 1/3 sampling 20 rows", "[evaluate] step 2/3 sampling 20 rows",
        "[evaluate] step 3/3 sampling 20 rows",
    ]  # fmt: skip
