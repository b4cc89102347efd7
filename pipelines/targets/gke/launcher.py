"""``python -m pipelines.targets.gke.launcher``: a GKE training task's stage on every TPU host.

The KFP task of a multi-host slice runs this in the training image (``jobset.as_launchers``
puts it there). It creates the task's JobSet (``jobset.manifest``) in its own namespace
with the official ``kubernetes`` client and in-cluster credentials, prints the slice's
state as it changes and host 0's log, then hands host 0's executor output to KFP and
deletes the JobSet; it fails the task when the JobSet fails (after its restarts) or when
a host cannot start (an image the nodes cannot pull), and deletes the JobSet when the task
is cancelled (SIGTERM). A retried task finds the JobSet of its first attempt by name.

Its service account needs the Role ``alignpipe rbac`` prints (jobsets: create, get, list,
watch, patch, delete; pods: get, list, watch; pods/log: get). The JobSet is owned by the
task's pod, so it goes when that pod is deleted, even if the launcher could not say so.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from pipelines.targets.gke import jobset

POLL_S = 15.0
MAX_FAILED_POLLS = 8  # two minutes of an unreachable API server
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# Waiting reasons of a host that will not start by waiting longer: the image is wrong.
HOPELESS_WAITING = {
    "ErrImagePull": "cannot be pulled",
    "ImagePullBackOff": "cannot be pulled",
    "InvalidImageName": "is not a valid image reference",
    "ErrImageNeverPull": "is not on the node and may not be pulled",
    "CreateContainerConfigError": "cannot be configured",
}
INSTALL_JOBSET = (
    "install JobSet in the cluster (kubectl apply --server-side -f "
    "https://github.com/kubernetes-sigs/jobset/releases/download/v0.12.0/manifests.yaml)"
)


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """Where a JobSet stands: ``running``, ``succeeded`` or ``failed``, said in a line."""

    state: str
    message: str

    @property
    def done(self) -> bool:
        return self.state != "running"


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The JobSet condition of type ``kind`` when it is true."""
    for condition in status.get("conditions") or []:
        if condition.get("type") == kind and condition.get("status") == "True":
            return condition
    return None


def host_index(pod: Any) -> int:
    """The host (completion index) a JobSet pod runs; -1 when the pod does not say."""
    marks = {**(pod.metadata.labels or {}), **(pod.metadata.annotations or {})}
    text = marks.get(jobset.INDEX_ANNOTATION, "")
    return int(text) if re.fullmatch("[0-9]+", text) else -1  # ASCII: isdigit takes "²"


def _host_problem(pod: Any, image: str) -> tuple[bool, str]:
    """(hopeless, what is wrong with one host's pod), or (False, '') when nothing is."""
    host = f"host {host_index(pod)} ({pod.metadata.name})"
    for status in pod.status.container_statuses or []:
        waiting, terminated = status.state.waiting, status.state.terminated
        if waiting is not None and waiting.reason in HOPELESS_WAITING:
            what = HOPELESS_WAITING[waiting.reason]
            return True, (
                f"{host}: image {image} {what} ({waiting.reason}: {waiting.message or ''}); "
                "check --image, and that the TPU node pool's service account may read it"
            )
        if terminated is not None and terminated.exit_code:
            reason = terminated.reason or "Error"
            text = f": {terminated.message.strip()}" if terminated.message else ""
            return False, f"{host} exited {terminated.exit_code} ({reason}){text}"
    for condition in pod.status.conditions or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return False, f"{host} waits for a TPU node: {condition.message or condition.reason}"
    if pod.status.phase == "Failed":
        return False, f"{host} failed: {pod.status.reason or ''} {pod.status.message or ''}".strip()
    return False, ""


def decide(jobset_object: dict[str, Any], pods: Iterable[Any], image: str) -> Verdict:
    """The verdict on a JobSet (its object as the API returns it) and its pods (V1Pod)."""
    status = jobset_object.get("status") or {}
    name = jobset_object["metadata"]["name"]
    restarts = status.get("restarts", 0)
    found = [_host_problem(pod, image) for pod in sorted(pods, key=host_index)]
    problems = [(hopeless, text) for hopeless, text in found if text]
    failed = _condition(status, "Failed")
    if failed is not None or status.get("terminalState") == "Failed":
        why = (failed or {}).get("message") or (failed or {}).get("reason") or "failed"
        hosts = "".join(f"; {text}" for _, text in problems)
        return Verdict("failed", f"JobSet {name} failed after {restarts} restart(s): {why}{hosts}")
    if _condition(status, "Completed") is not None or status.get("terminalState") == "Completed":
        return Verdict("succeeded", f"JobSet {name} completed after {restarts} restart(s)")
    hopeless = [text for is_hopeless, text in problems if is_hopeless]
    if hopeless:
        return Verdict("failed", f"JobSet {name} cannot start: {hopeless[0]}")
    if _condition(status, "Suspended") is not None:
        return Verdict("running", f"JobSet {name} is suspended (queued, e.g. by Kueue)")
    return Verdict("running", _progress(name, restarts, status, problems))


def _progress(name: str, restarts: int, status: dict[str, Any], problems: list) -> str:
    """One line of a running JobSet: its hosts' counts, restarts and what holds hosts back."""
    counts = {"ready": 0, "active": 0, "succeeded": 0, "failed": 0}
    for job in status.get("replicatedJobsStatus") or []:
        for key in counts:
            counts[key] += int(job.get(key, 0) or 0)
    jobs = ", ".join(f"{value} {key}" for key, value in counts.items() if value)
    line = f"JobSet {name}: jobs {jobs or 'starting'}; {restarts} restart(s)"
    return line + "".join(f"; {text}" for _, text in problems[:2])


def read_executor_input(text: str) -> dict[str, Any]:
    """The task's executor input (the --executor-input JSON), checked for what is used."""
    try:
        executor_input = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"--executor-input is not JSON ({error}); KFP passes it as {{{{$}}}}"
        ) from None
    outputs = executor_input.get("outputs") if isinstance(executor_input, dict) else None
    if not isinstance(outputs, dict) or "outputFile" not in outputs:
        raise ValueError("--executor-input has no outputs.outputFile; KFP passes it as {{$}}")
    return executor_input


class ApiError(RuntimeError):
    """A Kubernetes API call that failed; ``status`` is its HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class Cluster:
    """The API calls the launcher makes (kubernetes client, in-cluster credentials)."""

    def __init__(self) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException as error:
            raise RuntimeError(
                f"not inside a Kubernetes pod ({error}): this launcher runs as a KFP task on GKE"
            ) from None
        self.core, self.custom = client.CoreV1Api(), client.CustomObjectsApi()
        with open(os.path.join(SERVICE_ACCOUNT_DIR, "namespace")) as handle:
            self.namespace = handle.read().strip()

    def own_pod(self) -> Any:
        """This task's pod (its service account runs the hosts; the JobSet is owned by it)."""
        return self._call(
            "get pods", self.core.read_namespaced_pod, os.environ["HOSTNAME"], self.namespace
        )

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """Create the JobSet, or return the one a previous attempt of this task created."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self.custom.create_namespaced_custom_object(
                jobset.GROUP, jobset.VERSION, self.namespace, jobset.PLURAL, body,
                field_validation="Strict",
            )  # fmt: skip
        except ApiException as error:
            if error.status == 409:  # a retried task: take over its first attempt's JobSet
                name = body["metadata"]["name"]
                print(f"JobSet {name} exists: following it", flush=True)
                owners = body["metadata"].get("ownerReferences", [])
                owner = {"metadata": {"ownerReferences": owners}}
                return self._call(
                    "patch jobsets", self.custom.patch_namespaced_custom_object,
                    jobset.GROUP, jobset.VERSION, self.namespace, jobset.PLURAL, name, owner,
                )  # fmt: skip
            if error.status == 404:
                raise RuntimeError(f"the JobSet API is not served here: {INSTALL_JOBSET}") from None
            raise self._denied("create jobsets", error) from None

    def get(self, name: str) -> dict[str, Any]:
        return self._call(
            "get jobsets", self.custom.get_namespaced_custom_object,
            jobset.GROUP, jobset.VERSION, self.namespace, jobset.PLURAL, name,
        )  # fmt: skip

    def pods(self, name: str) -> list[Any]:
        selector = f"jobset.sigs.k8s.io/jobset-name={name}"
        found = self._call(
            "list pods", self.core.list_namespaced_pod, self.namespace, label_selector=selector
        )
        return list(found.items)

    def delete(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.custom.delete_namespaced_custom_object(
                jobset.GROUP, jobset.VERSION, self.namespace, jobset.PLURAL, name,
                propagation_policy="Background",
            )  # fmt: skip
        except ApiException as error:
            if error.status != 404:
                print(f"warning: could not delete JobSet {name}: {error.reason}", flush=True)

    def log_lines(self, pod: str) -> Iterable[str]:
        """Follow one host's log, line by line, until its container ends."""
        from kubernetes import watch

        return watch.Watch().stream(
            self.core.read_namespaced_pod_log, name=pod, namespace=self.namespace,
            container=jobset.CONTAINER, follow=True,
        )  # fmt: skip

    def _call(self, what: str, method: Callable, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            return method(*args, **kwargs)
        except ApiException as error:
            raise self._denied(what, error) from None

    def _denied(self, what: str, error: Any) -> ApiError:
        if error.status == 403:
            return ApiError(
                f"the task's service account may not {what} in namespace {self.namespace}: "
                f"apply the Role `alignpipe rbac --namespace {self.namespace} "
                "--service-account NAME` prints",
                403,
            )
        return ApiError(f"{what} failed: {error.status} {error.reason}: {error.body}", error.status)


def follow_host0(cluster: Cluster, name: str, stop: threading.Event) -> None:
    """Print host 0's log; after a restart, the new host 0's (runs in a daemon thread)."""
    followed: set[str] = set()
    while not stop.is_set():
        try:
            pods = [p for p in cluster.pods(name) if host_index(p) == 0]
        except ApiError:
            pods = []  # wait() reports what keeps failing
        fresh = [p for p in pods if p.metadata.uid not in followed and p.status.phase != "Pending"]
        if not fresh:
            stop.wait(POLL_S)
            continue
        pod = fresh[0]
        followed.add(pod.metadata.uid)
        print(f"--- host 0 log: {pod.metadata.name} ---", flush=True)
        try:
            for line in cluster.log_lines(pod.metadata.name):
                print(f"[host 0] {line}", flush=True)
                if stop.is_set():
                    return
        except Exception as error:  # a log stream cut short must not end the task
            print(f"(host 0 log ended: {error})", flush=True)


def wait(cluster: Cluster, name: str, image: str, poll_s: float = POLL_S) -> Verdict:
    """Poll the JobSet until it succeeds or fails, printing its state when it changes; a few
    failed polls in a row are waited out (an API server restart), a refusal is not."""
    last, failed_polls = "", 0
    while True:
        try:
            verdict = decide(cluster.get(name), cluster.pods(name), image)
            failed_polls = 0
        except ApiError as error:
            if error.status == 404:
                return Verdict("failed", f"JobSet {name} was deleted while the task waited")
            failed_polls += 1
            if error.status == 403 or failed_polls > MAX_FAILED_POLLS:
                raise
            print(f"(poll failed, retrying: {error})", flush=True)
            time.sleep(poll_s)
            continue
        if verdict.message != last:
            print(verdict.message, flush=True)
            last = verdict.message
        if verdict.done:
            return verdict
        time.sleep(poll_s)


def hand_back_output(executor_input: dict[str, Any]) -> None:
    """Copy host 0's executor output to the file KFP reads after this task."""
    from components.core import fileio

    remote = jobset.remote_executor_output(executor_input)
    if not fileio.exists(remote):
        raise RuntimeError(f"the hosts finished but host 0 wrote no executor output at {remote}")
    fileio.write_text(executor_input["outputs"]["outputFile"], fileio.read_text(remote))


def run(executor_input: dict[str, Any], spec: jobset.SliceSpec) -> int:
    """Create (or find) the task's JobSet, wait for it, hand back its output; 0 on success."""
    cluster = Cluster()
    own = cluster.own_pod()
    name = jobset.jobset_name(spec.stage, executor_input)
    owner = {"apiVersion": "v1", "kind": "Pod", "name": own.metadata.name, "uid": own.metadata.uid}
    body = jobset.manifest(
        spec, name=name, executor_input=executor_input,
        service_account=own.spec.service_account_name or "", owner=owner,
    )  # fmt: skip
    print(
        f"{spec.stage}: {spec.hosts} hosts of a {spec.accelerator} {spec.topology} slice as "
        f"JobSet {name} in namespace {cluster.namespace}",
        flush=True,
    )
    stop, created = threading.Event(), False
    signal.signal(signal.SIGTERM, _cancelled)
    try:
        cluster.create(body)
        created = True
        threading.Thread(target=follow_host0, args=(cluster, name, stop), daemon=True).start()
        verdict = wait(cluster, name, spec.image)
        if verdict.state != "succeeded":
            print(f"error: {verdict.message}", file=sys.stderr, flush=True)
            return 1
        hand_back_output(executor_input)
        return 0
    finally:  # done, failed or cancelled: the TPU hosts go
        stop.set()
        if created:
            cluster.delete(name)


def _cancelled(signum: int, frame: Any) -> None:
    """SIGTERM (the run was cancelled): leave through ``run``'s cleanup, which deletes the
    JobSet."""
    print("cancelled: deleting the JobSet", flush=True)
    sys.exit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.targets.gke.launcher")
    parser.add_argument("--executor-input", required=True, help="KFP's {{$}}")
    parser.add_argument("--slice", required=True, help="jobset.SliceSpec as JSON")
    args = parser.parse_args(argv)
    try:
        executor_input = read_executor_input(args.executor_input)
        spec = jobset.SliceSpec.from_json(args.slice)
        return run(executor_input, spec)
    except (ValueError, RuntimeError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
