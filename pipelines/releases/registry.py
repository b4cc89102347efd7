"""Vertex Model Registry: each promoted version also becomes a version of one registered model.

The pipeline's ``registry_model`` names the model: a display name (looked up in the task's
own project and region, which Vertex Pipelines sets as CLOUD_ML_PROJECT_ID and
CLOUD_ML_REGION) or a resource name ``projects/P/locations/L/models/ID``. The first upload
creates the model (with that ID, for a resource name); later ones add versions to it, each
the default version, aliased ``v<promoted version>``.

No serving container: alignpipe's policies are Orbax checkpoints with no prediction server.
``aiplatform.Model.upload`` refuses an ``artifact_uri`` without a serving container image
(google-cloud-aiplatform 2.x; googleapis/python-aiplatform#2034 asks to lift it, and the
workaround there is a dummy image), and a dummy image would be ingested by Vertex and make
the entry look deployable when a deployment could only fail. So each version is registered
as the SDK's container-less, referenced model: no ``artifact_uri``; the version's gs://
folder is in its description and the promotion history, its number in its alias and labels.

Credentials are the environment's (Application Default Credentials); none live in code.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

RESOURCE_NAME = re.compile(
    r"projects/(?P<project>[^/]+)/locations/(?P<location>[^/]+)/models/(?P<model_id>[^/@]+)"
)
# Model IDs a new model may take (UploadModelRequest.model_id).
MODEL_ID = re.compile(r"[a-z_][a-z0-9_-]{0,62}|[0-9]+")
LABEL_VALUE = re.compile(r"[^a-z0-9_-]")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelRef:
    """Where the registry model is: by display name in the default project and region, or
    by resource name (its project, region and ID)."""

    display_name: str
    project: str | None = None
    location: str | None = None
    model_id: str | None = None

    @property
    def filter(self) -> str:
        """The ListModels filter that finds this model."""
        if self.model_id:
            return f"model={json.dumps(self.model_id)}"
        return f"display_name={json.dumps(self.display_name)}"


def parse_model(registry_model: str) -> ModelRef:
    """The model ``registry_model`` names; ValueError when it looks like a resource name but
    is not one."""
    name = registry_model.strip()
    if not name:
        raise ValueError("registry_model is empty: pass a model display name or resource name")
    if not name.startswith("projects/"):
        return ModelRef(display_name=name)
    match = RESOURCE_NAME.fullmatch(name)
    if match is None:
        raise ValueError(
            f"registry_model: {name!r} is not a model resource name; use "
            "projects/PROJECT/locations/REGION/models/ID, or a display name"
        )
    if not MODEL_ID.fullmatch(match["model_id"]):
        raise ValueError(
            f"registry_model: model ID {match['model_id']!r} is not valid; a new model's ID "
            "is up to 63 of a-z, 0-9, _ and -, not starting with a digit or - (or an "
            "existing model's number)"
        )
    return ModelRef(display_name=match["model_id"], **match.groupdict())


def register_version(
    registry_model: str, version: int, folder: str, *, run_id: str = ""
) -> dict[str, Any]:
    """Upload promoted ``version`` (its gs:// ``folder``) as the new default version of
    ``registry_model``, creating the model on the first upload; returns the history's record:
    the model's resource name, the registry's version ID and the alias."""
    from google.cloud import aiplatform

    ref = parse_model(registry_model)
    existing = find_model(ref)
    alias = f"v{version}"
    uploaded = aiplatform.Model.upload(
        display_name=existing.display_name if existing else ref.display_name,
        parent_model=existing.resource_name if existing else None,
        model_id=None if existing else ref.model_id,
        is_default_version=True,
        version_aliases=[alias],
        version_description=f"alignpipe promoted version {version}: {folder}",
        description="alignpipe policy: each version is a promoted version (see its description)",
        labels=_labels(version, run_id),
        project=ref.project,
        location=ref.location,
        sync=True,
    )
    return {
        "model": uploaded.resource_name,
        "version_id": str(uploaded.version_id),
        "alias": alias,
        "created": existing is None,
    }


def find_model(ref: ModelRef) -> Any | None:
    """The registered model ``ref`` names, or None; ValueError when a display name is ambiguous."""
    from google.cloud import aiplatform

    found = aiplatform.Model.list(filter=ref.filter, project=ref.project, location=ref.location)
    if len(found) > 1:
        names = ", ".join(model.resource_name for model in found)
        raise ValueError(
            f"registry_model: {len(found)} models are named {ref.display_name!r} ({names}); "
            "pass the resource name of the one to add versions to"
        )
    return found[0] if found else None


def _labels(version: int, run_id: str) -> dict[str, str]:
    """Labels on the model version (values: up to 63 of a-z, 0-9, _ and -)."""
    labels = {"alignpipe-version": str(version)}
    run = LABEL_VALUE.sub("-", run_id.lower())[:63]
    if run:
        labels["alignpipe-run"] = run
    return labels
