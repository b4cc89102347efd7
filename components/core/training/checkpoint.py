"""Orbax checkpoints: resumable training state, and the exported model artifact.

Training state (params, optimizer state, step, RNG key, data position and any
extra pytrees or JSON a stage adds, e.g. PPO's KL controller) goes through an
Orbax ``CheckpointManager`` in the stage's training-state folder
(:func:`training_state_dir`): saved every N steps and at the end, the last K kept,
written asynchronously. Orbax finalizes a step only when all of it is written, so
after a kill the latest step it lists is complete and a restarted stage resumes
from it by itself.

Where that folder is: ``$ALIGNPIPE_CHECKPOINT_DIR`` when set, else
``<artifact>/work/checkpoints``. The pipeline sets it to ``<checkpoint_root>/<stage>/<key>``
(:func:`keyed_state_dir`), the key a digest of what determines the training (config,
inputs, code): a durable folder outside the output artifact, which the KFP launcher
uploads only after success, so a retried or preempted attempt of the same task resumes
from it, a new output folder or not.
A ``gs://`` folder is written by Orbax itself (tensorstore for the arrays, etils
``epath`` over TensorFlow's GCS filesystem for the metadata; the job's service
account needs object read, write and delete on the bucket). There a step is final
once its ``commit_success.txt`` is written, with no rename; under a ``/gcs`` FUSE
mount Orbax would rename each step, a copy-and-delete per object, so those paths
are refused (:func:`check_checkpoint_root`). A finished task's state is not deleted:
its last ``keep`` steps stay for debugging and for continuing the training; a bucket
lifecycle rule on the root bounds what runs leave behind.

A model artifact is ``config.json`` (schema version, model config, tokenizer,
training config, step reached) and ``params/``, an Orbax checkpoint of the
parameters only. ``config.json`` is written last: its presence marks a whole export.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from components.core import fileio
from components.core.file_digest import weights_digest
from components.core.flags import field
from components.core.training import fsdp
from components.core.training.host import host_abstract

log = logging.getLogger(__name__)
PyTree = Any
MODEL_SCHEMA_VERSION = 1
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
WORK_CHECKPOINTS = ("work", "checkpoints")
# The durable training-state folder of this process's stage ('' or unset: in the artifact).
CHECKPOINT_DIR_ENV = "ALIGNPIPE_CHECKPOINT_DIR"
# A run or task key is one folder name: no separators, nothing a shell or URI would mangle.
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ModelArtifactError(ValueError):
    """A model folder this version cannot load."""


def _abs(path: str) -> str:
    # Orbax wants absolute local paths; gs:// URIs pass through.
    return path if "://" in path else os.path.abspath(path)


def gcs_uri(path: str) -> str:
    """The ``gs://`` URI of a path under ``/gcs/`` (KFP's local path of a Cloud Storage
    artifact: Vertex's Cloud Storage FUSE mount, the JobSet hosts' CSI mount), else ``path``.
    Orbax writes ``gs://`` itself; through FUSE its atomic rename is a copy and delete of
    every object, neither fast nor atomic."""
    return "gs://" + path.removeprefix("/gcs/") if path.startswith("/gcs/") else path


def _scalars_as_arrays(tree: PyTree) -> PyTree:
    # Orbax stores arrays; numpy and Python scalars become 0-d arrays.
    def convert(leaf: Any) -> Any:
        return np.asarray(leaf) if isinstance(leaf, np.generic | int | float) else leaf

    return jax.tree.map(convert, tree)


def work_checkpoint_dir(artifact_dir: str) -> str:
    """Where a stage keeps its resumable training checkpoints inside its output artifact."""
    return fileio.join(artifact_dir, *WORK_CHECKPOINTS)


def training_state_dir(artifact_dir: str) -> str:
    """Where this process's stage keeps its resumable training state.

    ``$ALIGNPIPE_CHECKPOINT_DIR`` when set (a durable folder keyed by stage and inputs, see
    :func:`keyed_state_dir`), else ``<artifact_dir>/work/checkpoints``.
    """
    return os.environ.get(CHECKPOINT_DIR_ENV, "").strip() or work_checkpoint_dir(artifact_dir)


def check_checkpoint_root(root: str, name: str = "checkpoint_root") -> None:
    """Refuse a checkpoint root Orbax cannot keep durable state in; '' (none) passes."""
    if not root:
        return
    if root.startswith("gs://"):
        if not root.removeprefix("gs://").split("/")[0]:
            raise ValueError(f"{name}: {root!r} names no bucket; use gs://BUCKET/FOLDER")
        return
    if root.startswith("/gcs/"):
        raise ValueError(
            f"{name}: {root!r} is the Cloud Storage FUSE mount, where Orbax's atomic rename "
            "is a copy and delete of every object; use the gs:// URI of the same folder "
            f"({gcs_uri(root)}), which Orbax writes itself"
        )
    if "://" in root:
        raise ValueError(
            f"{name}: {root!r} is neither a gs:// URI nor a local folder; training state "
            "goes to Cloud Storage (gs://BUCKET/FOLDER) or, for local runs, a local folder"
        )


def keyed_state_dir(root: str, stage: str, key: str) -> str:
    """``<root>/<stage>/<key>``: the training state of one stage trained from one set of
    inputs; every attempt at that training (a retry, a preempted pod's replacement, a
    rerun of the same inputs) finds the same folder and resumes from it."""
    check_checkpoint_root(root)
    if not root:
        raise ValueError("checkpoint_root: '' has no keyed folders; pass a folder or gs:// URI")
    for name, part in (("stage", stage), ("key", key)):
        if not _KEY.match(part):
            raise ValueError(
                f"the {name} {part!r} is not a folder name (letters, digits, '.', '_', '-', "
                "at most 128, starting with a letter or digit)"
            )
    return fileio.join(_abs(root), stage, key)


@dataclasses.dataclass(slots=True, kw_only=True)
class CheckpointConfig:
    """When to save training state and how many saves to keep."""

    save_every: int = field(200, help="save training state every this many steps (and at the end)")
    keep: int = field(2, help="keep this many of the latest training checkpoints")
    async_save: bool = field(True, help="write checkpoints in the background while training")
    # Also keep this many saves with the highest ``metric`` (save's), e.g. PPO's held-out
    # reward-model score, from which best_step picks; 0 = the latest ``keep`` alone.
    keep_best: int = 0

    def __post_init__(self) -> None:
        if self.save_every < 1:
            raise ValueError(f"save_every must be at least 1, got {self.save_every}")
        if self.keep < 1:
            raise ValueError(f"keep must be at least 1, got {self.keep}")


METRIC = "selection"


def _metric(metrics: dict[str, float]) -> float:
    return metrics[METRIC]


class CheckpointRestoreError(ValueError):
    """A training checkpoint this run cannot continue (another stage, settings or model)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Restored:
    """One restored training checkpoint."""

    step: int
    state: PyTree
    rng: np.ndarray
    data_position: dict[str, Any]
    extra_trees: dict[str, PyTree]
    extra_json: dict[str, Any]


class TrainCheckpointer:
    """Saves and restores training state with an Orbax ``CheckpointManager``.

    On a multi-host run every process calls ``save`` and ``restore_latest`` (Orbax
    coordinates them); the JSON items are written by process 0.
    """

    def __init__(
        self,
        directory: str,
        config: CheckpointConfig,
        identity: dict[str, Any] | None = None,
        inputs: dict[str, str] | None = None,
    ) -> None:
        """``identity``: what a checkpoint must match to be resumed (the stage, and settings
        its saved state and data position depend on, e.g. the batch size and seed), saved
        with every step and compared on restore: a checkpoint that differs is refused, naming
        the settings, instead of being continued with another stage's state or skipping
        and repeating data. Checkpoints saved without one are restored as they are.
        ``inputs`` (flag → folder: the shards, the models a stage starts from) join the
        identity as their :func:`input_fingerprint`, so a resume from other ones is refused."""
        fingerprints = {flag: input_fingerprint(path) for flag, path in (inputs or {}).items()}
        self.identity = {**(identity or {}), **fingerprints}
        keeping: dict[str, Any] = {"max_to_keep": config.keep}
        if config.keep_best:
            policies = ocp.checkpoint_managers
            keeping = {
                "preservation_policy": policies.AnyPreservationPolicy(
                    [
                        policies.LatestN(n=config.keep),
                        policies.BestN(
                            get_metric_fn=_metric,
                            n=config.keep_best,
                            keep_checkpoints_without_metrics=False,
                        ),
                    ]
                ),  # fmt: skip
                "best_fn": _metric,  # best_step's order
                "best_mode": "max",
            }
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=config.save_every,
            **keeping,
            enable_async_checkpointing=config.async_save,
            # Leftovers of a killed save are never a step; clear them on start.
            cleanup_tmp_directories=True,
        )
        self.directory = directory
        self._ranked = bool(config.keep_best)
        self._manager = ocp.CheckpointManager(_abs(directory), options=options)

    def save(
        self,
        step: int,
        *,
        state: PyTree,
        rng: jax.Array | np.ndarray,
        data_position: dict[str, Any],
        extra_trees: dict[str, PyTree] | None = None,
        extra_json: dict[str, Any] | None = None,
        force: bool = False,
        chunks: int = 0,
        metric: float | None = None,
    ) -> bool:
        """Save state at ``step`` when due, or always with ``force``.

        ``state`` and ``extra_trees`` are host trees, or with ``chunks`` = the device
        count ``parallel.checkpoint_view`` of sharded ones: each host then writes the
        chunks it holds and none gathers the whole state. Restores give whole tensors.
        """
        tree = {"state": state, "rng": np.asarray(rng), "extra": dict(extra_trees or {})}
        tree = _scalars_as_arrays(tree)
        meta = {"data_position": data_position, "extra": dict(extra_json or {}), "chunks": chunks}
        meta["identity"] = self.identity
        # NaN ranks lowest: Orbax's best is the last of its metrics sorted, and
        # sorted([0.5, nan]) leaves the NaN last (it was promoted and the best dropped).
        rank = None if metric is None else float(metric)
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
            metrics=None if rank is None else {METRIC: -math.inf if math.isnan(rank) else rank},
        )

    def best_step(self) -> int | None:
        """The kept step of the highest ``metric`` (None when none was ranked)."""
        return self._manager.best_step() if self._ranked else None

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Every complete step kept on disk, oldest first."""
        return sorted(self._manager.all_steps())

    def restore_latest(
        self,
        state_template: PyTree,
        rng_template: jax.Array | np.ndarray,
        extra_templates: dict[str, PyTree] | None = None,
        step: int | None = None,
    ) -> Restored | None:
        """The latest complete checkpoint (or that of ``step``) in the templates' structure,
        or None if none."""
        step = self._manager.latest_step() if step is None else step
        if step is None:
            return None
        chunks = int(self._checked_meta(step).get("chunks", 0))
        whole = {"state": state_template, "extra": dict(extra_templates or {})}
        # A sharded run's checkpoint holds each tensor as its devices' chunks.
        stored = fsdp.chunk_template(whole, chunks) if chunks else whole
        template = _scalars_as_arrays({**stored, "rng": np.asarray(rng_template)})
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(template), meta=ocp.args.JsonRestore()
                ),
            )
        except Exception as error:  # Orbax: shapes or trees that differ, damaged files
            raise CheckpointRestoreError(
                f"the checkpoint of step {step} in {self.directory} cannot be restored into "
                f"this run ({str(error).splitlines()[0][:300]}): it was written with another "
                "model (preset, tokenizer, algorithm, lora_rank, reference) or its files are "
                f"damaged; pass the settings it was written with, {self.start_over()} to "
                f"start over, or remove the damaged step folder {step} to resume from the one "
                "before"
            ) from error
        tree, meta = restored["state"], restored["meta"]
        if chunks:
            joined = fsdp.join_like({"state": tree["state"], "extra": tree["extra"]}, whole)
            tree = {**tree, **joined}
        return Restored(
            step=int(step),
            state=tree["state"],
            rng=np.asarray(tree["rng"]),
            data_position=meta["data_position"],
            extra_trees=dict(tree["extra"]),
            extra_json=dict(meta["extra"]),
        )

    def latest_extra_json(self) -> dict[str, Any] | None:
        """The ``extra_json`` of the latest complete checkpoint (its identity checked, as
        ``restore_latest`` checks it), or None if none: what a run needs before it can build
        the templates to restore into."""
        step = self._manager.latest_step()
        return None if step is None else dict(self._checked_meta(step)["extra"])

    def _checked_meta(self, step: int) -> dict[str, Any]:
        """Step ``step``'s JSON item, refused when another stage or settings wrote it."""
        meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        self._check_identity(step, meta["meta"].get("identity", {}))
        return meta["meta"]

    def _check_identity(self, step: int, saved: dict[str, Any]) -> None:
        """Refuse a checkpoint saved with another stage or settings (see ``__init__``)."""
        changed = {
            name: (saved[name], value)
            for name, value in self.identity.items()
            if name in saved and saved[name] != value
        }
        if not changed:
            return
        if "stage" in changed:
            was, now = changed["stage"]
            raise CheckpointRestoreError(
                f"{self.directory} holds the {was} stage's checkpoint (step {step}), not the "
                f"{now} stage's: its --output is another stage's; pass {self.start_over()}"
            )
        listed = ", ".join(_changed(name, was, now) for name, (was, now) in changed.items())
        raise CheckpointRestoreError(
            f"the checkpoint of step {step} in {self.directory} was written with {listed}: "
            "resuming would continue it with other inputs or data; pass the ones it was "
            f"written with to resume it, or {self.start_over()} to start over"
        )

    def start_over(self) -> str:
        """What a refusal tells the user to pass to start over: a new --output, unless the
        state folder is ``$ALIGNPIPE_CHECKPOINT_DIR``'s, which no --output changes."""
        if os.environ.get(CHECKPOINT_DIR_ENV, "").strip():
            return f"remove {self.directory} (${CHECKPOINT_DIR_ENV} names it, whatever --output)"
        return "a new --output"

    def wait(self) -> None:
        """Block until background saves are on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _changed(name: str, was: Any, now: Any) -> str:
    """One changed identity entry for a message: an input folder (named by its flag, valued
    by :func:`input_fingerprint`) or a setting."""
    if name.startswith("--"):
        was, now = (f"files with fingerprint {v}" if v else "none" for v in (was, now))
        return f"another {name} than now (then {was}; now {now})"
    return f"{name} {was} (now {now})"


def export_model(
    model_dir: str, *, model_config: dict[str, Any], params: PyTree, extra_config: dict[str, Any]
) -> None:
    """Write a model artifact: ``params/`` (Orbax) then ``config.json``.

    ``extra_config`` carries e.g. ``tokenizer``, ``training`` and ``step``; its keys
    sit next to ``schema_version`` and ``model`` in ``config.json``.

    An artifact already complete with this very ``config.json`` (a finished stage run again
    with the same arguments: it resumes at its last step and trains none) is left as it is,
    so its :func:`input_fingerprint`, which the next stage's checkpoints keep, stays.
    """
    reserved = {"schema_version", "model"} & set(extra_config)
    if reserved:
        raise ValueError(f"extra_config may not set {sorted(reserved)}; they are written here")
    config = {"schema_version": MODEL_SCHEMA_VERSION, "model": model_config, **extra_config}
    text = json.dumps(config, indent=2, sort_keys=True, default=_json_default) + "\n"
    if _already_exported(model_dir, text):
        log.info("%s already holds this model (same config.json and step); kept", model_dir)
        return
    fileio.makedirs(model_dir)
    # params/ to gs:// directly when the artifact lies on Cloud Storage (gcs_uri); config.json,
    # written last, marks the export whole.
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(_abs(gcs_uri(fileio.join(model_dir, PARAMS_DIR))), params, force=True)
        checkpointer.wait_until_finished()
    if jax.process_index() == 0:
        fileio.write_text(fileio.join(model_dir, CONFIG_FILE), text)


def _already_exported(model_dir: str, text: str) -> bool:
    """Whether ``model_dir`` is complete with ``text`` as its config.json, as process 0 reads
    it (every process takes its answer: the save is collective)."""
    from jax.experimental import multihost_utils

    path = fileio.join(model_dir, CONFIG_FILE)
    same = (
        fileio.exists(fileio.join(model_dir, PARAMS_DIR, "_CHECKPOINT_METADATA"))
        and fileio.exists(path)
        and fileio.read_text(path) == text
    )
    if jax.process_count() > 1:
        same = bool(multihost_utils.broadcast_one_to_all(np.int32(same)))
    return same


def _json_default(value: Any) -> Any:
    # numpy scalars from metrics or configs.
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def input_fingerprint(folder: str) -> str:
    """A short digest of a stage's input folder as it was saved, '' for none given: a model
    artifact's config.json and its params' Orbax metadata (which holds the save's time, so
    two saves differ even with one config), a shards folder's manifest.json, a Hugging Face
    folder's config.json, safetensors index and the content of its weight files
    (``file_digest``: hashed once, then cached while the files stay). A copy of the folder
    keeps it; another training, import, sharding or set of weights changes it."""
    if not folder:
        return ""
    digest = hashlib.sha256()
    names = (CONFIG_FILE, "manifest.json", "params/_CHECKPOINT_METADATA",
             "model.safetensors.index.json")  # fmt: skip
    for name in names:
        path = fileio.join(folder, name)
        if fileio.exists(path):
            digest.update(name.encode() + b"\0" + fileio.read_bytes(path))
    weights = weights_digest(folder)
    if weights:
        digest.update(b"weights\0" + weights.encode())
    return digest.hexdigest()[:16]


def read_model_config(model_dir: str) -> dict[str, Any]:
    """A model artifact's ``config.json``, checked for our schema version and its params."""
    path = fileio.join(model_dir, CONFIG_FILE)
    if not fileio.exists(path):
        raise ModelArtifactError(
            f"{path} not found: {model_dir!r} is not a complete model artifact; "
            "pass the model output of the sft, reward or ppo stage"
        )
    try:
        config = json.loads(fileio.read_text(path))
        version = config.get("schema_version")
    except (ValueError, AttributeError) as error:  # not JSON, or not an object
        raise ModelArtifactError(
            f"{path} is not a model artifact's config ({error}); pass the model output of "
            "the sft, reward or ppo stage"
        ) from None
    if version != MODEL_SCHEMA_VERSION:
        raise ModelArtifactError(
            f"{path} has schema_version {version!r}; this version reads "
            f"{MODEL_SCHEMA_VERSION}. Retrain the model with this release"
        )
    if not fileio.exists(fileio.join(model_dir, PARAMS_DIR)):
        raise ModelArtifactError(f"{model_dir}/{PARAMS_DIR} is missing; export the model again")
    return config


def load_model_params(model_dir: str, abstract_params: PyTree) -> PyTree:
    """The parameters of a model artifact, restored into ``abstract_params``' structure."""
    read_model_config(model_dir)
    target = host_abstract(abstract_params)  # host memory, not accelerator 0 (host.py)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(_abs(fileio.join(model_dir, PARAMS_DIR)), target)
