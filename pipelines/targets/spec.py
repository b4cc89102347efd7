"""Compile the pipeline (or the smoke pipeline) for a target: the KFP spec, then each
target's rewriting of its training tasks (Vertex: TPU custom jobs, ``vertex/jobs.py``; GKE,
a slice of several hosts: a JobSet launched over the hosts, ``gke/jobset.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from pipelines import PIPELINE_NAME
from pipelines.dag import params
from pipelines.dag.pipeline import build_pipeline
from pipelines.targets.gke import jobset
from pipelines.targets.placement import Placement
from pipelines.targets.smoke import SMOKE_PIPELINE, build_smoke_pipeline
from pipelines.targets.vertex import jobs as vertex_jobs

# libyaml's safe parser and emitter where PyYAML has them (its wheels do): the same documents,
# no Python objects either way. A compiled spec is ~220 kB; reading and writing it took ~0.47 s
# in pure Python and was most of a compile's time (1.4 s, 2026-12-07).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def read_spec(package: str | Path) -> list[dict[str, Any]]:
    """The documents of a compiled spec: the pipeline spec, then any platform specs."""
    return list(yaml.load_all(Path(package).read_text(), Loader=_LOADER))


def write_spec(package: Path, documents: list[dict[str, Any]]) -> None:
    package.write_text(yaml.dump_all(documents, Dumper=_DUMPER, sort_keys=False))


def compile_pipeline(
    placement: Placement,
    values: dict[str, Any],
    package_path: str | Path,
    fresh_from: str | None = None,
    sources: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Check the parameters for ``placement``, then write the pipeline spec; returns them.

    The given values become the compiled pipeline's defaults; the spec's description carries
    the runs' record (``run_record.spec_record``: each value's source from ``sources``).
    """
    from kfp import compiler

    from pipelines import run_record

    checked = params.validate(values, placement.chips)
    pipeline = build_pipeline(placement, fresh_from)
    package = Path(package_path)
    package.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline, str(package), pipeline_parameters=values or None)
    spec, *platform = read_spec(package)
    if placement.target == "vertex" or placement.hosts > 1:
        rewrite_training(placement, spec)
    record = run_record.spec_record(values, sources or {k: "flag" for k in values})
    spec["pipelineInfo"]["description"] = run_record.SPEC_PREFIX + json.dumps(record)
    write_spec(package, [spec, *platform])
    return checked


def rewrite_training(
    placement: Placement, spec: dict[str, Any], pipeline_name: str = PIPELINE_NAME
) -> None:
    """Rewrite the compiled ``spec``'s training tasks in place: each a TPU custom job on Vertex
    (labelled with ``pipeline_name`` and the placement), or a JobSet over the hosts of a
    multi-host slice on GKE."""
    if placement.target == "vertex":
        labels = {key.replace("-", "_"): value for key, value in placement.describe().items()}
        labels = {"pipeline": pipeline_name, **labels}
        vertex_jobs.as_custom_jobs(
            spec, placement.machine, placement.topology, labels, placement.train_timeout_h
        )
    else:
        jobset.as_launchers(spec, placement)


def compile_smoke(placement: Placement, package_path: str | Path) -> None:
    """Write the smoke pipeline's spec, its task rewritten as the training tasks are: a TPU
    custom job on Vertex, the JobSet launcher of a multi-host slice on GKE."""
    from kfp import compiler

    package = Path(package_path)
    package.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build_smoke_pipeline(placement), str(package))
    if placement.target == "local" or (placement.target == "gke" and placement.hosts == 1):
        return
    spec, *platform = read_spec(package)
    rewrite_training(placement, spec, SMOKE_PIPELINE)
    write_spec(package, [spec, *platform])
