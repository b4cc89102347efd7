"""Vertex Model Registry uploads of promoted versions, against the SDK's own signatures and
request types (nothing reaches the cloud)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from unittest import mock

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud import aiplatform
from google.cloud.aiplatform import initializer
from google.cloud.aiplatform_v1.types import model as gca_model
from google.cloud.aiplatform_v1.types import model_service

from pipelines.cli import releases as cli_releases
from pipelines.dag import params
from pipelines.releases import policies, promotion
from pipelines.releases import registry as model_registry

RESOURCE = "projects/p/locations/europe-west4/models/alignpipe-policy"


def _policy(folder: Path) -> str:
    (folder / "params").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"step": 1}))
    return str(folder)


def _registered(name: str, version_id: str, display_name: str = "alignpipe-policy"):
    """An aiplatform.Model as the SDK returns it (autospecced: unknown attributes fail)."""
    model = mock.create_autospec(aiplatform.Model, instance=True)
    model.resource_name, model.version_id, model.display_name = name, version_id, display_name
    return model


@pytest.fixture
def registry():
    """aiplatform.Model.list and .upload patched with their real signatures."""
    with (
        mock.patch.object(aiplatform.Model, "list", autospec=True) as listed,
        mock.patch.object(aiplatform.Model, "upload", autospec=True) as uploaded,
    ):
        yield listed, uploaded


def test_first_upload_creates_the_model_the_second_adds_a_version(tmp_path, registry) -> None:
    listed, uploaded = registry
    root = str(tmp_path / "promoted")
    created = _registered("projects/p/locations/us-central1/models/123", "1")
    listed.return_value, uploaded.return_value = [], created
    register = functools.partial(model_registry.register_version, "alignpipe-policy", run_id="R1")

    first = promotion.promote(root, _policy(tmp_path / "a"), {"run_id": "R1"}, register)
    kwargs = uploaded.call_args.kwargs
    assert listed.call_args.kwargs["filter"] == 'display_name="alignpipe-policy"'
    assert kwargs["parent_model"] is None and kwargs["display_name"] == "alignpipe-policy"
    assert kwargs["version_aliases"] == ["v1"] and kwargs["is_default_version"] is True
    assert promotion.version_folder(root, first) in kwargs["version_description"]
    assert kwargs["labels"] == {"alignpipe-version": "1", "alignpipe-run": "r1"}
    assert "artifact_uri" not in kwargs and "serving_container_image_uri" not in kwargs

    listed.return_value, uploaded.return_value = [created], _registered(created.resource_name, "2")
    second = promotion.promote(root, _policy(tmp_path / "b"), {"run_id": "R2"}, register)
    kwargs = uploaded.call_args.kwargs
    assert kwargs["parent_model"] == created.resource_name and kwargs["model_id"] is None
    assert kwargs["version_aliases"] == [f"v{second}"]

    events = promotion.read_history(root)
    assert [e["registry"] for e in events] == [
        {"model": created.resource_name, "version_id": "1", "alias": "v1", "created": True},
        {"model": created.resource_name, "version_id": "2", "alias": "v2", "created": False},
    ]
    table = cli_releases.format_history(events, promotion.current_version(root))
    assert table.splitlines()[0].split()[-2:] == ["registry", "note"]


def test_a_resource_name_sets_project_region_and_the_new_models_id(registry) -> None:
    listed, uploaded = registry
    listed.return_value, uploaded.return_value = [], _registered(RESOURCE, "1")
    record = model_registry.register_version(RESOURCE, 1, "gs://b/promoted/versions/000001")
    assert listed.call_args.kwargs == {
        "filter": 'model="alignpipe-policy"',
        "project": "p",
        "location": "europe-west4",
    }
    kwargs = uploaded.call_args.kwargs
    assert (kwargs["project"], kwargs["location"]) == ("p", "europe-west4")
    assert kwargs["model_id"] == "alignpipe-policy" and record["model"] == RESOURCE


def test_two_models_of_one_display_name_are_refused(registry) -> None:
    listed, uploaded = registry
    listed.return_value = [_registered(f"projects/p/locations/l/models/{n}", "1") for n in (1, 2)]
    with pytest.raises(ValueError, match="pass the resource name"):
        model_registry.register_version("alignpipe-policy", 3, "gs://b/r/versions/000003")
    uploaded.assert_not_called()


def test_a_failed_upload_leaves_the_version_incomplete_and_current_unchanged(
    tmp_path, registry
) -> None:
    listed, uploaded = registry
    root = str(tmp_path / "promoted")
    promotion.promote(root, _policy(tmp_path / "a"))
    listed.return_value, uploaded.side_effect = [], RuntimeError("PERMISSION_DENIED")
    register = functools.partial(model_registry.register_version, "alignpipe-policy")
    with pytest.raises(RuntimeError):
        policies.promote(_policy(tmp_path / "b"), str(tmp_path / "artifact"), root,
                         register=register)  # fmt: skip
    assert promotion.current_version(root) == 1 and promotion.complete_versions(root) == [1]


def test_the_real_upload_request_of_a_new_version(monkeypatch) -> None:
    """Model.upload itself runs: our arguments make a valid UploadModelRequest with no
    container and no artifact (the SDK's referenced model), parented on the model."""
    monkeypatch.setattr(initializer.global_config, "_credentials", AnonymousCredentials())
    existing = _registered(RESOURCE, "1")
    client = mock.Mock()
    response = model_service.UploadModelResponse(model=RESOURCE, model_version_id="2")
    client.upload_model.return_value.result.return_value = response

    def get(self, resource_name, parent_resource_name_fields=None):
        return gca_model.Model(name=resource_name, display_name="alignpipe-policy", version_id="2")

    with (
        mock.patch.object(aiplatform.Model, "list", autospec=True, return_value=[existing]),
        mock.patch.object(aiplatform.Model, "_instantiate_client", return_value=client),
        mock.patch.object(aiplatform.Model, "_get_gca_resource", autospec=True, side_effect=get),
    ):
        record = model_registry.register_version(RESOURCE, 2, "gs://b/r/versions/000002")

    request = client.upload_model.call_args.kwargs["request"]
    assert isinstance(request, model_service.UploadModelRequest)
    assert request.parent == "projects/p/locations/europe-west4"
    assert request.parent_model == RESOURCE and not request.model_id
    assert sorted(request.model.version_aliases) == ["default", "v2"]
    assert request.model.version_description.endswith("gs://b/r/versions/000002")
    assert not request.model.artifact_uri and "container_spec" not in request.model
    assert record == {"model": RESOURCE, "version_id": "2", "alias": "v2", "created": False}


@pytest.mark.parametrize("root", ["", "/tmp/promoted", "promoted"])
def test_validate_refuses_a_registry_without_gcs_versions(root: str) -> None:
    values = {"registry_model": "alignpipe-policy", "promoted_policy_uri": root}
    with pytest.raises(params.ParamError, match="registry_model.*gs://"):
        params.validate(values, chips=8)


def test_validate_checks_resource_names() -> None:
    gcs = {"promoted_policy_uri": "gs://b/promoted"}
    assert params.validate({**gcs, "registry_model": RESOURCE}, chips=8)["registry_model"]
    with pytest.raises(params.ParamError, match="not a model resource name"):
        params.validate({**gcs, "registry_model": "projects/p/models/x"}, chips=8)
    with pytest.raises(params.ParamError, match="model ID"):
        params.validate({**gcs, "registry_model": RESOURCE.replace("alignpipe", "-x")}, chips=8)
