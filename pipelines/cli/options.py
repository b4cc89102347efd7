"""What several commands share: their flags (pipeline parameters, placement, cloud), the
values and settings read back from them, and one error guard.

Every pipeline parameter is a flag (``--sft-steps 100``); its default and help come from the
stage configs (``pipelines/dag/param_table.py``).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from pipelines.dag import config_file, fit, param_table, params
from pipelines.dag.run_presets import RUN_PRESETS
from pipelines.dag.stages import STAGES
from pipelines.targets.placement import TPU_GENERATIONS, Placement, slice_topology

EXIT_USAGE = 2
# What `make images` tags without a registry; a cloud run needs the pushed URI (--image).
DEFAULT_IMAGE = "alignpipe/train:0.1.0"


def add_param_flags(parser: argparse.ArgumentParser, note: str = "") -> None:
    """One ``--flag`` per pipeline parameter (unset keeps the default)."""
    group = parser.add_argument_group("pipeline parameters" + (f" (each {note})" if note else ""))
    group.add_argument(
        "--config", default=None, metavar="FILE",
        help="a YAML file of pipeline parameters nested by stage (`alignpipe config dump` "
        "writes one with every default); flags given beside it override it",
    )  # fmt: skip
    for p in param_table.PARAMS:
        # A bool flag alone means true (--fsdp), as the stage commands' flags do.
        boolean = {"nargs": "?", "const": "true"} if p.type() is bool else {}
        group.add_argument(
            "--" + p.name.replace("_", "-"),
            dest="param_" + p.name,
            default=argparse.SUPPRESS,
            metavar=p.type().__name__.upper(),
            help=f"{p.help_text()} (default: {p.default_value()!r})".replace("%", "%%"),
            **boolean,
        )


def add_local_options(parser: argparse.ArgumentParser) -> None:
    """Where local runs go and how many virtual devices they get."""
    parser.add_argument("--runs-dir", default="runs", help="pipeline root of local runs (runs)")
    parser.add_argument(
        "--cpu-devices", type=int, default=None,
        help="virtual CPU devices per training task (default: $ALIGNPIPE_CPU_DEVICES or 8)",
    )  # fmt: skip
    parser.add_argument(
        "--verbose", action="store_true",
        help="the run's log keeps the libraries' INFO lines too (Orbax's per-checkpoint lines)",
    )  # fmt: skip


def add_placement_options(parser: argparse.ArgumentParser) -> None:
    """Images, TPU and resources of a cloud target."""
    group = parser.add_argument_group("placement")
    group.add_argument("--target", required=True, choices=("vertex", "gke"), help="where it runs")
    group.add_argument(
        "--image", default=None, help=f"training image URI, JAX for TPU (default: {DEFAULT_IMAGE})"
    )
    group.add_argument(
        "--run-preset",
        choices=sorted(RUN_PRESETS),
        default=None,
        help="a model class on a TPU slice (alignpipe run-presets): sets the TPU, the topology "
        "and the batch, length, remat, dtype and fsdp parameters; flags given override it",
    )
    group.add_argument(
        "--tpu",
        default=None,
        choices=list(TPU_GENERATIONS),
        help="TPU (default: the run preset's, else v5e)",
    )
    group.add_argument(
        "--tpu-topology",
        default=None,
        help="the TPU slice of one training task: one host's (1x1, 2x2, 2x4; v5p 2x2x1) or "
        "several 4-chip hosts' (v5e/v6e 4x4, 4x8, ...; v5p 2x2x2, 2x2x4, ...: a JobSet on gke) "
        "(default: the run preset's, else 2x2)",
    )
    group.add_argument(
        "--machine-type", default="",
        help="vertex: the TPU VM type of each host of a training task's custom job; must match "
        "the chips per host (default: the TPU's type for the topology, e.g. ct5lp-hightpu-4t for "
        "v5e 2x2 and 4x4, ct5p-hightpu-4t for v5p 2x2x1 and 2x2x4, ct6e-standard-8t for v6e 2x4)",
    )  # fmt: skip
    group.add_argument("--cpu-limit", default="4", help="CPU of non-training tasks (4)")
    group.add_argument("--memory-limit", default="16G", help="memory of non-training tasks")
    group.add_argument(
        "--train-retries", type=int, default=3, help="retries of a preempted training task (3)"
    )
    group.add_argument(
        "--train-timeout", type=float, default=0.0, metavar="HOURS",
        help="vertex: end a training task's custom job after HOURS (a retry resumes it from "
        "its checkpoint); default: per stage, sft/reward/dpo 24, ppo 48, evaluate 12",
    )  # fmt: skip
    group.add_argument(
        "--launcher-node-pool", default="", metavar="NAME",
        help="gke, multi-host slices: the CPU node pool of the pods that launch the JobSets; "
        "KFP downloads each task's input artifacts onto their boot disks",
    )  # fmt: skip


def add_dag_options(parser: argparse.ArgumentParser) -> None:
    """What only the whole pipeline reads: the data tasks' image, and caching from a stage."""
    group = parser.add_argument_group("pipeline")
    group.add_argument("--data-image", default="", help="Beam image URI of the data tasks")
    group.add_argument(
        "--fresh-from", choices=STAGES, default=None, help="no caching from this stage on"
    )


def add_cloud_options(parser: argparse.ArgumentParser) -> None:
    """Project, region, pipeline root, identity and labels of a cloud run."""
    group = parser.add_argument_group("cloud")
    group.add_argument("--project", default="", help="Google Cloud project (vertex)")
    group.add_argument("--region", default="", help="Vertex AI region, e.g. us-central1")
    group.add_argument("--pipeline-root", default="", help="gs:// folder for run artifacts")
    group.add_argument(
        "--service-account", default="",
        help="vertex: the Google service account (EMAIL) the run and its TPU custom jobs act "
        "as; without it Vertex uses the Compute Engine default account (a warning says so). "
        "gke: the Kubernetes service account (NAME) of the run's pods in its namespace",
    )  # fmt: skip
    group.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="run label (repeat)"
    )
    group.add_argument("--host", default="", help="Kubeflow Pipelines endpoint (gke)")
    group.add_argument(
        "--namespace", default="",
        help="gke: the Kubeflow profile namespace of the run and experiment (multi-user)",
    )  # fmt: skip
    group.add_argument(
        "--kube-context", default="",
        help="gke without --host: reach KFP through this kubeconfig context's API server",
    )  # fmt: skip
    group.add_argument(
        "--iap-client-id", default="",
        help="gke behind Identity-Aware Proxy: the OAuth client id; the token comes from "
        "the application default credentials",
    )  # fmt: skip
    group.add_argument(
        "--token-env", default="", metavar="VAR",
        help="gke: read a bearer token from environment variable VAR (never from a flag)",
    )  # fmt: skip
    group.add_argument("--experiment", default="alignpipe", help="KFP experiment (gke)")
    group.add_argument("--display-name", default="alignpipe", help="run or schedule name")
    group.add_argument(
        "--no-cache", action="store_true", help="run every task (default: the compiled caching)"
    )


def given(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The parameters a config file (``--config``) and the flags set, flags over the file,
    in their types; and where each came from."""
    prefix = "param_"
    flags = {
        k[len(prefix) :]: params.coerce(k[len(prefix) :], v)
        for k, v in vars(args).items()
        if k.startswith(prefix)
    }
    path = getattr(args, "config", None)
    config = config_file.read(path) if path else {}
    sources = {name: "config" for name in config} | {name: "flag" for name in flags}
    return {**config, **flags}, sources


def sourced_values(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """:func:`values`, and where each value came from (run_record.SOURCES): a built-in
    ``task``'s settings (pipelines/dag/tasks.py) under the given ones."""
    from pipelines.dag.tasks import with_task

    values, sources = with_task(*given(args))
    preset = run_preset(args)
    if preset is None:
        return values, sources
    if sources.get("heldout_reward") == "task":  # tasks.monitors_fit: not at a preset's scale
        values.pop("heldout_reward")
        sources.pop("heldout_reward")
    # Every flag over the preset re-estimates each stage: one that cannot fit is refused
    # here, before a slice is taken (pipelines/dag/fit.py).
    fit.check(preset, values)
    from_preset = preset.pipeline_params()
    return {**from_preset, **values}, {name: "run preset" for name in from_preset} | sources


def values(args: argparse.Namespace) -> dict[str, Any]:
    """The parameters given in a config file and as flags, converted to their types, over
    the run preset's."""
    return sourced_values(args)[0]


def run_preset(args: argparse.Namespace) -> Any:
    """The --run-preset, refused when this pipeline places no slice of its size."""
    name = getattr(args, "run_preset", None)
    if name is None:
        return None
    preset = RUN_PRESETS[name]
    if not slice_topology(preset.chip, preset.chips):
        raise ValueError(
            f"--run-preset {name}: its slice ({preset.slice_name}, {preset.chips} chips on "
            f"{preset.hosts} host(s)) is no {preset.chip} slice this pipeline places; run its "
            f"stages on the slice's workers with the commands `alignpipe run-presets {name}` prints"
        )
    return preset


def placement(args: argparse.Namespace) -> Placement:
    """The placement the flags describe (checked on construction); a command without
    ``add_dag_options`` (smoke) runs every task on the training image."""
    if args.image is None:
        print(f"note: no --image given; the spec names {DEFAULT_IMAGE}", file=sys.stderr)
    preset = run_preset(args)
    tpu = args.tpu or (preset.chip if preset else "v5e")
    topology = args.tpu_topology or (slice_topology(tpu, preset.chips) if preset else "2x2")
    if preset is not None:
        chips = math.prod(int(d) for d in topology.split("x")) if topology else 0
        if tpu != preset.chip or chips != preset.chips:
            raise ValueError(
                f"--run-preset {args.run_preset} is sized for {preset.chips} {preset.chip} chips; "
                f"--tpu {tpu} --tpu-topology {topology or '?'} is another slice. Drop those "
                "flags, or choose the preset of that slice (alignpipe run-presets)"
            )
    placement = Placement(
        target=args.target, image=args.image or DEFAULT_IMAGE,
        data_image=getattr(args, "data_image", ""),
        tpu=tpu, topology=topology, machine_type=args.machine_type,
        cpu_limit=args.cpu_limit, memory_limit=args.memory_limit, train_retries=args.train_retries,
        train_timeout_h=args.train_timeout, launcher_node_pool=args.launcher_node_pool,
    )  # fmt: skip
    for warning in placement.warnings():
        print(f"warning: {warning}", file=sys.stderr)
    return placement


def settings(args: argparse.Namespace) -> Any:
    """The cloud settings the flags describe."""
    from pipelines.targets.cloud import CloudError, CloudSettings

    labels = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep:
            raise CloudError(f"--label {item!r} must be KEY=VALUE")
        labels[key] = value
    return CloudSettings(
        project=args.project, region=args.region, pipeline_root=args.pipeline_root,
        service_account=args.service_account, labels=labels, host=args.host,
        namespace=args.namespace, kube_context=args.kube_context,
        iap_client_id=args.iap_client_id, token_env=args.token_env,
        experiment=args.experiment, display_name=args.display_name,
        enable_caching=False if args.no_cache else None,
    )  # fmt: skip


def guard(body: Any) -> int:
    """Run a command body; a user error prints one line and exits 2, a failure of the
    service or its credentials prints one line and exits 1."""
    try:
        return int(body())
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except _service_errors() as error:
        print(f"error: {_service_message(error)}", file=sys.stderr)
        return 1


def _service_errors() -> tuple[type[Exception], ...]:
    """What the clients raise when the service is unreachable, refuses, or no credentials
    are found (each library installed with the cloud SDKs)."""
    from google.api_core.exceptions import GoogleAPIError
    from google.auth.exceptions import GoogleAuthError
    from kfp_server_api.exceptions import OpenApiException
    from urllib3.exceptions import HTTPError

    return GoogleAPIError, GoogleAuthError, OpenApiException, HTTPError


def _service_message(error: Exception) -> str:
    """One line: what failed, and where to look."""
    from google.auth.exceptions import GoogleAuthError
    from urllib3.exceptions import HTTPError

    text = " ".join(str(error).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    if isinstance(error, GoogleAuthError):
        hint = "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS"
    elif isinstance(error, HTTPError):
        hint = "check --host (or --kube-context) and that the endpoint is reachable from here"
    else:
        hint = "the service refused the request; check the settings it names"
    return f"{type(error).__name__}: {text} ({hint})"
