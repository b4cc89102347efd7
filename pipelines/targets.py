"""Where each task runs, per target: local (kfp.local), Vertex AI Pipelines, Kubeflow on GKE.

Tasks have one of three roles: ``train`` (sft, reward, ppo, dpo, evaluate: JAX on the
accelerator, retried on preemption, resuming from their checkpoints), ``data``
(built-in data, file listing, the Beam shard job: the data image, CPU) and ``light``
(plan, policy check, promotion: small CPU tasks).

- vertex: a training task becomes a Vertex custom job (``pipelines/vertex_jobs.py``)
  whose one worker pool names the TPU VM machine type and ``tpu_topology`` (v5e, 4
  chips: ``ct5lp-hightpu-4t``, 2x2), one replica per host. KFP's own resource spec has
  no machine type or topology. Other tasks get CPU and memory limits.
- gke: a training task gets the node selectors ``cloud.google.com/gke-tpu-accelerator``
  and ``cloud.google.com/gke-tpu-topology``, a ``google.com/tpu`` limit and a toleration
  of the TPU node pool's taint (kfp-kubernetes).

One KFP task is one pod or one VM here, so a slice must fit one host (v5e and v6e: up
to 8 chips; v5p: 4).

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

from pipelines.vertex_jobs import ROLE_ENV

TARGETS = ("local", "vertex", "gke")
TRAIN, DATA, LIGHT = "train", "data", "light"
# Not run by SubprocessRunner (it uses this Python); the name keys kfp.local's cache only.
LOCAL_IMAGE = "python:3.11"
TPU_RESOURCE = "google.com/tpu"


@dataclasses.dataclass(frozen=True, slots=True)
class TpuGeneration:
    """Names one TPU generation goes by on each target, and its single-host sizes."""

    gke_accelerator: str
    machine_type: str  # with {chips}: the TPU VM type on Vertex and on GKE node pools
    host_topologies: dict[int, str]  # chips on one host -> topology


TPU_GENERATIONS: dict[str, TpuGeneration] = {
    "v5e": TpuGeneration(
        gke_accelerator="tpu-v5-lite-podslice",
        machine_type="ct5lp-hightpu-{chips}t",
        host_topologies={1: "1x1", 4: "2x2", 8: "2x4"},
    ),
    "v5p": TpuGeneration(
        gke_accelerator="tpu-v5p-slice",
        machine_type="ct5p-hightpu-{chips}t",
        host_topologies={4: "2x2x1"},
    ),
    "v6e": TpuGeneration(
        gke_accelerator="tpu-v6e-slice",
        machine_type="ct6e-standard-{chips}t",
        host_topologies={1: "1x1", 4: "2x2", 8: "2x4"},
    ),
    "v4": TpuGeneration(
        gke_accelerator="tpu-v4-podslice",
        machine_type="ct4p-hightpu-{chips}t",
        host_topologies={4: "2x2x1"},
    ),
}
# Tags that name whatever was pushed last: a cache hit on them may be another build's result.
MUTABLE_TAGS = ("latest",)
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


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

    def _check_topology(self) -> None:
        """The topology must be one host's slice, and the machine type must match it."""
        generation = TPU_GENERATIONS[self.tpu]
        if not re.fullmatch(r"\d+(x\d+)+", self.topology):
            raise PlacementError(f"topology: {self.topology!r} is not like 2x2 or 2x2x1")
        if self.topology not in generation.host_topologies.values():
            sizes = ", ".join(f"{t} ({c} chips)" for c, t in generation.host_topologies.items())
            raise PlacementError(
                f"topology: {self.topology} is not a single-host {self.tpu} slice; one task "
                f"runs on one host, so use one of {sizes}"
            )
        if self.machine_type and self.machine_type != self.default_machine_type():
            raise PlacementError(
                f"machine_type: {self.machine_type} does not match {self.chips} {self.tpu} "
                f"chips (topology {self.topology}); use {self.default_machine_type()}"
            )

    @property
    def chips(self) -> int:
        """Accelerator chips (local: virtual CPU devices) of one training task."""
        if self.target == "local":
            return self.cpu_devices
        return math.prod(int(d) for d in self.topology.split("x"))

    @property
    def machine(self) -> str:
        """The TPU VM machine type of one training host (checked against the chips)."""
        return self.machine_type or self.default_machine_type()

    def default_machine_type(self) -> str:
        """The TPU VM machine type with this many chips of this generation."""
        return TPU_GENERATIONS[self.tpu].machine_type.format(chips=self.chips)

    def image_for(self, role: str) -> str:
        """The base image of a task of ``role``."""
        return self.data_image or self.image if role == DATA else self.image

    def warnings(self) -> list[str]:
        """What a user should hear before compiling: images bound by a tag, not a digest."""
        if self.target == "local":
            return []
        return [
            f"{flag} {image} is a tag, not a digest: Vertex and KFP cache tasks by the image "
            "reference, so pushing a new build under this tag reuses the old build's cached "
            "results. Pass IMAGE@sha256:... (`make push` writes it to build/images.env)"
            for flag, image in (("--image", self.image), ("--data-image", self.data_image))
            if image and not DIGEST.search(image)
        ]

    def describe(self) -> dict[str, Any]:
        """The placement as labels-friendly facts (recorded with submitted runs)."""
        if self.target == "local":
            return {"target": "local", "cpu-devices": str(self.cpu_devices)}
        return {
            "target": self.target,
            "tpu": self.tpu,
            "tpu-topology": self.topology,
            "tpu-chips": str(self.chips),
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
    generation = TPU_GENERATIONS[placement.tpu]
    if placement.target == "vertex":
        # The machine type and topology go into a custom job's worker pool after compiling
        # (vertex_jobs.as_custom_jobs); this marks the task for it.
        task.set_env_variable(ROLE_ENV, TRAIN)
    else:
        kubernetes.add_node_selector(
            task, "cloud.google.com/gke-tpu-accelerator", generation.gke_accelerator
        )
        kubernetes.add_node_selector(task, "cloud.google.com/gke-tpu-topology", placement.topology)
        # TPU node pools carry the google.com/tpu taint; only TPU tasks may land there.
        kubernetes.add_toleration(task, key=TPU_RESOURCE, operator="Exists", effect="NoSchedule")
        # The KFP driver turns the accelerator type into the resource name of the limit.
        task.set_accelerator_type(TPU_RESOURCE)
        task.set_accelerator_limit(placement.chips)
    # Preemption kills the pod or VM; the retried task resumes from its latest checkpoint.
    return task.set_retry(
        num_retries=placement.train_retries,
        backoff_duration=placement.retry_backoff,
        backoff_factor=2.0,
    )
