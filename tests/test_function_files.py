"""A cloud run's local reward function files travel with it: copied under the pipeline root
by content, the spec rewritten to the copy; gs://, module and built-in specs stay."""

from __future__ import annotations

import hashlib
from unittest import mock

import pytest

from pipelines.cli.main import main
from pipelines.targets.function_files import with_uploaded_functions
from tests.test_pipeline_submit import VERTEX

SCORE = "def score(prompts, completions, **columns):\n    return [1.0] * len(completions)\n"


def test_local_files_are_copied_by_content_and_specs_rewritten(tmp_path):
    (tmp_path / "mine.py").write_text(SCORE)
    root = tmp_path / "root"
    values = {
        "reward_functions": f"builtin/exact-match, {tmp_path}/mine.py:score,gs://b/f.py:g,m.x:h",
        "gold_reward": f"{tmp_path}/mine.py:score",
        "ppo_iterations": 3,
    }
    out = with_uploaded_functions(values, str(root))
    digest = hashlib.sha256(SCORE.encode()).hexdigest()[:16]
    copy = root / "functions" / digest / "mine.py"
    assert out["reward_functions"] == f"builtin/exact-match,{copy}:score,gs://b/f.py:g,m.x:h"
    assert out["gold_reward"] == f"{copy}:score" and out["ppo_iterations"] == 3
    assert copy.read_text() == SCORE
    # A changed file is a new object: a cached task never reads code it was not keyed on.
    (tmp_path / "mine.py").write_text(SCORE + "# v2\n")
    again = with_uploaded_functions(values, str(root))
    assert again["gold_reward"] != out["gold_reward"]


def test_a_missing_local_file_is_refused_naming_the_fixes(tmp_path):
    with pytest.raises(FileNotFoundError, match="gs:// copy, or a MODULE:FUNCTION"):
        with_uploaded_functions({"reward_functions": f"{tmp_path}/no.py:f"}, str(tmp_path))


def test_submit_uploads_the_reward_function_file(tmp_path):
    (tmp_path / "mine.py").write_text(SCORE)
    written = {}
    with (
        mock.patch("google.cloud.aiplatform.PipelineJob") as job,
        mock.patch("pipelines.targets.function_files.fileio.exists", return_value=False),
        mock.patch(
            "pipelines.targets.function_files.fileio.write_bytes",
            side_effect=lambda path, data: written.update({path: data}),
        ),
    ):
        argv = ["--algorithm", "grpo", "--train-reward-model", "false",
                "--reward-functions", f"{tmp_path}/mine.py:score"]  # fmt: skip
        assert main(["submit", *VERTEX, *argv]) == 0
    sent = job.call_args.kwargs["parameter_values"]["reward_functions"]
    digest = hashlib.sha256(SCORE.encode()).hexdigest()[:16]
    assert sent == f"gs://bucket/runs/functions/{digest}/mine.py:score"
    assert written == {sent.rpartition(":")[0]: SCORE.encode()}
