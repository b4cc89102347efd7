"""Where each task runs, per target: local (kfp.local), Vertex AI Pipelines, Kubeflow on GKE.

Tasks have one of three roles: ``train`` (sft, reward, ppo, dpo, evaluate: JAX on the
accelerator, retried on preemption, resuming from their checkpoints), ``data``
(built-in data, file listing, the Beam shard job: the data image, CPU) and ``light``
(plan, policy check, promotion: small CPU tasks).

- vertex: a training task becomes a Vertex custom job (``pipelines/targets/vertex/jobs.py``)
  whose one worker pool names the TPU VM machine type of each host and the slice's
  ``tpu_topology`` (v5e, 4 chips: ``ct5lp-hightpu-4t``, 2x2). Vertex's TPU pools have one
  replica: a multi-host topology (v5e 4x4: four ``ct5lp-hightpu-4t`` VMs) is one replica
  that Vertex runs on every VM of the slice. KFP's own resource spec has no machine type
  or topology. Other tasks get CPU and memory limits.
- gke, one host: a training task gets the node selectors
  ``cloud.google.com/gke-tpu-accelerator`` and ``cloud.google.com/gke-tpu-topology``, a
  ``google.com/tpu`` limit and a toleration of the TPU node pool's taint (kfp-kubernetes).
- gke, several hosts: the training task is a small CPU pod that launches the stage on
  every host of the slice as a JobSet and waits for it (``pipelines/targets/gke/jobset.py``). KFP's
  launcher still downloads every input artifact of that pod into its ``/gcs`` scratch
  (an emptyDir on the node's boot disk; ``backend/src/v2/component/launcher_v2.go``,
  ``downloadArtifacts``) before the JobSet starts, though only the hosts read them: a 7B
  model is 27 GB of float32. KFP can request neither ephemeral storage nor an fsGroup for a
  disk of its own, so ``launcher_node_pool`` pins these pods to a CPU node pool whose boot
  disks hold the inputs; without it ``warnings`` says so.

Multi-host slices are made of 4-chip hosts (v5e/v6e 4x4 and larger, v5p/v4 2x2x2 and
larger); each training task is told the host count in ``ALIGNPIPE_TPU_HOSTS``.

Images are bound by immutable reference: the cache key of a task holds its image
reference, not the image, so a rebuilt tag would hand back results of the old code.
``latest`` and untagged references are refused; other tags are accepted with a warning;
digests (``@sha256:``) are accepted silently.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from kfp import kubernetes

from pipelines.targets.vertex.jobs import ROLE_ENV

TARGETS = ("local", "vertex", "gke")
TRAIN, DATA, LIGHT = "train", "data", "light"
# Not run by SubprocessRunner (it uses this Python); the name keys kfp.local's cache only.
LOCAL_IMAGE = "python:3.11"
TPU_RESOURCE = "google.com/tpu"
# The number of TPU hosts a training task's slice has, set on its container.
HOSTS_ENV = "ALIGNPIPE_TPU_HOSTS"
CHIPS_PER_MULTI_HOST = 4  # every multi-host slice is made of 4-chip VMs (the "-4t" types)
NODE_POOL_LABEL = "cloud.google.com/gke-nodepool"  # GKE's label of each node's pool


@dataclasses.dataclass(frozen=True, slots=True)
class TpuGeneration:
    """Names one TPU generation goes by on each target, and its slice sizes."""

    gke_accelerator: str
    machine_type: str  # with {chips}: the TPU VM type on Vertex and on GKE node pools
    host_topologies: dict[int, str]  # chips on one host -> topology
    multi_host: dict[str, int]  # topology of a multi-host slice -> its 4-chip hosts


# Multi-host slices of 4-chip VMs, topology -> hosts (v5e/v6e: the Vertex and GKE tables).
_PLANAR = {"4x4": 4, "4x8": 8, "8x8": 16, "8x16": 32, "16x16": 64}
_CUBIC = {"2x2x2": 2, "2x2x4": 4, "2x4x4": 8, "4x4x4": 16, "4x4x8": 32, "4x8x8": 64}

TPU_GENERATIONS: dict[str, TpuGeneration] = {
    "v5e": TpuGeneration(
        gke_accelerator="tpu-v5-lite-podslice",
        machine_type="ct5lp-hightpu-{chips}t",
        host_topologies={1: "1x1", 4: "2x2", 8: "2x4"},
        multi_host=_PLANAR,
    ),
    "v5p": TpuGeneration(
        gke_accelerator="tpu-v5p-slice",
        machine_type="ct5p-hightpu-{chips}t",
        host_topologies={4: "2x2x1"},
        multi_host=_CUBIC,
    ),
    "v6e": TpuGeneration(
        gke_accelerator="tpu-v6e-slice",
        machine_type="ct6e-standard-{chips}t",
        host_topologies={1: "1x1", 4: "2x2", 8: "2x4"},
        multi_host=_PLANAR,
    ),
    "v4": TpuGeneration(
        gke_accelerator="tpu-v4-podslice",
        machine_type="ct4p-hightpu-{chips}t",
        host_topologies={4: "2x2x1"},
        multi_host=_CUBIC,
    ),
}
# Vertex custom training documents these TPU generations (configure-compute, "TPUs"):
# v2/v3, v5e, v6e and TPU7x. v5p and v4 machine types are not among them.
VERTEX_TPUS = ("v5e", "v6e")
# Tags that name whatever was pushed last: a cache hit on them may be another build's result.
MUTABLE_TAGS = ("latest",)
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def slice_topology(tpu: str, chips: int) -> str:
    """The topology of a ``chips``-chip slice of ``tpu``: one host's if one holds them, else
    the multi-host slice of that size; '' when this pipeline places no such slice."""
    generation = TPU_GENERATIONS.get(tpu)
    if generation is None:
        return ""
    if chips in generation.host_topologies:
        return generation.host_topologies[chips]
    sizes = {t: CHIPS_PER_MULTI_HOST * hosts for t, hosts in generation.multi_host.items()}
    return next((t for t, size in sizes.items() if size == chips), "")


class PlacementError(ValueError):
    """A placement that cannot be scheduled; the message names the option and the fix."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """How the tasks of one compiled pipeline are placed."""

    target: str = "local"
    image: str = LOCAL_IMAGE  # training image (JAX for TPU)
    data_image: str = ""  # Beam image for the data tasks; '' = the training image
    tpu: str = "v5e"
    topology: str = "2x2"
    machine_type: str = ""  # vertex: '' = the generation's machine type for the chip count
    cpu_limit: str = "4"
    memory_limit: str = "16G"
    train_retries: int = 3
    retry_backoff: str = "60s"
    cpu_devices: int = 8  # local: virtual CPU devices per training task
    # vertex: each training job's timeout in hours; 0 = the stage's (vertex_jobs.STAGE_TIMEOUT_H)
    train_timeout_h: float = 0.0
    # gke, several hosts: the CPU node pool of the JobSet launcher pods, which download every
    # input artifact onto their node's boot disk; '' = wherever KFP's CPU pods go
    launcher_node_pool: str = ""

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise PlacementError(f"target: {self.target!r} is unknown; use one of {TARGETS}")
        if self.target == "local":
            return
        if not self.image or self.image == LOCAL_IMAGE:
            raise PlacementError(
                f"image: the {self.target} target needs the training image URI "
                "(e.g. --image REGION-docker.pkg.dev/PROJECT/alignpipe/train:TAG; "
                "`make images push` builds and pushes it)"
            )
        if self.tpu not in TPU_GENERATIONS:
            known = list(TPU_GENERATIONS)
            raise PlacementError(f"tpu: {self.tpu!r} is unknown; use one of {known}")
        for flag, image in (("--image", self.image), ("--data-image", self.data_image)):
            if image:
                _check_image(flag, image)
        self._check_topology()
        if self.train_retries < 0:
            raise PlacementError(f"train_retries: {self.train_retries} must be >= 0")
        if not math.isfinite(self.train_timeout_h) or self.train_timeout_h < 0:
            raise PlacementError(
                f"train_timeout: {self.train_timeout_h} hours must be a finite number >= 0 "
                "(0: each stage's own bound)"
            )

    def _check_topology(self) -> None:
        """The topology must be a slice of this TPU, and the machine type must match a host."""
        generation = TPU_GENERATIONS[self.tpu]
        if not re.fullmatch(r"\d+(x\d+)+", self.topology):
            raise PlacementError(f"topology: {self.topology!r} is not like 2x2 or 2x2x1")
        single = generation.host_topologies.values()
        if self.topology not in single and self.topology not in generation.multi_host:
            one = ", ".join(f"{t} ({c} chips)" for c, t in generation.host_topologies.items())
            several = ", ".join(
                f"{t} ({h} hosts)" for t, h in list(generation.multi_host.items())[:3]
            )
            raise PlacementError(
                f"topology: {self.topology} is not a single-host {self.tpu} slice ({one}) nor "
                f"a multi-host one of 4-chip hosts ({several}, ...); use one of those"
            )
        if self.machine_type and self.machine_type != self.default_machine_type():
            raise PlacementError(
                f"machine_type: {self.machine_type} does not match a host of {self.chips_per_host} "
                f"{self.tpu} chips (topology {self.topology}); use {self.default_machine_type()}"
            )

    @property
    def chips(self) -> int:
        """Accelerator chips (local: virtual CPU devices) of one training task, all hosts."""
        if self.target == "local":
            return self.cpu_devices
        return math.prod(int(d) for d in self.topology.split("x"))

    @property
    def hosts(self) -> int:
        """TPU VMs of one training task's slice (local: 1)."""
        if self.target == "local":
            return 1
        return TPU_GENERATIONS[self.tpu].multi_host.get(self.topology, 1)

    @property
    def chips_per_host(self) -> int:
        """Chips of each TPU VM of the slice."""
        return self.chips // self.hosts

    @property
    def machine(self) -> str:
        """The TPU VM machine type of one training host (checked against the chips)."""
        return self.machine_type or self.default_machine_type()

    def default_machine_type(self) -> str:
        """The TPU VM machine type of one host of this slice."""
        return TPU_GENERATIONS[self.tpu].machine_type.format(chips=self.chips_per_host)

    def image_for(self, role: str) -> str:
        """The base image of a task of ``role``."""
        return self.data_image or self.image if role == DATA else self.image

    def warnings(self) -> list[str]:
        """What a user should hear before compiling: images bound by a tag, not a digest;
        a TPU Vertex's training documentation does not list."""
        if self.target == "local":
            return []
        found = [
            f"{flag} {image} is a tag, not a digest: Vertex and KFP cache tasks by the image "
            "reference, so pushing a new build under this tag reuses the old build's cached "
            "results. Pass IMAGE@sha256:... (`make push` writes it to build/images.env)"
            for flag, image in (("--image", self.image), ("--data-image", self.data_image))
            if image and not DIGEST.search(image)
        ]
        if self.target == "gke" and self.hosts > 1 and not self.launcher_node_pool:
            found.append(
                f"{self.topology} spans {self.hosts} hosts: each training task's launcher pod "
                "(CPU) first downloads all of the task's input artifacts to its node's boot "
                "disk (KFP's launcher does, though only the TPU hosts read them; a 7B model "
                "is 27 GB, evaluate reads up to four): pass --launcher-node-pool NAME, a CPU "
                "node pool whose boot disks hold them (e.g. 500 GB for 7B models)"
            )
        if self.target == "vertex" and self.tpu not in VERTEX_TPUS:
            found.append(
                f"--tpu {self.tpu}: Vertex custom training documents TPU machine types of "
                f"{', '.join(VERTEX_TPUS)} (and v2/v3, TPU7x), not {self.machine}; Vertex may "
                f"refuse the training jobs. Run {self.tpu} slices with --target gke, or use a "
                "v5e/v6e slice on Vertex"
            )
        return found

    def describe(self) -> dict[str, Any]:
        """The placement as labels-friendly facts (recorded with submitted runs)."""
        if self.target == "local":
            return {"target": "local", "cpu-devices": str(self.cpu_devices)}
        return {
            "target": self.target,
            "tpu": self.tpu,
            "tpu-topology": self.topology,
            "tpu-chips": str(self.chips),
            "tpu-hosts": str(self.hosts),
            "machine-type": self.machine,
        }


def _check_image(flag: str, image: str) -> None:
    """Refuse an image reference that names whatever was pushed last."""
    if DIGEST.search(image):
        return
    name = image.rsplit("/", 1)[-1]
    tag = name.partition(":")[2]
    if not tag or tag in MUTABLE_TAGS:
        raise PlacementError(
            f"{flag} {image}: {'no tag means latest' if not tag else f'tag {tag!r} moves'}, "
            "and a cached task keys on the reference, not the image: a rebuild would reuse "
            "stale results. Pass the pushed digest (IMAGE@sha256:..., `make push` writes it "
            "to build/images.env) or a commit tag (`make images` tags by git commit)"
        )


def place(task: Any, role: str, placement: Placement) -> Any:
    """Apply ``placement`` to a pipeline task of ``role``; returns the task."""
    if placement.target == "local":
        return task
    if role != TRAIN:
        return task.set_cpu_limit(placement.cpu_limit).set_memory_limit(placement.memory_limit)
    task.set_env_variable(HOSTS_ENV, str(placement.hosts))
    if placement.target == "vertex" or placement.hosts > 1:
        # Rewritten after compiling: into a Vertex custom job whose worker pool names the
        # machine type and topology (vertex_jobs.as_custom_jobs), or into a CPU task that
        # runs the stage on every host of a GKE slice as a JobSet (jobset.as_launchers).
        task.set_env_variable(ROLE_ENV, TRAIN)
    if placement.target == "gke" and placement.hosts > 1:
        task.set_cpu_limit(placement.cpu_limit).set_memory_limit(placement.memory_limit)
        if placement.launcher_node_pool:  # boot disks that hold the downloaded inputs
            kubernetes.add_node_selector(task, NODE_POOL_LABEL, placement.launcher_node_pool)
    elif placement.target == "gke":
        _on_tpu_node_pool(task, placement)
    # Preemption kills the pod or VM; the retried task resumes from its latest checkpoint.
    return task.set_retry(
        num_retries=placement.train_retries,
        backoff_duration=placement.retry_backoff,
        backoff_factor=2.0,
    )


def _on_tpu_node_pool(task: Any, placement: Placement) -> None:
    """Node selectors, toleration and chip limit of a task on a single-host GKE TPU slice."""
    generation = TPU_GENERATIONS[placement.tpu]
    kubernetes.add_node_selector(
        task, "cloud.google.com/gke-tpu-accelerator", generation.gke_accelerator
    )
    kubernetes.add_node_selector(task, "cloud.google.com/gke-tpu-topology", placement.topology)
    # TPU node pools carry the google.com/tpu taint; only TPU tasks may land there.
    kubernetes.add_toleration(task, key=TPU_RESOURCE, operator="Exists", effect="NoSchedule")
    # The KFP driver turns the accelerator type into the resource name of the limit.
    task.set_accelerator_type(TPU_RESOURCE)
    task.set_accelerator_limit(placement.chips)
