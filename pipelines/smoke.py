"""The smoke pipeline: one tiny task on the requested TPU, minutes before a real run.

``alignpipe smoke --target vertex|gke ...`` (``pipelines/cli_smoke.py``) compiles and
submits a one-task pipeline on the training image, placed exactly as the training tasks
are (``targets.place``): on Vertex a custom job whose worker pool names the TPU machine
type and ``tpu_topology`` (``vertex_jobs.as_custom_jobs``), on GKE the TPU node selectors,
toleration and ``google.com/tpu`` limit. The task (``pipelines/smoke_task.py``) prints the
devices JAX sees, checks their platform and number against the placement, and runs one
``jax.pmap`` step (a matmul on each device, ``psum`` over all of them). A green run shows
that the project, quota, image, permissions and placement work; a red one says which part
did not.
"""

# No `from __future__ import annotations`: kfp reads the component's real annotations.
from pathlib import Path
from typing import Any

import yaml
from kfp import dsl

from pipelines import vertex_jobs
from pipelines.targets import TPU_GENERATIONS, TRAIN, Placement, PlacementError, place

SMOKE_PIPELINE = "alignpipe-smoke"


def smoke_check(expected_platform: str, expected_devices: int) -> str:
    """The smoke task: check the devices JAX sees and run one pmap step; a JSON summary."""
    import json

    from pipelines.smoke_task import check_devices

    return json.dumps(check_devices(expected_platform, expected_devices), sort_keys=True)


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
        return task.output

    return smoke


def compile_smoke(placement: Placement, package_path: str | Path) -> None:
    """Write the smoke pipeline's spec; on Vertex its task becomes the TPU custom job."""
    from kfp import compiler

    one_host = TPU_GENERATIONS[placement.tpu].host_topologies.values()
    if placement.target == "gke" and placement.topology not in one_host:
        # A multi-host GKE slice needs the JobSet launcher the pipeline's compile step adds.
        raise PlacementError(
            f"--tpu-topology {placement.topology}: the smoke pipeline places one host's slice on "
            "gke; use a single-host topology (e.g. 2x2 or 2x4), or --target vertex"
        )
    package = Path(package_path)
    package.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_smoke_pipeline(placement), str(package))
    if placement.target == "vertex":
        spec = yaml.safe_load(package.read_text())
        placed = {key.replace("-", "_"): value for key, value in placement.describe().items()}
        labels = {"pipeline": SMOKE_PIPELINE, **placed}
        vertex_jobs.as_custom_jobs(spec, placement.machine, placement.topology, labels)
        package.write_text(yaml.safe_dump(spec, sort_keys=False))
