"""``alignpipe smoke``: the one-task pipeline per target, and its task run for real on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
from google.cloud.aiplatform_v1.types import CustomJob

from pipelines.cli.main import main
from pipelines.targets.gke import jobset
from pipelines.targets.placement import Placement
from pipelines.targets.smoke import SMOKE_PIPELINE, build_smoke_pipeline
from pipelines.targets.smoke_task import SmokeError, check_devices
from pipelines.targets.spec import read_spec
from pipelines.targets.vertex import jobs as vertex_jobs

TRAIN_IMAGE = "us-docker.pkg.dev/p/alignpipe/train@sha256:" + "ab" * 32
TASK = "smoke-check"
VERTEX = ["--target", "vertex", "--image", TRAIN_IMAGE]
CLOUD = ["--project", "proj", "--region", "us-central1", "--pipeline-root", "gs://b/runs"]
RUNNER = "runner@proj.iam.gserviceaccount.com"


def _compile(tmp_path: Path, *flags: str) -> list[dict]:
    path = tmp_path / "smoke.yaml"
    assert main(["smoke", *flags, "--compile-only", "-o", str(path)]) == 0
    return read_spec(path)


def _one_task(spec: dict) -> dict:
    tasks = spec["root"]["dag"]["tasks"]
    assert list(tasks) == [TASK]
    return tasks[TASK]


def test_vertex_smoke_is_one_tpu_custom_job(tmp_path):
    (spec,) = _compile(tmp_path, *VERTEX, "--tpu", "v5e", "--tpu-topology", "2x4")
    assert spec["pipelineInfo"]["name"] == SMOKE_PIPELINE
    task = _one_task(spec)
    inputs = task["inputs"]["parameters"]
    assert inputs["expected_platform"]["runtimeValue"]["constant"] == "tpu"
    assert inputs["expected_devices"]["runtimeValue"]["constant"] == 8
    assert not task["cachingOptions"].get("enableCache")  # a smoke run checks now
    assert not task.get("retryPolicy", {}).get("maxRetryCount")  # fails at once
    container = spec["deploymentSpec"]["executors"][f"exec-{TASK}"]["container"]
    assert container["image"] == vertex_jobs.LAUNCHER_IMAGE
    job = CustomJob(json.loads(json.dumps(vertex_jobs.payload_of(container))))
    (pool,) = job.job_spec.worker_pool_specs
    assert pool.machine_spec.machine_type == "ct5lp-hightpu-8t"
    assert pool.machine_spec.tpu_topology == "2x4"
    assert pool.container_spec.image_uri == TRAIN_IMAGE
    assert job.labels["pipeline"] == SMOKE_PIPELINE


def test_gke_smoke_lands_on_the_tpu_node_pool(tmp_path):
    spec, platform = _compile(tmp_path, "--target", "gke", "--image", TRAIN_IMAGE, "--tpu", "v6e")
    assert _one_task(spec)["inputs"]["parameters"]["expected_devices"]["runtimeValue"] == {
        "constant": 4
    }
    k8s = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"][f"exec-{TASK}"]
    assert k8s["nodeSelector"]["labels"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "2x2",
    }
    assert k8s["tolerations"] == [
        {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    container = spec["deploymentSpec"]["executors"][f"exec-{TASK}"]["container"]
    assert container["image"] == TRAIN_IMAGE
    assert container["resources"]["accelerator"]["resourceType"] == "google.com/tpu"
    assert container["resources"]["accelerator"]["resourceCount"] == "4"


def test_smoke_task_runs_under_kfp_local_on_8_cpu_devices(tmp_path):
    from kfp import local

    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path))
    summary = json.loads(build_smoke_pipeline(Placement(cpu_devices=8))().output)
    (written,) = tmp_path.glob(f"{SMOKE_PIPELINE}-*/{TASK}/summary")
    assert json.loads(written.read_text()) == summary
    assert summary["platform"] == "cpu" and summary["devices"] == 8
    assert summary["pmap_psum"] == 128**3 * sum((i + 1) ** 2 for i in range(8))


def test_unexpected_devices_fail_with_what_to_check():
    assert check_devices("cpu", 8)["local_devices"] == 8
    with pytest.raises(SmokeError, match="JAX sees cpu devices, not tpu.*jax\\[tpu\\]"):
        check_devices("tpu", 8)
    with pytest.raises(SmokeError, match="JAX sees 8 devices, the placement asked for 4"):
        check_devices("cpu", 4)
    with pytest.raises(ValueError, match="expected_platform: 'cuda'"):
        check_devices("cuda", 8)


def test_compile_only_needs_an_output_file(capsys):
    assert main(["smoke", *VERTEX, "--compile-only"]) == 2
    assert "--compile-only needs -o FILE" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--fresh-from", "sft"], ["--data-image", "img@sha256:0"]])
def test_smoke_takes_no_flag_of_the_whole_pipeline(flag, tmp_path, capsys):
    """One task on the training image: no data tasks to place, no cache to start fresh."""
    with pytest.raises(SystemExit) as exited:
        main(["smoke", *VERTEX, *flag, "--compile-only", "-o", str(tmp_path / "s.yaml")])
    assert exited.value.code == 2 and flag[0] in capsys.readouterr().err


def test_gke_multi_host_smoke_runs_on_every_host_through_the_jobset_launcher(tmp_path):
    flags = ["--target", "gke", "--image", TRAIN_IMAGE, "--tpu", "v5e", "--tpu-topology", "4x4"]
    spec = _compile(tmp_path, *flags)[0]
    assert _one_task(spec)["inputs"]["parameters"]["expected_devices"]["runtimeValue"] == {
        "constant": 16
    }
    container = spec["deploymentSpec"]["executors"][f"exec-{TASK}"]["container"]
    assert container["command"][-1] == jobset.LAUNCHER_MODULE
    args = container["args"]
    sliced = jobset.SliceSpec.from_json(args[args.index("--slice") + 1])
    assert (sliced.hosts, sliced.chips_per_host, sliced.topology) == (4, 4, "4x4")
    assert sliced.image == TRAIN_IMAGE and sliced.max_restarts == 0  # a smoke run fails at once


def test_submit_to_vertex_and_wait_for_a_failed_run(capsys):
    with mock.patch("google.cloud.aiplatform.PipelineJob", autospec=True) as job:
        job.return_value.wait.side_effect = RuntimeError("Job failed with: quota")
        argv = ["smoke", *VERTEX, *CLOUD, "--service-account", RUNNER, "--wait"]
        assert main(argv) == 1
    kwargs = job.call_args.kwargs
    assert kwargs["display_name"] == SMOKE_PIPELINE and kwargs["parameter_values"] == {}
    assert kwargs["labels"]["pipeline"] == SMOKE_PIPELINE
    assert kwargs["labels"]["machine_type"] == "ct5lp-hightpu-4t"
    job.return_value.submit.assert_called_once_with(service_account=RUNNER)
    assert "smoke run failed: Job failed with: quota" in capsys.readouterr().err


def test_smoke_prints_what_each_vertex_account_needs(tmp_path, capsys):
    """CustomJobSpec.service_account (aiplatform_v1): "Users submitting jobs must have act-as
    permission on this run-as account"; GCPC's launcher creates the job as the run's account,
    so that account needs aiplatform.user and act-as on itself."""
    _compile(tmp_path, *VERTEX, *CLOUD, "--service-account", RUNNER)
    out = capsys.readouterr().out
    assert f"{RUNNER}: roles/aiplatform.user on proj" in out
    assert f"{RUNNER}: roles/iam.serviceAccountUser on itself" in out
    assert (
        f"you: roles/aiplatform.user on proj, and roles/iam.serviceAccountUser on {RUNNER}" in out
    )
    assert f"{RUNNER}: roles/storage.objectUser on gs://b " in out
    _compile(tmp_path, *VERTEX, *CLOUD)
    assert "the Compute Engine default service account" in capsys.readouterr().out


def test_smoke_prints_workload_identity_and_the_jobset_role_for_a_gke_slice(tmp_path, capsys):
    """gcs-fuse-csi-driver docs/authentication.md: the bucket role goes to the Kubernetes
    ServiceAccount's Workload Identity principal; the hosts run as the launcher pod's KSA."""
    flags = ["--target", "gke", "--image", TRAIN_IMAGE, "--tpu", "v5e", "--tpu-topology", "4x4"]
    flags += ["--pipeline-root", "gs://runs-b/root", "--namespace", "team-a"]
    _compile(tmp_path, *flags)
    out = capsys.readouterr().out
    member = (
        "principal://iam.googleapis.com/projects/PROJECT_NUMBER/locations/global/"
        "workloadIdentityPools/PROJECT_ID.svc.id.goog/subject/ns/team-a/sa/default-editor"
    )
    grant = "team-a/default-editor (the run's pods): roles/storage.objectUser on gs://runs-b"
    assert f"{grant} for {member}" in out
    assert "alignpipe rbac --namespace team-a --service-account default-editor" in out
    assert "Workload Identity Federation on the cluster and on every node pool" in out
    _compile(tmp_path, "--target", "gke", "--image", TRAIN_IMAGE, "--service-account", "runner")
    out = capsys.readouterr().out
    assert "NAMESPACE/runner (the run's pods)" in out and "alignpipe rbac" not in out
