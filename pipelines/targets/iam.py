"""What each account of a cloud run needs, as a checklist for the accounts a run will use.

``alignpipe smoke`` prints it before it submits (or compiles): the smoke run then shows
whether the grants work, in minutes. The reasons and sources are in docs/cloud-iam.md.
Nothing here calls Google Cloud: it names the accounts and buckets the flags give.
"""

from __future__ import annotations

from pipelines.targets.cloud import CloudSettings
from pipelines.targets.placement import Placement

DEFAULT_VERTEX_ACCOUNT = "the Compute Engine default service account (no --service-account)"
# What a Kubeflow profile namespace's pipeline pods run as; standalone KFP: pipeline-runner.
DEFAULT_GKE_ACCOUNT = "default-editor"
WORKLOAD_POOL = (
    "principal://iam.googleapis.com/projects/PROJECT_NUMBER/locations/global/"
    "workloadIdentityPools/PROJECT_ID.svc.id.goog/subject/ns/{namespace}/sa/{account}"
)


def bucket_of(uri: str) -> str:
    """``gs://BUCKET`` of a gs:// URI ('gs://BUCKET' as a placeholder otherwise)."""
    if uri.startswith("gs://") and uri.removeprefix("gs://").split("/")[0]:
        return "gs://" + uri.removeprefix("gs://").split("/")[0]
    return "gs://BUCKET"


def vertex_checklist(settings: CloudSettings) -> list[str]:
    """The grants a Vertex run needs: the submitter's, the run account's, the image pull."""
    account = settings.service_account or DEFAULT_VERTEX_ACCOUNT
    project = settings.project or "PROJECT"
    bucket = bucket_of(settings.pipeline_root)
    return [
        f"you: roles/aiplatform.user on {project}, and roles/iam.serviceAccountUser on "
        f"{account} (a PipelineJob that runs as an account needs actAs on it)",
        f"{account}: roles/aiplatform.user on {project} (GCPC's launcher task creates, "
        "polls and cancels each training task's CustomJob as the run's account)",
        f"{account}: roles/iam.serviceAccountUser on itself (the CustomJob runs as the same "
        "account, and CustomJobSpec.service_account needs actAs from the job's creator)",
        f"{account}: roles/storage.objectUser on {bucket} (artifacts through /gcs, "
        "checkpoints through gs://: read, write, delete) and roles/storage.objectViewer "
        "on the data and model buckets it only reads",
        f"Vertex AI's service agents: roles/artifactregistry.reader on the images' "
        f"repository when it is outside {project} (Vertex pulls custom job images with "
        "them, never with the run's account)",
    ]


def gke_checklist(settings: CloudSettings, placement: Placement) -> list[str]:
    """The grants a GKE run needs: Workload Identity for its pods, the JobSet Role."""
    namespace = settings.namespace or "NAMESPACE"
    account = settings.service_account or DEFAULT_GKE_ACCOUNT
    member = WORKLOAD_POOL.format(namespace=namespace, account=account)
    bucket = bucket_of(settings.pipeline_root)
    found = [
        "cluster: Workload Identity Federation on the cluster and on every node pool "
        "(TPU pools too), the Cloud Storage FUSE CSI driver add-on, uniform bucket-level "
        f"access on {bucket}",
        f"{namespace}/{account} (the run's pods): roles/storage.objectUser on {bucket} "
        f"for {member} (KFP's launcher moves the artifacts, the stages write checkpoints "
        "to gs:// as it)",
        "TPU node pools' node service account: roles/artifactregistry.reader on the "
        "images' repository (the kubelet pulls them)",
    ]
    if placement.hosts > 1:
        found += [
            f"{namespace}/{account}: the Role `alignpipe rbac --namespace {namespace} "
            f"--service-account {account}` prints (the launcher creates and watches JobSets)",
            f"the TPU hosts run as {namespace}/{account} too: their /gcs FUSE mounts use "
            "the same Workload Identity grant",
        ]
    return found


def checklist(target: str, settings: CloudSettings, placement: Placement) -> list[str]:
    """Each grant the run on ``target`` needs, one line each (docs/cloud-iam.md: why)."""
    if target == "vertex":
        return vertex_checklist(settings)
    return gke_checklist(settings, placement)
