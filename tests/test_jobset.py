"""Multi-host GKE slices: the JobSet manifest against JobSet's CRD schema, the compiled
launcher tasks, the launcher's verdicts on kubernetes client objects, the RBAC it needs."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from kubernetes.client import (
    V1ContainerState,
    V1ContainerStateTerminated,
    V1ContainerStateWaiting,
    V1ContainerStatus,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodStatus,
)

from pipelines.cli.main import main
from pipelines.targets.gke import jobset, launcher
from pipelines.targets.placement import HOSTS_ENV, Placement
from pipelines.targets.spec import read_spec

FIXTURES = Path(__file__).parent / "fixtures"
IMAGE = "us-docker.pkg.dev/p/alignpipe/train@sha256:" + "ab" * 32
ROOT = "gs://runs-bucket/root/alignpipe/run-7"
EXECUTOR_INPUT = {
    "inputs": {
        "parameterValues": {"rollout_batch_size": 256, "algorithm": "ppo"},
        "artifacts": {
            "shards": {"artifacts": [{"uri": f"{ROOT}/shard/shards", "metadata": {}}]},
            # A cached input from an older run in another bucket: mounted too.
            "reward": {"artifacts": [{"uri": "gs://models-bucket/old/reward/model"}]},
        },
    },
    "outputs": {
        "artifacts": {
            "metrics": {"artifacts": [{"uri": f"{ROOT}/ppo/metrics"}]},
            "model": {"artifacts": [{"uri": f"{ROOT}/ppo/model"}]},
        },
        "outputFile": "/tmp/kfp_outputs/output_metadata.json",
        "parameters": {"Output": {"outputFile": "/tmp/kfp_outputs/Output"}},
    },
}
COMPILED_CONTAINER = {
    "image": IMAGE,
    "command": ["sh", "-ec", 'python3 -m kfp.dsl.executor_main "$@"', "def ppo(): ..."],
    "args": ["--executor_input", "{{$}}", "--function_to_execute", "ppo"],
    "env": [{"name": HOSTS_ENV, "value": "4"}, {"name": "ALIGNPIPE_ROLE", "value": "train"}],
    "resources": {"resourceCpuLimit": "4", "resourceMemoryLimit": "16G"},
}
OWNER = {"apiVersion": "v1", "kind": "Pod", "name": "run-7-ppo-launcher", "uid": "0f-uid"}


def _spec(tpu: str = "v5p", topology: str = "2x2x4") -> jobset.SliceSpec:
    placement = Placement(target="gke", image=IMAGE, tpu=tpu, topology=topology)
    return jobset.slice_spec("ppo", COMPILED_CONTAINER, placement)


def sample_manifests() -> list[dict]:
    """The manifests the schema fixture was pruned against (prune_jobset_crd.py)."""
    return [
        jobset.manifest(_spec(), name="ap-ppo-0123456789", executor_input=EXECUTOR_INPUT,
                        service_account="default-editor", owner=OWNER),
        jobset.manifest(_spec("v5e", "4x4"), name="ap-ppo-9", executor_input=EXECUTOR_INPUT),
    ]  # fmt: skip


def _strict(schema: dict) -> dict:
    """The schema with unknown fields refused, as the API server's fieldValidation=Strict
    does (a CRD schema alone lets them through, and the server drops them silently)."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            open_ended = "additionalProperties" in node or node.get(
                "x-kubernetes-preserve-unknown-fields"
            )
            if "properties" in node and not open_ended:
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


@pytest.fixture(scope="module")
def crd_schema() -> dict:
    return _strict(yaml.safe_load((FIXTURES / "jobset_v0.12.0_openapi.yaml").read_text()))


def test_manifest_validates_against_the_jobset_crd_schema(crd_schema):
    for manifest in sample_manifests():
        jsonschema.validate(manifest, crd_schema)


@pytest.mark.parametrize(
    ("path", "key", "value"),
    [
        (("spec", "replicatedJobs", 0, "template", "spec"), "completionsMode", "Indexed"),
        (("spec", "failurePolicy", "rules", 0), "action", "RestartSlice"),
        (("spec", "replicatedJobs", 0, "template", "spec", "template", "spec"), "hostNetwrk", True),
        (("spec",), "network", {"enableDNSHostname": True}),
    ],
)
def test_a_wrong_field_or_value_fails_the_schema(crd_schema, path, key, value):
    manifest = sample_manifests()[0]
    node = manifest
    for step in path:
        node = node[step]
    node[key] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(manifest, crd_schema)


def test_every_host_runs_the_stage_on_its_tpu_vm():
    manifest = sample_manifests()[0]
    assert manifest["metadata"]["ownerReferences"] == [OWNER]
    (replicated,) = manifest["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert (replicated["replicas"], job["parallelism"], job["completions"]) == (1, 4, 4)
    assert job["completionMode"] == "Indexed" and job["backoffLimit"] == 0
    assert manifest["spec"]["network"]["enableDNSHostnames"] is True
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 3
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x2x4",
    }
    assert pod["serviceAccountName"] == "default-editor" and pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == {"google.com/tpu": 4}
    assert container["command"] == COMPILED_CONTAINER["command"]
    # The stage's own executor, with the task's executor input; its output file on GCS.
    args = container["args"]
    stage_input = json.loads(args[args.index("--executor_input") + 1])
    assert stage_input["inputs"] == EXECUTOR_INPUT["inputs"]
    assert stage_input["outputs"]["outputFile"] == (
        "/gcs/runs-bucket/root/alignpipe/run-7/ppo/jobset_executor_output.json"
    )
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert mounts == {"/gcs/models-bucket", "/gcs/runs-bucket"}
    buckets = {v["csi"]["volumeAttributes"]["bucketName"] for v in pod["volumes"]}
    assert buckets == {"models-bucket", "runs-bucket"}
    assert job["template"]["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"


def _pod_template(manifest: dict) -> dict:
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def _check_hosts_write_gcs_without_istio(manifest: dict) -> None:
    """Items 1 and 2 of issue 40 on one manifest (sources in the test docstrings)."""
    template = _pod_template(manifest)
    pod = template["spec"]
    assert pod["securityContext"] == {"runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001}
    for volume in pod["volumes"]:
        options = volume["csi"]["volumeAttributes"]["mountOptions"].split(",")
        assert options == [
            "implicit-dirs",
            "uid=10001",
            "gid=10001",
            "file-mode=664",
            "dir-mode=775",
        ]
    assert template["metadata"]["labels"]["sidecar.istio.io/inject"] == "false"
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    # The JobSet itself is no pod: Istio reads the switch on pods only.
    assert "sidecar.istio.io/inject" not in manifest["metadata"]["labels"]


def test_non_root_hosts_write_gcs_and_get_no_istio_sidecar(crd_schema):
    """The FUSE driver mounts as uid 0/gid 0 unless told (gcs-fuse-csi-driver
    pkg/sidecar_mounter/sidecar_mounter_config.go); with a non-root image its docs ask for
    uid, gid, file-mode, dir-mode, or fsGroup (docs/authentication.md, docs/troubleshooting.md
    "Permission denied"). Kubeflow profile namespaces inject Istio; KFP opts its pods out with
    sidecar.istio.io/inject: "false" (kubeflow/pipelines backend/src/apiserver/template)."""
    for manifest in sample_manifests():
        _check_hosts_write_gcs_without_istio(manifest)
        jsonschema.validate(manifest, crd_schema)


def test_the_mount_owner_is_the_training_images_user():
    dockerfile = (FIXTURES.parent.parent / "containers" / "Dockerfile.train").read_text()
    assert re.search(rf"^USER {jobset.IMAGE_UID}:{jobset.IMAGE_GID}$", dockerfile, re.M)
    assert f"--uid {jobset.IMAGE_UID} --gid {jobset.IMAGE_GID}" in dockerfile


@pytest.mark.parametrize(
    ("field", "value"),
    [("runAsUser", "10001"), ("fsGroupPolicy", "OnRootMismatch"), ("fsgroup", 10001)],
)
def test_a_wrong_security_context_fails_the_schema(crd_schema, field, value):
    manifest = sample_manifests()[0]
    _pod_template(manifest)["spec"]["securityContext"][field] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(manifest, crd_schema)


@pytest.mark.parametrize(("host", "writes"), [("0", True), ("1", False), ("3", False)])
def test_only_host_0_writes_the_executor_output(tmp_path, monkeypatch, host, writes):
    """KFP's own executor, given each host's CLUSTER_SPEC as Kubernetes expands it."""
    from kfp.dsl import executor

    (container,) = sample_manifests()[0]["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]["containers"]  # fmt: skip
    env = {e["name"]: e.get("value") for e in container["env"]}
    expanded = env["CLUSTER_SPEC"].replace(f"$({jobset.HOST_INDEX_ENV})", host)
    monkeypatch.setenv("CLUSTER_SPEC", expanded)
    output = tmp_path / "executor_output.json"
    run = executor.Executor(
        {"inputs": {}, "outputs": {"outputFile": str(output), "parameters": {}}}, lambda: None
    )
    run.execute()
    assert output.exists() is writes
    assert env[HOSTS_ENV] == "4"


def test_a_non_gcs_artifact_is_refused_with_the_fix():
    local = copy.deepcopy(EXECUTOR_INPUT)
    local["inputs"]["artifacts"]["shards"]["artifacts"][0]["uri"] = "minio://mlpipeline/s"
    with pytest.raises(ValueError, match="shards.*--pipeline-root gs://"):
        jobset.manifest(_spec(), name="x", executor_input=local)


def test_the_name_is_the_same_for_every_attempt_of_a_task():
    name = jobset.jobset_name("evaluate", EXECUTOR_INPUT)
    assert name == jobset.jobset_name("evaluate", copy.deepcopy(EXECUTOR_INPUT))
    assert name.startswith("ap-evaluate-") and len(name) <= 30
    other = copy.deepcopy(EXECUTOR_INPUT)
    other["outputs"]["artifacts"]["model"]["artifacts"][0]["uri"] = "gs://b/run-8/ppo/model"
    assert jobset.jobset_name("evaluate", other) != name


@pytest.fixture(scope="module")
def gke_7b(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gke") / "p.yaml"
    argv = ["compile", "--target", "gke", "--image", IMAGE, "--run-preset", "v5p-32-7b"]
    assert main([*argv, "-o", str(out)]) == 0
    (spec,) = read_spec(out)  # no TPU node selectors on the tasks
    return spec


def test_run_preset_v5p_32_7b_compiles_for_gke_as_jobset_launchers(gke_7b, crd_schema):
    executors = gke_7b["deploymentSpec"]["executors"]
    for task in ("sft", "reward", "ppo", "dpo", "evaluate"):
        container = executors[f"exec-{task}"]["container"]
        assert container["command"][-1] == jobset.LAUNCHER_MODULE
        assert "accelerator" not in container["resources"]  # the launcher is a CPU pod
        args = container["args"]
        assert args[args.index("--executor-input") + 1] == "{{$}}"
        spec = jobset.SliceSpec.from_json(args[args.index("--slice") + 1])
        assert (spec.stage, spec.hosts, spec.chips_per_host, spec.topology) == (task, 4, 4, "2x2x4")
        assert "{{$}}" not in json.dumps(spec.args)  # KFP would substitute it, unescaped
        manifest = jobset.manifest(spec, name=f"ap-{task}-1", executor_input=EXECUTOR_INPUT)
        jsonschema.validate(manifest, crd_schema)
        _check_hosts_write_gcs_without_istio(manifest)
    assert executors["exec-shard"]["container"]["command"][-1] != jobset.LAUNCHER_MODULE


def test_v5p_32_7b_launcher_pods_go_to_a_node_pool_that_holds_their_inputs(tmp_path, capsys):
    """KFP's launcher downloads every input artifact of a task before its command runs
    (kubeflow/pipelines backend/src/v2/component/launcher_v2.go, downloadArtifacts: "TODO:
    Selectively copy artifacts") into the /gcs emptyDir its compiler mounts on every pod
    (backend/src/v2/compiler/argocompiler/container.go, gcs-scratch): the launcher pod of a
    7B slice needs a node whose boot disk holds the models. Said, or pinned by the flag."""
    out = tmp_path / "p.yaml"
    argv = ["compile", "--target", "gke", "--image", IMAGE, "--run-preset", "v5p-32-7b"]
    assert main([*argv, "-o", str(out)]) == 0
    assert "--launcher-node-pool NAME" in capsys.readouterr().err
    assert main([*argv, "--launcher-node-pool", "cpu-500g", "-o", str(out)]) == 0
    assert "--launcher-node-pool" not in capsys.readouterr().err
    spec, platform = read_spec(out)
    configs = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for task in ("sft", "reward", "ppo", "dpo", "evaluate"):
        assert configs[f"exec-{task}"]["nodeSelector"] == {
            "labels": {"cloud.google.com/gke-nodepool": "cpu-500g"}
        }
        container = spec["deploymentSpec"]["executors"][f"exec-{task}"]["container"]
        assert container["command"][-1] == jobset.LAUNCHER_MODULE
    assert "exec-shard" not in configs  # the data and light tasks go where they went


def _pod(index: int, *, waiting: str = "", exit_code: int | None = None, unschedulable: str = ""):
    state = V1ContainerState()
    if waiting:
        state.waiting = V1ContainerStateWaiting(reason=waiting, message="manifest unknown")
    if exit_code is not None:
        state.terminated = V1ContainerStateTerminated(exit_code=exit_code, reason="Error")
    statuses = [V1ContainerStatus(name="stage", image=IMAGE, image_id="", ready=False,
                                  restart_count=0, state=state)]  # fmt: skip
    conditions = [V1PodCondition(type="PodScheduled", status="False", reason="Unschedulable",
                                 message=unschedulable)] if unschedulable else None  # fmt: skip
    return V1Pod(
        metadata=V1ObjectMeta(name=f"ap-ppo-1-slice-0-{index}-x", uid=f"u{index}",
                              annotations={jobset.INDEX_ANNOTATION: str(index)}),
        status=V1PodStatus(phase="Failed" if exit_code else "Pending",
                           container_statuses=statuses, conditions=conditions),
    )  # fmt: skip


def _jobset(*conditions: dict, restarts: int = 0) -> dict:
    status = {"restarts": restarts, "conditions": list(conditions),
              "replicatedJobsStatus": [{"name": "slice", "active": 1, "ready": 1}]}  # fmt: skip
    return {"metadata": {"name": "ap-ppo-1"}, "status": status}


def test_verdicts_on_jobset_status_and_host_pods():
    decide = launcher.decide
    running = decide(_jobset(restarts=1), [_pod(0), _pod(1, unschedulable="0/3 nodes: tpu")], IMAGE)
    assert running.state == "running" and not running.done
    assert "1 restart(s)" in running.message and "host 1" in running.message
    done = {"type": "Completed", "status": "True", "reason": "AllJobsCompleted"}
    assert decide(_jobset(done), [], IMAGE).state == "succeeded"
    failed = {"type": "Failed", "status": "True", "message": "jobset exceeded max restarts"}
    verdict = decide(_jobset(failed, restarts=3), [_pod(0), _pod(2, exit_code=1)], IMAGE)
    assert verdict.state == "failed"
    assert "after 3 restart(s): jobset exceeded max restarts" in verdict.message
    assert "host 2 (ap-ppo-1-slice-0-2-x) exited 1 (Error)" in verdict.message
    # An image the TPU nodes cannot pull never starts: fail now, name the image and the fix.
    stuck = decide(_jobset(), [_pod(0, waiting="ImagePullBackOff"), _pod(1)], IMAGE)
    assert stuck.state == "failed" and f"image {IMAGE} cannot be pulled" in stuck.message
    assert "check --image" in stuck.message
    suspended = {"type": "Suspended", "status": "True"}
    assert "suspended" in decide(_jobset(suspended), [], IMAGE).message


def test_host_0s_executor_output_is_handed_to_kfp(tmp_path):
    """What host 0 wrote next to the outputs becomes the task's output file (local folders
    standing in for the bucket; fileio reads gs:// the same way)."""
    executor_input = copy.deepcopy(EXECUTOR_INPUT)
    outputs = executor_input["outputs"]
    for name in ("metrics", "model"):
        outputs["artifacts"][name]["artifacts"][0]["uri"] = str(tmp_path / "ppo" / name)
    outputs["outputFile"] = str(tmp_path / "kfp_outputs" / "output_metadata.json")
    with pytest.raises(RuntimeError, match="host 0 wrote no executor output"):
        launcher.hand_back_output(executor_input)
    written = {"parameterValues": {"Output": '{"uri": "gs://runs-bucket/ppo/model"}'}}
    (tmp_path / "ppo").mkdir()
    (tmp_path / "ppo" / jobset.EXECUTOR_OUTPUT_NAME).write_text(json.dumps(written))
    launcher.hand_back_output(executor_input)
    assert json.loads(Path(outputs["outputFile"]).read_text()) == written


def test_launcher_refuses_bad_arguments_with_a_clear_error(capsys):
    argv = ["--executor-input", "{not json", "--slice", _spec().to_json()]
    assert launcher.main(argv) == 1
    assert "--executor-input is not JSON" in capsys.readouterr().err
    # Outside a pod there are no in-cluster credentials: said, not a traceback.
    argv = ["--executor-input", json.dumps(EXECUTOR_INPUT), "--slice", _spec().to_json()]
    assert launcher.main(argv) == 1
    assert "not inside a Kubernetes pod" in capsys.readouterr().err


def test_rbac_command_prints_the_role_and_binding(capsys):
    assert main(["rbac", "--namespace", "team-a", "--service-account", "default-editor"]) == 0
    role, binding = yaml.safe_load_all(capsys.readouterr().out)
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "team-a"
    verbs = {(r["apiGroups"][0], r["resources"][0]): set(r["verbs"]) for r in role["rules"]}
    assert {"create", "get", "watch", "patch", "delete"} <= verbs["jobset.x-k8s.io", "jobsets"]
    assert verbs["", "pods/log"] == {"get"}
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "default-editor", "namespace": "team-a"}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
