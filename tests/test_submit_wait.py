"""``alignpipe submit --wait``: the run's page at once, each task's state as it changes, and
the failed task's own error, read through the services' own types (Vertex's
``PipelineTaskDetail`` and ``PipelineState``; KFP's ``V2beta1Run``)."""

from __future__ import annotations

from unittest import mock

import pytest
from google.cloud import aiplatform
from google.cloud.aiplatform_v1.types import PipelineState, PipelineTaskDetail
from google.rpc import status_pb2
from kfp_server_api.models import (
    GoogleRpcStatus,
    V2beta1PipelineTaskDetail,
    V2beta1Run,
    V2beta1RunDetails,
)

from pipelines.cli.main import main
from pipelines.targets import watch

RESOURCE = "projects/123/locations/us-central1/pipelineJobs/alignpipe-20261205"
TASK = PipelineTaskDetail.State


class FakeVertexJob:
    """A PipelineJob whose ``state`` and ``task_details`` step through ``polls``."""

    resource_name = RESOURCE
    _parse_resource_name = aiplatform.PipelineJob._parse_resource_name

    def __init__(self, polls):
        self.polls, self.index = polls, -1

    @property
    def state(self):
        self.index = min(self.index + 1, len(self.polls) - 1)
        return self.polls[self.index][0]

    @property
    def task_details(self):
        return [
            PipelineTaskDetail(task_name=name, state=state, error=status_pb2.Status(message=error))
            for name, state, error in self.polls[self.index][1]
        ]


def test_vertex_run_is_followed_to_its_failed_task(capsys):
    job = FakeVertexJob([
        (PipelineState.PIPELINE_STATE_RUNNING, [("shard", TASK.RUNNING, "")]),
        (PipelineState.PIPELINE_STATE_RUNNING, [("shard", TASK.SUCCEEDED, ""),
                                                ("sft", TASK.RUNNING, "")]),
        (PipelineState.PIPELINE_STATE_RUNNING, [("shard", TASK.SUCCEEDED, ""),
                                                ("sft", TASK.RUNNING, "")]),
        (PipelineState.PIPELINE_STATE_FAILED, [("shard", TASK.SUCCEEDED, ""),
                                               ("sft", TASK.FAILED, "RESOURCE_EXHAUSTED: HBM")]),
    ])  # fmt: skip
    sleeps = []
    code = watch.follow(
        lambda: watch.vertex_snapshot(job), watch.vertex_url(job), sleep=sleeps.append
    )
    out, err = capsys.readouterr()
    assert code == 1 and len(sleeps) == 3
    assert out.splitlines()[0] == (
        "run page: https://console.cloud.google.com/vertex-ai/locations/us-central1/pipelines/"
        "runs/alignpipe-20261205?project=123"
    )
    # One line per change: sft's second RUNNING poll prints nothing.
    assert out.splitlines()[1:] == [
        "  shard: running",
        "  shard: succeeded",
        "  sft: running",
        "  sft: failed",
    ]
    assert "run failed" in err and "sft failed: RESOURCE_EXHAUSTED: HBM" in err


def test_kfp_run_succeeds(capsys):
    def run(state, tasks):
        details = [
            V2beta1PipelineTaskDetail(display_name=n, state=s, error=GoogleRpcStatus(message=""))
            for n, s in tasks
        ]
        return V2beta1Run(
            run_id="r1", state=state, run_details=V2beta1RunDetails(task_details=details)
        )

    client = mock.Mock()
    client.get_run.side_effect = [
        run("RUNNING", [("ppo", "RUNNING")]),
        run("SUCCEEDED", [("ppo", "SUCCEEDED"), ("evaluate", "SUCCEEDED")]),
    ]
    code = watch.follow(lambda: watch.kfp_snapshot(client, "r1"), "https://kfp/#/runs/details/r1",
                        sleep=lambda _: None)  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and out.endswith("run succeeded\n")
    assert "  evaluate: succeeded" in out and client.get_run.call_args.args == ("r1",)


@pytest.fixture
def followed_job(monkeypatch):
    job = FakeVertexJob(
        [(PipelineState.PIPELINE_STATE_SUCCEEDED, [("promote", TASK.SUCCEEDED, "")])]
    )
    job.submit = mock.Mock()
    monkeypatch.setattr(aiplatform, "PipelineJob", lambda **kwargs: job)
    return job


def test_submit_wait_prints_the_page_and_ends_with_the_run(followed_job, capsys):
    argv = [
        "submit", "--wait", "--target", "vertex", "--image", "r/train@sha256:" + "a" * 64,
        "--project", "proj", "--region", "us-central1", "--pipeline-root", "gs://bucket/runs",
        "--service-account", "runner@proj.iam.gserviceaccount.com",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "run page: https://console.cloud.google.com/" in out and "  promote: succeeded" in out
    followed_job.submit.assert_called_once()
