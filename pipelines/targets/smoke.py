"""The smoke pipeline: one tiny task on the requested TPU, minutes before a real run.

``alignpipe smoke --target vertex|gke ...`` (``pipelines/cli/cloud.py``) compiles
(``spec.compile_smoke``) and submits a one-task pipeline on the training image, placed
exactly as the training tasks are (``placement.place``): on Vertex a custom job whose worker
pool names the TPU machine type and ``tpu_topology`` (``vertex/jobs.as_custom_jobs``), on GKE
the TPU node selectors, toleration and ``google.com/tpu`` limit, or for a multi-host slice
the JobSet launcher that runs the task on every host (``gke/jobset.as_launchers``). The task
(``smoke_task.py``) prints the devices JAX sees, checks their platform and number
against the placement, and runs one ``jax.pmap`` step (a matmul on each device, ``psum``
over all of them). A green run shows that the project, quota, image, permissions and
placement work; a red one says which part did not.
"""

# No `from __future__ import annotations`: kfp reads the component's real annotations.
from typing import Any

from kfp import dsl
from kfp.dsl import Artifact, Output

from pipelines.targets.placement import TRAIN, Placement, place

SMOKE_PIPELINE = "alignpipe-smoke"


def smoke_check(expected_platform: str, expected_devices: int, summary: Output[Artifact]) -> str:
    """The smoke task: check the devices JAX sees and run one pmap step; a JSON summary.

    The summary is also an artifact: a multi-host GKE slice's JobSet launcher keys the
    JobSet by the task's output artifact and writes the hosts' result next to it.
    """
    import json

    from pipelines.targets.smoke_task import check_devices

    result = json.dumps(check_devices(expected_platform, expected_devices), sort_keys=True)
    if json.loads(result)["process"] == 0:  # one writer on a multi-host slice
        with open(summary.path, "w") as handle:
            handle.write(result)
    return result


def build_smoke_pipeline(placement: Placement, expected_platform: str = "") -> Any:
    """The one-task pipeline, placed like a training task (never cached: it checks now);
    its output is the task's JSON summary.

    ``expected_platform`` '' means tpu on the cloud targets and cpu locally.
    """
    platform = expected_platform or ("cpu" if placement.target == "local" else "tpu")
    component = dsl.component(smoke_check, base_image=placement.image, install_kfp_package=False)

    @dsl.pipeline(
        name=SMOKE_PIPELINE,
        description="Print the devices JAX sees on the requested TPU and run one pmap step.",
    )
    def smoke() -> str:
        task = component(expected_platform=platform, expected_devices=placement.chips)
        task.set_caching_options(False)
        place(task, TRAIN, placement)
        return task.outputs["Output"]

    return smoke
