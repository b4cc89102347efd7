"""What the pipeline's component bodies share: metrics files, source and policy references, copies.

Component bodies import this module inside the task (locally or in the image), so it
imports nothing heavy at module level.

References passed between tasks as JSON strings: kfp.local cannot select between two
artifacts (``dsl.OneOf`` of artifacts), so the policy PPO starts from and the input files of
the shard stage travel as ``{"uri": …}`` strings. Each carries a fingerprint of what it
points to (size and modification time), so a cached task is reused only while its input
is unchanged — a re-run over a glob that matches new files, or a policy promoted again at
the same folder, reruns what depends on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from components.core import fileio
from components.core.config import TrackingSettings

FAILURE_FILE = "FAILURE.txt"


def now() -> str:
    """The current UTC time, ISO 8601 (what a stage records as its ``executed_at``)."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def scalar_metrics(summary: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a nested summary, flattened to ``a/b`` names."""
    flat: dict[str, float] = {}
    for key, value in summary.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(scalar_metrics(value, prefix=f"{name}/"))
        elif isinstance(value, bool):
            flat[name] = float(value)
        elif isinstance(value, int | float) and math.isfinite(value):
            flat[name] = float(value)
    return flat


def write_metrics(metrics: Any, stage: str, summary: dict[str, Any], started: float) -> None:
    """Log the summary's scalars on the Metrics artifact and write them to its file.

    The file matters: kfp.local counts a cached task as a miss when an output artifact
    has no file, and a Metrics artifact filled only by ``log_metric`` has none.
    """
    if not _primary_host():
        return
    values = scalar_metrics(summary)
    for name, value in values.items():
        metrics.log_metric(name, value)
    record = {
        "stage": stage,
        "executed_at": now(),
        "seconds": round(time.time() - started, 3),
        "metrics": values,
    }
    metrics.metadata["executed_at"] = record["executed_at"]
    fileio.write_text(metrics.path, json.dumps(record, indent=2, sort_keys=True))


def _primary_host() -> bool:
    """Whether this process writes the task's outputs: on a multi-host slice every host runs
    the task's executor (a Vertex TPU custom job runs the container on each VM, a JobSet a
    pod per host), and only host 0 may write, or they would all write the same files. The
    others tell KFP's executor so through ``CLUSTER_SPEC``: it writes its output file only
    for a chief ('workerpool0', 'chief', 'master'; kfp/dsl/executor.py)."""
    if "jax" not in sys.modules:  # a task without JAX runs on one host
        return True
    import jax

    if jax.process_index() == 0:
        return True
    task = {"type": "workerpool1", "index": jax.process_index()}
    os.environ["CLUSTER_SPEC"] = json.dumps({"task": task})
    return False


@contextlib.contextmanager
def failure_reason(folder: str) -> Iterator[None]:
    """Leave a user error's message in ``folder``/FAILURE.txt as it fails the task.

    The task fails as before; a local run's summary prints it (targets/local/result.py),
    where kfp.local itself reports only which task failed.
    """
    from components.core.entry import USER_ERRORS

    try:
        yield
    except USER_ERRORS as error:
        fileio.makedirs(folder)
        fileio.write_text(fileio.join(folder, FAILURE_FILE), f"{error}\n")
        raise


def code_fingerprint() -> str:
    """A digest of the stages' code (every ``components`` module): training state saved by
    other code is not resumed."""
    import components

    digest = hashlib.sha256()
    root = os.path.dirname(os.path.abspath(components.__file__))
    for folder, subfolders, files in os.walk(root):
        subfolders.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as source:
                digest.update(source.read())
    return digest.hexdigest()


def state_key(config: Any, inputs: dict[str, str]) -> str:
    """The key of a training task's durable state: a digest of its config, its inputs (URIs
    and references, which carry fingerprints) and the stages' code.

    What determines the training and nothing else, so every attempt at it finds its state:
    a retried pod, a preempted Vertex job, a resubmitted run (upstream tasks from the
    cache keep their output URIs). Training is deterministic from these, so resuming
    another attempt's state ends where an uninterrupted run would. A run id as the key
    would do the same for retries, but as a task input it would change every run's cache
    key, so no training task would ever come from the cache.
    """
    # Where the figures are reported (report_to and its settings) changes no training.
    reporting = {f.name for f in dataclasses.fields(TrackingSettings)}
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in reporting}
    payload = {
        "config": settings,
        "inputs": inputs,
        "code": code_fingerprint(),
    }
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@contextlib.contextmanager
def training_state(
    checkpoint_root: str, stage: str, config: Any, inputs: dict[str, str], output_uri: str
) -> Iterator[str]:
    """Keep the stage's training state at ``<checkpoint_root>/<stage>/<state_key>`` while
    it runs (``checkpoint.training_state_dir`` reads it); yields that folder.

    ``checkpoint_root`` '' keeps today's place, the output artifact's ``work/checkpoints``,
    which only a local artifact makes durable: with a remote ``output_uri`` (gs://, minio://)
    the launcher uploads the artifact after success only, so a preempted attempt would lose
    its state, and the task refuses to start.
    """
    from components.core.training import checkpoint

    if not checkpoint_root:
        if "://" in output_uri:
            raise ValueError(
                f"checkpoint_root: '' keeps training state inside the output artifact "
                f"({output_uri}), which is uploaded only after the task succeeds, so a retried "
                "or preempted attempt would start from step 0; set the pipeline parameter "
                "checkpoint_root to a gs:// folder, e.g. <pipeline root>/checkpoints"
            )
        yield ""
        return
    key = state_key(config, inputs)
    directory = checkpoint.keyed_state_dir(checkpoint_root, stage, key)
    previous = os.environ.get(checkpoint.CHECKPOINT_DIR_ENV)
    os.environ[checkpoint.CHECKPOINT_DIR_ENV] = directory
    try:
        yield directory
    finally:
        if previous is None:
            os.environ.pop(checkpoint.CHECKPOINT_DIR_ENV, None)
        else:
            os.environ[checkpoint.CHECKPOINT_DIR_ENV] = previous


def reference(uri: str, fingerprint: str = "", **details: Any) -> str:
    """A JSON reference to a file or folder, with an optional content fingerprint and details
    (e.g. an aligned policy's reward model and stage figures)."""
    return json.dumps({"uri": uri, "fingerprint": fingerprint, **details}, sort_keys=True)


def reference_uri(ref: str) -> str:
    """The URI of a reference made by :func:`reference`."""
    return json.loads(ref)["uri"]


def data_fingerprint(sources: str) -> str:
    """One digest of the data a run read: its sources' URIs and fingerprints (find_sources)."""
    import hashlib

    listed = sorted((s["uri"], s.get("fingerprint", "")) for s in json.loads(sources))
    return hashlib.sha256(json.dumps(listed).encode()).hexdigest()[:16]


def reference_details(ref: str) -> dict[str, Any]:
    """Everything a reference made by :func:`reference` holds (uri, fingerprint, details)."""
    return json.loads(ref) if ref else {}


def fingerprint(path: str) -> str:
    """Size and modification time of a file, or of a folder's ``config.json`` and, for a
    Hugging Face folder, the content digest of its weight files (``file_digest``): a
    fine-tune copied over the same folder keeps config.json but changes the weights."""
    from components.core.file_digest import weights_digest

    folder = fileio.isdir(path)
    target = fileio.join(path, "config.json") if folder else path
    if "://" not in target:
        stat = os.stat(target)
        stamp = f"{stat.st_size}@{stat.st_mtime_ns}"
    else:
        import tensorflow as tf  # only remote paths need TensorFlow's filesystems

        remote = tf.io.gfile.stat(target)
        stamp = f"{remote.length}@{remote.mtime_nsec}"
    weights = weights_digest(path) if folder else ""
    return f"{stamp}+{weights}" if weights else stamp


def find_sources(data_uri: str, name: str = "data_uri") -> list[dict[str, str]]:
    """Every file the comma-separated paths or globs match, with fingerprints, sorted; a
    folder is a Hugging Face dataset: its train split's files (``hf_datasets``); a
    ``bq://PROJECT.DATASET.TABLE`` is a BigQuery table (``components/shard/bigquery.py``).
    ``name``: the parameter that gave them, for the error when none matches."""
    from components.core.data import hf_datasets

    patterns = [p.strip() for p in data_uri.split(",") if p.strip()]
    tables = [p for p in patterns if p.startswith("bq://")]
    files = set()
    for match in (m for p in patterns if p not in tables for m in fileio.glob(p)):
        files.update(hf_datasets.dataset_files(match) if fileio.isdir(match) else [match])
    files = sorted(files)
    if tables:  # BigQuery tables: their modification time and row count
        from components.shard import bigquery

        found = [{"uri": t, "fingerprint": bigquery.table_fingerprint(t)} for t in sorted(tables)]
        return found + [{"uri": f, "fingerprint": fingerprint(f)} for f in files]
    if not files:
        raise FileNotFoundError(
            f"{name} {data_uri!r} matches no file; check the path or glob (local or gs://)"
            + ", or pass '' for the built-in task" * (name == "data_uri")
        )
    return [{"uri": f, "fingerprint": fingerprint(f)} for f in files]


def with_role(sources: list[dict[str, str]], role: str) -> list[dict[str, str]]:
    """``sources`` marked as data of ``role`` ("sft": the sft stage's own data; "heldout":
    the held-out reward model's)."""
    return [{**source, "role": role} for source in sources]


def sources_by_role(sources: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The sources' uris by role: "" (the run's data), "sft" (the sft stage's own) and
    "heldout" (the held-out reward model's)."""
    roles: dict[str, list[str]] = {}
    for source in sources:
        roles.setdefault(source.get("role", ""), []).append(source["uri"])
    return roles


def has_shards(folder: str) -> bool:
    """Whether the shard task wrote shards into ``folder`` (:func:`no_shards` wrote none)."""
    return fileio.exists(fileio.join(folder, "manifest.json"))


def no_shards(path: str) -> None:
    """Mark a shards output the run has no data for (its sft shards, without sft data)."""
    fileio.write_text(path, "no sft data of its own: the sft task reads the run's shards\n")


def data_tokenizer(sources: list[dict[str, Any]]) -> str:
    """The tokenizer the sources name (the built-in task names its own), else the byte one."""
    named = {source.get("tokenizer") for source in sources}
    return named.pop() if len(named) == 1 and None not in named else "byte"


def config_from(config_cls: type, values: dict[str, Any]) -> Any:
    """A stage config from the component's parameters named like its fields (others ignored)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_cls) if f.init}
    return config_cls(**{k: v for k, v in values.items() if k in names})


def start_jax() -> None:
    """Before JAX starts in a task: what every stage process sets (``entry.start_process``:
    virtual CPU devices for local runs, quiet TensorFlow, the imports' objects frozen)."""
    from components.core.entry import start_process

    start_process()


def publish_report(evaluation_dir: str, report_path: str) -> None:
    """Copy the evaluate stage's report.html to the pipeline's HTML artifact file."""
    fileio.write_bytes(report_path, fileio.read_bytes(fileio.join(evaluation_dir, "report.html")))
