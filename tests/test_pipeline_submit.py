"""``alignpipe submit|schedule``: the Vertex AI and KFP client calls, and what is refused."""

from __future__ import annotations

from unittest import mock

import pytest
import yaml

from pipelines.cli import main

IMAGE = "us-docker.pkg.dev/p/alignpipe/train:1"
RUNNER = "runner@proj.iam.gserviceaccount.com"
VERTEX = [
    "--target", "vertex", "--image", IMAGE, "--project", "proj", "--region", "us-central1",
    "--pipeline-root", "gs://bucket/runs", "--service-account", RUNNER, "--label", "team=align",
]  # fmt: skip
GKE = [
    "--target", "gke", "--image", IMAGE, "--host", "https://kfp.example.com",
    "--pipeline-root", "gs://bucket/runs",
]  # fmt: skip


def _spec_reader(seen: dict):
    """A side effect that reads the compiled package while it still exists."""

    def read(*args, **kwargs):
        path = kwargs.get("template_path") or kwargs.get("pipeline_package_path") or args[0]
        with open(path) as handle:
            seen["spec"] = next(yaml.safe_load_all(handle))
        return mock.DEFAULT

    return read


@pytest.fixture
def vertex_job():
    seen: dict = {}
    with mock.patch("google.cloud.aiplatform.PipelineJob") as job:
        job.side_effect = _spec_reader(seen)
        job.seen = seen
        yield job


def test_submit_vertex_pipeline_job(vertex_job):
    assert main(["submit", *VERTEX, "--ppo-iterations", "50"]) == 0
    kwargs = vertex_job.call_args.kwargs
    assert kwargs["display_name"] == "alignpipe"
    assert kwargs["project"] == "proj" and kwargs["location"] == "us-central1"
    assert kwargs["pipeline_root"] == "gs://bucket/runs"
    assert kwargs["parameter_values"] == {"ppo_iterations": 50}
    # None keeps the compiled per-task caching (listings off, --fresh-from); True would not.
    assert kwargs["enable_caching"] is None
    assert kwargs["labels"] == {
        "pipeline": "alignpipe", "target": "vertex", "tpu": "v5e", "tpu_topology": "2x2",
        "tpu_chips": "4", "machine_type": "ct5lp-hightpu-4t", "team": "align",
    }  # fmt: skip
    assert vertex_job.seen["spec"]["pipelineInfo"]["name"] == "alignpipe"
    vertex_job.return_value.submit.assert_called_once_with(service_account=RUNNER)


def test_submit_vertex_without_cache(vertex_job):
    assert main(["submit", *VERTEX, "--no-cache"]) == 0
    assert vertex_job.call_args.kwargs["enable_caching"] is False


def test_schedule_vertex_pipeline_job_schedule(vertex_job):
    argv = ["schedule", *VERTEX, "--cron", "0 3 * * 1", "--data-uri", "gs://b/prefs/*.jsonl"]
    argv += ["--base-policy", "gs://b/promoted", "--promoted-policy-uri", "gs://b/promoted"]
    with mock.patch("google.cloud.aiplatform.PipelineJobSchedule") as schedule:
        assert main(argv) == 0
    values = vertex_job.call_args.kwargs["parameter_values"]
    assert values == {
        "data_uri": "gs://b/prefs/*.jsonl",
        "base_policy": "gs://b/promoted",
        "promoted_policy_uri": "gs://b/promoted",
    }
    schedule.assert_called_once_with(
        pipeline_job=vertex_job.return_value,
        display_name="alignpipe",
        project="proj",
        location="us-central1",
    )
    schedule.return_value.create.assert_called_once_with(
        cron="0 3 * * 1",
        max_concurrent_run_count=1,
        service_account=RUNNER,
    )
    vertex_job.return_value.submit.assert_not_called()


def test_submit_and_schedule_gke_with_the_kfp_client():
    seen: dict = {}
    with mock.patch("kfp.Client") as client_cls:
        client = client_cls.return_value
        client.create_run_from_pipeline_package.side_effect = _spec_reader(seen)
        assert main(["submit", *GKE, "--kl-coef", "0.05"]) == 0
        client_cls.assert_called_with(host="https://kfp.example.com")
        args, kwargs = client.create_run_from_pipeline_package.call_args
        assert kwargs == {
            "arguments": {"kl_coef": 0.05}, "run_name": "alignpipe", "experiment_name": "alignpipe",
            "pipeline_root": "gs://bucket/runs", "enable_caching": None, "service_account": None,
        }  # fmt: skip
        assert seen["spec"]["root"]["inputDefinitions"]["parameters"]["kl_coef"]

        client.create_experiment.return_value.experiment_id = "exp-1"
        assert main(["schedule", *GKE, "--cron", "30 2 * * *"]) == 0
        client.create_experiment.assert_called_with(name="alignpipe")
        kwargs = client.create_recurring_run.call_args.kwargs
    assert kwargs["experiment_id"] == "exp-1"
    assert kwargs["cron_expression"] == "0 30 2 * * *"  # KFP cron leads with seconds
    assert kwargs["max_concurrency"] == 1 and kwargs["params"] == {}
    assert kwargs["pipeline_package_path"].endswith(".yaml")


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("--project", "needs --project"),
        ("--region", "needs --region"),
        ("--pipeline-root", "needs --pipeline-root"),
    ],
)
def test_vertex_refuses_missing_settings(vertex_job, capsys, drop, message):
    at = VERTEX.index(drop)
    argv = VERTEX[:at] + VERTEX[at + 2 :]
    assert main(["submit", *argv]) == 2
    assert message in capsys.readouterr().err
    vertex_job.assert_not_called()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["submit", *GKE[:4], "--pipeline-root", "gs://b/r"], "needs --host"),
        (["submit", *VERTEX, "--pipeline-root", "/tmp/r"], "must be a gs:// folder"),
        (["submit", *VERTEX, "--label", "Team=x"], "--label Team=x"),
        (["submit", *VERTEX, "--reward-batch-size", "30"], "reward_batch_size: 30"),
        (["schedule", *VERTEX, "--cron", "daily"], "must have 5 fields"),
    ],
)
def test_refusals_before_any_client_call(vertex_job, capsys, argv, message):
    with mock.patch("kfp.Client") as client_cls:
        assert main(argv) == 2
    assert message in capsys.readouterr().err
    vertex_job.assert_not_called()
    client_cls.assert_not_called()
