"""The prelude of GCPC's custom-job launcher: a retried Vertex task starts a new job when
the one its gcp_resources file names ended without success, and follows one still running.

The file's shape is GCPC 2.22's (``JobRemoteRunner.create_job`` writes
``json_format.MessageToJson(GcpResources)``; ``check_if_job_exists`` treats an empty file as
no job); the job state names are ``aiplatform_v1.types.JobState``'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from google.cloud.aiplatform_v1.types import JobState

from pipelines.targets.vertex import custom_job_retry

JOB = "projects/123/locations/us-central1/customJobs/456"
RESOURCES = {
    "resources": [
        {
            "resourceType": "CustomJob",
            "resourceUri": f"https://us-central1-aiplatform.googleapis.com/v1/{JOB}",
        }
    ]
}


def _gcp_resources(tmp_path: Path) -> Path:
    path = tmp_path / "gcp_resources"
    path.write_text(json.dumps(RESOURCES))
    return path


@pytest.mark.parametrize(
    ("state", "emptied"),
    [
        ("JOB_STATE_FAILED", True),
        ("JOB_STATE_CANCELLED", True),
        ("JOB_STATE_EXPIRED", True),
        ("NOT_FOUND", True),
        ("JOB_STATE_RUNNING", False),  # the launcher was preempted: follow the job
        ("JOB_STATE_PENDING", False),
        ("JOB_STATE_SUCCEEDED", False),  # the launcher reports its success
    ],
)
def test_an_ended_job_is_forgotten_and_a_live_one_followed(tmp_path, state, emptied):
    path = _gcp_resources(tmp_path)
    asked = []
    got = custom_job_retry.forget_ended_job(str(path), lambda name: asked.append(name) or state)
    assert asked == [JOB] and got == state
    assert (path.read_text() == "") is emptied


def test_the_states_are_vertex_job_states():
    names = {state.name for state in JobState}
    assert set(custom_job_retry.ENDED_WITHOUT_SUCCESS) - {"NOT_FOUND"} <= names


def test_no_file_or_an_empty_one_asks_nothing(tmp_path):
    def never(name: str) -> str:
        raise AssertionError("no job to ask about")

    assert custom_job_retry.forget_ended_job(str(tmp_path / "missing"), never) == ""
    (tmp_path / "empty").write_text("")
    assert custom_job_retry.forget_ended_job(str(tmp_path / "empty"), never) == ""


def test_a_failed_lookup_leaves_the_file_to_the_launcher(tmp_path, capsys):
    path = _gcp_resources(tmp_path)

    def unreachable(name: str) -> str:
        raise ConnectionError("no route")

    assert custom_job_retry.forget_ended_job(str(path), unreachable) == ""
    assert json.loads(path.read_text()) == RESOURCES
    assert "could not read the state" in capsys.readouterr().out


def test_the_command_runs_gcpcs_launcher_with_the_tasks_arguments(tmp_path):
    """The compiled command (``python3 -u -c SOURCE ARGS``) against a stand-in GCPC package:
    the launcher module runs as __main__ with exactly the task's arguments, after the
    prelude emptied the gcp_resources of a failed job (the job state stubbed)."""
    package = tmp_path / "google_cloud_pipeline_components" / "container" / "v1" / "custom_job"
    package.mkdir(parents=True)
    for folder in [package, *package.parents][:4]:
        (folder / "__init__.py").write_text("")
    (package / "launcher.py").write_text(
        textwrap.dedent(
            """
            import json, sys
            if __name__ == "__main__":
                resources = sys.argv[sys.argv.index("--gcp_resources") + 1]
                print(json.dumps({"argv": sys.argv[1:], "resources": open(resources).read()}))
            """
        )
    )
    path = _gcp_resources(tmp_path)
    args = ["--type", "CustomJob", "--payload", "{}", "--project", "p"]
    args += ["--location", "us-central1", "--gcp_resources", str(path)]
    source = Path(custom_job_retry.__file__).read_text()
    stub = "custom_job_retry_job_state = lambda name, location: 'JOB_STATE_FAILED'\n"
    source = source.replace(
        'if __name__ == "__main__":',
        stub + "job_state = custom_job_retry_job_state\n" + 'if __name__ == "__main__":',
    )
    done = subprocess.run(
        [sys.executable, "-u", "-c", source, *args],
        capture_output=True, text=True, cwd=tmp_path, check=True,
        env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    *notes, last = done.stdout.strip().splitlines()
    assert json.loads(last) == {"argv": args, "resources": ""}
    assert f"{JOB} ended JOB_STATE_FAILED: this attempt starts a new custom job" in notes
