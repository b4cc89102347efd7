"""``alignpipe submit|schedule``: the Vertex AI and KFP client calls, and what is refused."""

from __future__ import annotations

from unittest import mock

import pytest

from pipelines import run_record
from pipelines.cli.main import main
from pipelines.targets.spec import read_spec

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
        seen["spec"] = read_spec(path)[0]
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
    # Training state goes to the pipeline root unless checkpoint_root is given; the built-in
    # task (no data_uri) brings its held-out reward model (pipelines/dag/tasks.py).
    assert kwargs["parameter_values"] == {
        "heldout_reward": 0.2,
        "ppo_iterations": 50,
        "checkpoint_root": "gs://bucket/runs/checkpoints",
    }
    # None keeps the compiled per-task caching (listings off, --fresh-from); True would not.
    assert kwargs["enable_caching"] is None
    assert kwargs["labels"] == {
        "pipeline": "alignpipe", "target": "vertex", "tpu": "v5e", "tpu_topology": "2x2",
        "tpu_chips": "4", "tpu_hosts": "1", "machine_type": "ct5lp-hightpu-4t", "team": "align",
        **run_record.cloud_labels(),
    }  # fmt: skip
    assert kwargs["labels"]["alignpipe_version"]
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
        "checkpoint_root": "gs://bucket/runs/checkpoints",
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
            "arguments": {
                "heldout_reward": 0.2, "kl_coef": 0.05,
                "checkpoint_root": "gs://bucket/runs/checkpoints",
            },
            "run_name": "alignpipe", "experiment_name": "alignpipe",
            "pipeline_root": "gs://bucket/runs", "enable_caching": None, "service_account": None,
            "namespace": None,
        }  # fmt: skip
        assert seen["spec"]["root"]["inputDefinitions"]["parameters"]["kl_coef"]

        client.create_experiment.return_value.experiment_id = "exp-1"
        assert main(["schedule", *GKE, "--cron", "30 2 * * *"]) == 0
        client.create_experiment.assert_called_with(name="alignpipe", namespace=None)
        kwargs = client.create_recurring_run.call_args.kwargs
    assert kwargs["experiment_id"] == "exp-1"
    assert kwargs["cron_expression"] == "0 30 2 * * *"  # KFP cron leads with seconds
    assert kwargs["max_concurrency"] == 1
    assert kwargs["params"] == {
        "heldout_reward": 0.2,
        "checkpoint_root": "gs://bucket/runs/checkpoints",
    }
    assert kwargs["pipeline_package_path"].endswith(".yaml")


def test_submit_run_preset_v5p_32_7b_to_vertex_and_gke(vertex_job):
    """The 4-host preset: Vertex gets one custom-job pool over the slice, GKE a JobSet launcher."""
    from pipelines.dag.run_presets import RUN_PRESETS

    preset = RUN_PRESETS["v5p-32-7b"].pipeline_params()
    assert main(["submit", *VERTEX, "--run-preset", "v5p-32-7b"]) == 0
    kwargs = vertex_job.call_args.kwargs
    assert kwargs["parameter_values"] == {
        **preset,
        "checkpoint_root": "gs://bucket/runs/checkpoints",
    }
    assert kwargs["labels"]["tpu_hosts"] == "4" and kwargs["labels"]["tpu_topology"] == "2x2x4"
    ppo = vertex_job.seen["spec"]["deploymentSpec"]["executors"]["exec-ppo"]["container"]
    assert '"tpu_topology": "2x2x4"' in ppo["args"][ppo["args"].index("--payload") + 1]
    seen: dict = {}
    with mock.patch("kfp.Client") as client_cls:
        client = client_cls.return_value
        client.create_run_from_pipeline_package.side_effect = _spec_reader(seen)
        assert main(["submit", *GKE, "--run-preset", "v5p-32-7b"]) == 0
    arguments = client.create_run_from_pipeline_package.call_args.kwargs["arguments"]
    assert arguments == {**preset, "checkpoint_root": "gs://bucket/runs/checkpoints"}
    ppo = seen["spec"]["deploymentSpec"]["executors"]["exec-ppo"]["container"]
    assert ppo["command"][-1] == "pipelines.targets.gke.launcher"


def test_vertex_without_a_service_account_warns(vertex_job, capsys):
    at = VERTEX.index("--service-account")
    assert main(["submit", *VERTEX[:at], *VERTEX[at + 2 :]]) == 0
    assert "warning: no --service-account: the run, and the TPU custom jobs" in (
        capsys.readouterr().err
    )
    vertex_job.return_value.submit.assert_called_once_with(service_account=None)
    assert main(["submit", *VERTEX]) == 0
    assert "no --service-account" not in capsys.readouterr().err


def test_gke_namespace_and_authentication(monkeypatch):
    """kfp.Client autospecced: every option is a real parameter of kfp 2.17's Client."""
    monkeypatch.setenv("KFP_TOKEN", "t0k3n")
    where = ["--target", "gke", "--image", IMAGE, "--pipeline-root", "gs://bucket/runs"]
    with mock.patch("kfp.Client", autospec=True) as client_cls:
        client = client_cls.return_value
        argv = [*where, "--kube-context", "gke_p_z_c", "--namespace", "team-a"]
        assert main(["submit", *argv]) == 0
        client_cls.assert_called_with(host=None, kube_context="gke_p_z_c")
        assert client.create_run_from_pipeline_package.call_args.kwargs["namespace"] == "team-a"
        argv = [*where, "--host", "https://kfp.example.com", "--iap-client-id", "123.apps"]
        assert main(["submit", *argv, "--token-env", "KFP_TOKEN"]) == 0
        client_cls.assert_called_with(
            host="https://kfp.example.com", client_id="123.apps", existing_token="t0k3n"
        )
        argv = [*where, "--kube-context", "c", "--namespace", "team-a", "--cron", "0 3 * * *"]
        assert main(["schedule", *argv]) == 0
        client.create_experiment.assert_called_with(name="alignpipe", namespace="team-a")


def test_gke_token_env_must_be_set(capsys, monkeypatch):
    monkeypatch.delenv("NO_SUCH_TOKEN", raising=False)
    with mock.patch("kfp.Client") as client_cls:
        assert main(["submit", *GKE, "--token-env", "NO_SUCH_TOKEN"]) == 2
    assert "--token-env NO_SUCH_TOKEN: that environment variable is unset" in (
        capsys.readouterr().err
    )
    client_cls.assert_not_called()
    for action in (["list"], ["pause", "some-id"]):
        with mock.patch("kfp.Client") as client_cls:
            argv = ["schedule", *action, "--target", "gke", "--host", "http://kfp:8888"]
            assert main([*argv, "--token-env", "NO_SUCH_TOKEN"]) == 2
        assert "--token-env NO_SUCH_TOKEN: that environment variable" in capsys.readouterr().err
        client_cls.assert_not_called()


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
        (["submit", *GKE[:4], "--pipeline-root", "gs://b/r"], "needs --host (or --kube-context)"),
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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cron", "0 24 * * *"], "'24' is not a valid hour (0-23"),
        (["--cron", "0 3 * * 1-8"], "'1-8' is not a valid weekday"),
        (["--cron", "*/0 3 * * *"], "'*/0' is not a valid minute"),
        (["--cron", "0 3 31-1 * *"], "'31-1' is not a valid day of month"),
        (["--cron", "0 3 * smarch *"], "'smarch' is not a valid month"),
        (["create", "4242", "--cron", "0 3 * * *"], "takes no SCHEDULE ('4242')"),
        (["--cron", "*/ 3 * * *"], "'*/' is not a valid minute"),  # a step needs a number
        (["--cron", "\u0663 3 * * 1"], "is not a valid minute"),  # ASCII digits only
    ],
)
def test_schedule_create_refuses_its_cron_and_arguments_before_compiling(
    vertex_job, capsys, argv, message
):
    with mock.patch("pipelines.targets.spec.compile_pipeline") as compiled:
        assert main(["schedule", *argv, *VERTEX]) == 2
    assert message in capsys.readouterr().err
    compiled.assert_not_called()
    vertex_job.assert_not_called()


def test_cron_lines_vertex_and_kfp_accept_pass():
    from pipelines.targets import cloud

    for cron in ("0 3 * * 1", "*/15 0-6/2 1,15 jan-mar mon-fri", "30 2 * * 7", "0 0 1 */3 SUN"):
        cloud.check_cron(cron)
    # KFP's robfig/cron v1 takes weekdays 0-6: Sunday as 7 is Vertex's only.
    with pytest.raises(cloud.CloudError, match="'0-7' is not a valid weekday \\(0-6"):
        cloud.check_cron("0 3 * * 0-7", "gke")


VERTEX_WHERE = ["--target", "vertex", "--project", "proj", "--region", "us-central1"]
GKE_WHERE = ["--target", "gke", "--host", "https://kfp.example.com"]


def test_schedule_list_pause_resume_delete_on_vertex(capsys):
    """The real SDK's signatures (autospec) and its Schedule message (aiplatform_v1)."""
    import datetime
    from types import SimpleNamespace

    from google.cloud import aiplatform
    from google.cloud.aiplatform_v1.types import Schedule

    resource = Schedule(
        name="projects/proj/locations/us-central1/schedules/4242", display_name="alignpipe",
        cron="0 3 * * 1", state=Schedule.State.PAUSED,
        next_run_time=datetime.datetime(2026, 12, 7, 3, 0, tzinfo=datetime.UTC),
    )  # fmt: skip
    schedule_cls = aiplatform.PipelineJobSchedule
    with (
        mock.patch.object(schedule_cls, "list", autospec=True) as listed,
        mock.patch.object(schedule_cls, "get", autospec=True) as got,
    ):
        listed.return_value = [SimpleNamespace(gca_resource=resource)]
        got.return_value = mock.create_autospec(schedule_cls, instance=True)
        assert main(["schedule", "list", *VERTEX_WHERE]) == 0
        listed.assert_called_once_with(
            order_by="create_time desc", project="proj", location="us-central1"
        )
        table = capsys.readouterr().out.splitlines()
        assert table[0].split()[:4] == ["schedule", "name", "cron", "state"]
        assert table[1].split() == ["4242", "alignpipe", "0", "3", "*", "*", "1", "paused",
                                    "2026-12-07", "03:00"]  # fmt: skip
        for action in ("pause", "resume", "delete"):
            assert main(["schedule", action, "4242", *VERTEX_WHERE]) == 0
            got.assert_called_with("4242", project="proj", location="us-central1")
        got.return_value.pause.assert_called_once_with()
        got.return_value.resume.assert_called_once_with(catch_up=False)
        got.return_value.delete.assert_called_once_with()
    assert "schedule 4242 deleted on vertex" in capsys.readouterr().out


def test_schedule_list_pause_resume_delete_on_gke(capsys):
    """kfp.Client autospecced; the listing is the real kfp_server_api response type."""
    from kfp_server_api.models import (
        V2beta1CronSchedule,
        V2beta1ListRecurringRunsResponse,
        V2beta1RecurringRun,
        V2beta1Trigger,
    )

    def page(run_id: str, status: str, token: str) -> V2beta1ListRecurringRunsResponse:
        run = V2beta1RecurringRun(
            recurring_run_id=run_id, display_name="alignpipe", status=status,
            trigger=V2beta1Trigger(cron_schedule=V2beta1CronSchedule(cron="0 30 2 * * *")),
        )  # fmt: skip
        return V2beta1ListRecurringRunsResponse(recurring_runs=[run], next_page_token=token)

    with mock.patch("kfp.Client", autospec=True) as client_cls:
        client = client_cls.return_value
        client.list_recurring_runs.side_effect = [page("rr-2", "ENABLED", "t"),
                                                  page("rr-1", "DISABLED", "")]  # fmt: skip
        assert main(["schedule", "list", *GKE_WHERE]) == 0
        client_cls.assert_called_with(host="https://kfp.example.com")
        assert client.list_recurring_runs.call_args_list[1].kwargs["page_token"] == "t"
        rows = capsys.readouterr().out.splitlines()[1:]
        assert [row.split() for row in rows] == [
            ["rr-2", "alignpipe", "30", "2", "*", "*", "*", "active"],
            ["rr-1", "alignpipe", "30", "2", "*", "*", "*", "paused"],
        ]
        for action in ("pause", "resume", "delete"):
            assert main(["schedule", action, "rr-1", *GKE_WHERE]) == 0
        client.disable_recurring_run.assert_called_once_with(recurring_run_id="rr-1")
        client.enable_recurring_run.assert_called_once_with(recurring_run_id="rr-1")
        client.delete_recurring_run.assert_called_once_with(recurring_run_id="rr-1")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["schedule", "pause", "--target", "vertex", "--project", "p", "--region", "r"],
         "needs a SCHEDULE id"),
        (["schedule", "list", "--target", "vertex", "--project", "p"],
         "schedules on vertex needs --region"),
        (["schedule", "list", "--target", "gke"],
         "schedules on gke needs --host (or --kube-context)"),
        (["schedule", *VERTEX], "needs --cron"),
        (["schedule", "list", *VERTEX_WHERE, "--cron", "0 3 * * *"], "list takes no --cron"),
        (["schedule", "list", "4242", *VERTEX_WHERE], "list takes no SCHEDULE ('4242')"),
        (["schedule", "pause", "4242", *VERTEX_WHERE, "--data-uri", "gs://b/p.jsonl"],
         "pause takes no --data-uri; only create reads it"),
    ],
)  # fmt: skip
def test_schedule_management_refuses_missing_settings(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_an_unreachable_service_or_missing_credentials_is_one_line(capsys):
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import aiplatform
    from urllib3.exceptions import MaxRetryError

    refused = MaxRetryError(None, "/apis/v2beta1/healthz", reason="Connection refused")
    with mock.patch("kfp.Client", side_effect=refused):
        assert main(["schedule", "list", *GKE_WHERE]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: MaxRetryError:") and "check --host" in err
    assert len(err.strip().splitlines()) == 1
    missing = DefaultCredentialsError("Your default credentials were not found.")
    with mock.patch.object(aiplatform.PipelineJobSchedule, "list", side_effect=missing):
        assert main(["schedule", "list", *VERTEX_WHERE]) == 1
    assert "gcloud auth application-default login" in capsys.readouterr().err
