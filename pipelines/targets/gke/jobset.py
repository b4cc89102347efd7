"""Multi-host TPU slices on GKE: a training task runs its stage on every host as a JobSet.

GKE documents a multi-host TPU workload as an Indexed Job with ``parallelism`` =
``completions`` = hosts, a headless-Service subdomain and a ``google.com/tpu`` limit per
pod; for such a Job GKE's webhook sets ``TPU_WORKER_ID`` and ``TPU_WORKER_HOSTNAMES`` in
each pod, and ``jax.distributed.initialize()`` reads them. A JobSet
(kubernetes-sigs/jobset, ``jobset.x-k8s.io/v1alpha2``) is that Job with its headless
Service and DNS hostnames made for it, restarted as a whole when a host fails (a
synchronous JAX program cannot replace one host), and it is what GKE's TPU guides and
JobSet's own TPU examples use. Kubeflow Trainer's TrainJob is built on JobSet too, but it
needs the Trainer controller and a training runtime, and its JAX runtime targets CPUs and
NVIDIA GPUs; so the task creates the JobSet directly.

At compile time (``as_launchers``) each training executor of a gke spec whose slice has
several hosts becomes a small CPU container, ``python3 -m pipelines.targets.gke.launcher``,
that carries the stage's own image, command, arguments and environment (``SliceSpec``).
At run time the launcher builds the JobSet with ``manifest`` and waits for it.

The hosts run the task's own KFP executor with the task's executor input: its artifacts
are ``gs://`` URIs, read and written at ``/gcs/BUCKET/...``, where each pod mounts the
buckets with Cloud Storage FUSE (the GKE CSI driver, as Vertex mounts ``/gcs``), so every
host sees the same input and output folders (Orbax writes a sharded model from all hosts).
Only host 0 writes the executor output (KFP's executor writes it on the chief of
``CLUSTER_SPEC`` alone), to a file next to the outputs that the launcher hands to KFP.

The training image runs as UID/GID 10001 (``containers/Dockerfile.train``). The FUSE driver
mounts a bucket as uid 0, gid 0 unless told otherwise, so a non-root host could read but
not write ``/gcs``; the pods run as that user with ``fsGroup`` set, and the volumes carry
the ``uid``, ``gid``, ``file-mode`` and ``dir-mode`` options the driver's docs ask for with
a non-root image (gcs-fuse-csi-driver ``docs/authentication.md``; troubleshooting,
"Permission denied"). A Kubeflow profile namespace is labelled ``istio-injection: enabled``;
a classic Istio sidecar never exits, so a host's pod would never complete and the Job
would hang: the host pods opt out with ``sidecar.istio.io/inject: "false"``, as KFP does for
its own pods (``backend/src/apiserver/template/v2_template.go``).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import posixpath
from typing import Any

from pipelines.targets.placement import HOSTS_ENV, TPU_GENERATIONS, TPU_RESOURCE, Placement
from pipelines.targets.vertex.jobs import ROLE_ENV

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
LAUNCHER_MODULE = "pipelines.targets.gke.launcher"
CONTAINER = "stage"  # the stage's container in each host's pod
REPLICATED_JOB = "slice"
EXECUTOR_INPUT = "{{$}}"  # KFP's placeholder of the executor input
# Stands for the executor input in the stage's arguments: KFP would substitute "{{$}}"
# inside the launcher's --slice argument too, unescaped, and break its JSON.
EXECUTOR_INPUT_MARK = "<alignpipe:executor-input>"
EXECUTOR_OUTPUT_NAME = "jobset_executor_output.json"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
HOST_INDEX_ENV = "ALIGNPIPE_HOST_INDEX"
GCSFUSE_DRIVER = "gcsfuse.csi.storage.gke.io"
# TPU VMs talk on 8471; 8431 exports TPU runtime metrics (GKE's multi-host examples).
TPU_PORTS = (8471, 8431)
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
# The training image's user and group (containers/Dockerfile.train: USER 10001:10001).
IMAGE_UID = IMAGE_GID = 10001
# FUSE mount options of a non-root image: the files belong to it, group-writable.
GCSFUSE_MOUNT_OPTIONS = f"implicit-dirs,uid={IMAGE_UID},gid={IMAGE_GID},file-mode=664,dir-mode=775"
# Istio's injection switch: a label (Istio >= 1.10, wins over the annotation) and the
# annotation KFP sets on its own pods (older Istio reads only this).
ISTIO_INJECT = "sidecar.istio.io/inject"
FINISHED_TTL_S = 24 * 3600  # a JobSet the launcher could not delete goes after a day


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SliceSpec:
    """The stage a training task runs on every host, and the slice it runs on."""

    stage: str
    image: str
    command: list[str]
    args: list[str]  # EXECUTOR_INPUT_MARK where the executor input goes
    env: list[dict[str, str]]
    accelerator: str  # cloud.google.com/gke-tpu-accelerator
    topology: str
    hosts: int
    chips_per_host: int
    max_restarts: int

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SliceSpec:
        return cls(**json.loads(text))


def slice_spec(stage: str, container: dict[str, Any], placement: Placement) -> SliceSpec:
    """The SliceSpec of a compiled training ``container`` placed on ``placement``'s slice."""
    return SliceSpec(
        stage=stage,
        image=container["image"],
        command=list(container.get("command", [])),
        args=[EXECUTOR_INPUT_MARK if a == EXECUTOR_INPUT else a for a in container["args"]],
        env=[dict(e) for e in container.get("env", [])],
        accelerator=TPU_GENERATIONS[placement.tpu].gke_accelerator,
        topology=placement.topology,
        hosts=placement.hosts,
        chips_per_host=placement.chips_per_host,
        max_restarts=placement.train_retries,
    )


def launcher_container(spec: SliceSpec, container: dict[str, Any]) -> dict[str, Any]:
    """The task's container: the launcher, on the training image, with the task's CPU limits."""
    launcher = {
        "image": spec.image,
        "command": ["python3", "-u", "-m", LAUNCHER_MODULE],
        "args": ["--executor-input", EXECUTOR_INPUT, "--slice", spec.to_json()],
        "env": [dict(e) for e in container.get("env", [])],
    }
    if "resources" in container:
        launcher["resources"] = copy.deepcopy(container["resources"])
    return launcher


def as_launchers(spec: dict[str, Any], placement: Placement) -> list[str]:
    """Rewrite every training executor of the compiled gke ``spec`` in place into the
    JobSet launcher; returns the executor labels rewritten."""
    rewritten = []
    for label, executor in spec["deploymentSpec"]["executors"].items():
        container = executor.get("container", {})
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        if env.get(ROLE_ENV) != "train":
            continue
        sliced = slice_spec(label.removeprefix("exec-"), container, placement)
        executor["container"] = launcher_container(sliced, container)
        rewritten.append(label)
    return rewritten


def jobset_name(stage: str, executor_input: dict[str, Any]) -> str:
    """A name for the task's JobSet, the same for every attempt of one task of one run.

    It comes from the task's output URIs (they hold the run and the task), so a retried
    launcher finds the JobSet its predecessor created.
    """
    uris = sorted(uri for _, uri in _artifact_uris(executor_input, "outputs"))
    digest = hashlib.sha256("\n".join(uris).encode()).hexdigest()[:10]
    return f"ap-{stage}-{digest}"


def _artifact_uris(executor_input: dict[str, Any], side: str) -> list[tuple[str, str]]:
    """(name, uri) of every input or output artifact of an executor input."""
    artifacts = executor_input.get(side, {}).get("artifacts", {})
    return [
        (name, artifact["uri"])
        for name, listed in sorted(artifacts.items())
        for artifact in listed.get("artifacts", [])
    ]


def remote_executor_output(executor_input: dict[str, Any]) -> str:
    """Where host 0 writes the executor output: next to the task's first output artifact."""
    outputs = _artifact_uris(executor_input, "outputs")
    if not outputs:
        raise ValueError("the training task has no output artifact to write its results next to")
    return posixpath.join(posixpath.dirname(outputs[0][1].rstrip("/")), EXECUTOR_OUTPUT_NAME)


def gcs_buckets(executor_input: dict[str, Any]) -> list[str]:
    """The buckets the hosts mount: every artifact's, all on Cloud Storage."""
    buckets = set()
    for side in ("inputs", "outputs"):
        for name, uri in _artifact_uris(executor_input, side):
            if not uri.startswith("gs://"):
                raise ValueError(
                    f"artifact {name!r} is at {uri}: the hosts of a multi-host slice reach "
                    "artifacts through Cloud Storage FUSE; submit with --pipeline-root gs://..."
                )
            buckets.add(uri.removeprefix("gs://").split("/", 1)[0])
    return sorted(buckets)


def local_path(uri: str) -> str:
    """The ``/gcs/BUCKET/...`` path of a ``gs://`` URI (as KFP's executor maps it)."""
    return "/gcs/" + uri.removeprefix("gs://")


def host_executor_input(executor_input: dict[str, Any]) -> dict[str, Any]:
    """The hosts' executor input: the task's, with the output file on Cloud Storage."""
    hosts = copy.deepcopy(executor_input)
    hosts["outputs"]["outputFile"] = local_path(remote_executor_output(executor_input))
    return hosts


def manifest(
    spec: SliceSpec,
    *,
    name: str,
    executor_input: dict[str, Any],
    service_account: str = "",
    owner: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JobSet that runs ``spec``'s stage on every host of its slice."""
    labels = {"app.kubernetes.io/part-of": "alignpipe", "alignpipe/stage": spec.stage}
    metadata: dict[str, Any] = {
        "name": name,
        "labels": labels,
        # All hosts of the slice on one node pool: one TPU slice, whole ICI links.
        "annotations": {EXCLUSIVE_TOPOLOGY: "cloud.google.com/gke-nodepool"},
    }
    if owner:
        metadata["ownerReferences"] = [owner]  # deleted with the launcher's pod
    job = {
        "parallelism": spec.hosts,
        "completions": spec.hosts,
        "completionMode": "Indexed",  # TPU_WORKER_ID = the pod's completion index
        "backoffLimit": 0,  # a host that fails fails the Job: the JobSet restarts the slice
        # A preempted or maintained host fails the Job with reason PodFailurePolicy.
        "podFailurePolicy": {
            "rules": [{"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget"}]}]
        },
        "template": _pod_template(spec, executor_input, labels, service_account),
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {
                # Failures restart the whole slice (from its checkpoints) up to maxRestarts
                # times; preemption and host maintenance restart it without using them up.
                "maxRestarts": spec.max_restarts,
                "rules": [
                    {
                        "name": "hostDisrupted",
                        "action": "RestartJobSetAndIgnoreMaxRestarts",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                    }
                ],
            },
            # A headless Service and stable hostnames: TPU_WORKER_HOSTNAMES resolve.
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "ttlSecondsAfterFinished": FINISHED_TTL_S,
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}],
        },
    }


def _pod_template(
    spec: SliceSpec, executor_input: dict[str, Any], labels: dict[str, str], service_account: str
) -> dict[str, Any]:
    """Each host's pod: the stage's container on a TPU VM of the slice, buckets mounted."""
    buckets = gcs_buckets(executor_input)
    stage_input = json.dumps(host_executor_input(executor_input))
    container = {
        "name": CONTAINER,
        "image": spec.image,
        "command": list(spec.command),
        "args": [stage_input if a == EXECUTOR_INPUT_MARK else a for a in spec.args],
        "env": [*spec.env, *_host_env(spec)],
        "ports": [{"containerPort": port} for port in TPU_PORTS],
        "resources": {
            "requests": {TPU_RESOURCE: spec.chips_per_host},
            "limits": {TPU_RESOURCE: spec.chips_per_host},
        },
        "volumeMounts": [
            {"name": f"gcs-{i}", "mountPath": f"/gcs/{bucket}"} for i, bucket in enumerate(buckets)
        ],
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",  # the JobSet restarts the slice, never one host
        # The image's user, stated: the FUSE mounts above give it the files. fsGroup too,
        # so the driver's fsGroup delegation agrees (gid 10001, modes 664/775).
        "securityContext": {
            "runAsUser": IMAGE_UID,
            "runAsGroup": IMAGE_GID,
            "fsGroup": IMAGE_GID,
        },
        "nodeSelector": {
            "cloud.google.com/gke-tpu-accelerator": spec.accelerator,
            "cloud.google.com/gke-tpu-topology": spec.topology,
        },
        "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
        "volumes": [
            {
                "name": f"gcs-{i}",
                "csi": {
                    "driver": GCSFUSE_DRIVER,
                    "volumeAttributes": {
                        "bucketName": bucket,
                        "mountOptions": GCSFUSE_MOUNT_OPTIONS,
                    },
                },
            }
            for i, bucket in enumerate(buckets)
        ],
    }
    if service_account:
        pod["serviceAccountName"] = service_account  # the task's: Workload Identity for GCS
    # No Istio sidecar: a classic one never exits, so the host's Job would never complete.
    return {
        "metadata": {
            "labels": {**labels, ISTIO_INJECT: "false"},
            "annotations": {"gke-gcsfuse/volumes": "true", ISTIO_INJECT: "false"},
        },
        "spec": pod,
    }


def _host_env(spec: SliceSpec) -> list[dict[str, Any]]:
    """The host's index, and a CLUSTER_SPEC that makes host 0 alone write the executor output."""
    env: list[dict[str, Any]] = (
        []
        if any(e["name"] == HOSTS_ENV for e in spec.env)
        else [{"name": HOSTS_ENV, "value": str(spec.hosts)}]
    )
    index = {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}
    # KFP's executor writes its output file only where CLUSTER_SPEC's task type is
    # workerpool0 (or chief/master); $(...) expands the index defined just above.
    cluster = {"cluster": {}, "task": {"type": f"workerpool$({HOST_INDEX_ENV})", "index": 0}}
    return [
        *env,
        {"name": HOST_INDEX_ENV, "valueFrom": index},
        {"name": "CLUSTER_SPEC", "value": json.dumps(cluster)},
    ]


def rbac(namespace: str, service_account: str) -> list[dict[str, Any]]:
    """The Role and RoleBinding the task's service account needs to launch and watch JobSets."""
    name = "alignpipe-jobset-launcher"
    rules = [
        {"apiGroups": [GROUP], "resources": [PLURAL],
         "verbs": ["create", "get", "list", "watch", "patch", "delete"]},
        # Its own pod (service account, owner of the JobSet), the hosts' pods and their logs.
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods/log"], "verbs": ["get"]},
    ]  # fmt: skip
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace},
        "rules": rules,
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }
    return [role, binding]
