"""The components that steer a run rather than run a stage: its data (generated, or the
files a glob matches), its plan (new data or not, the anchor), its initial policy (trained
by sft or given), and the promotion of a blessed policy. Light tasks: none imports JAX.

Plain Python functions, as in ``kfp_components.py``, which turns them into components.
"""

# No `from __future__ import annotations`: kfp reads the real annotations at build time.
from typing import NamedTuple

from kfp.dsl import Artifact, Dataset, Input, Model, Output


def builtin_data(pairs: int, seed: int, task: str, data: Output[Dataset]) -> str:
    """Generate a built-in task as JSONL; returns the shard stage's sources: the preference
    task's pairs, or (``task`` arithmetic) the reasoning task's prompts and, of role "sft",
    its formatted solutions."""
    import json

    from components.core.data import reasoning_task
    from components.core.data.builtin_task import write_jsonl
    from components.core.data.tokenizers import BUILTIN_WORDS
    from components.core.fileio import join

    if task == "arithmetic":
        data.metadata.update(reasoning_task.write_task(data.path, seed=seed))
        tokenizer = "builtin-arithmetic"
        return json.dumps([
            {"uri": join(data.uri, reasoning_task.PROMPTS_FILE), "tokenizer": tokenizer},
            {"uri": join(data.uri, reasoning_task.SFT_FILE), "tokenizer": tokenizer,
             "role": "sft"},
        ])  # fmt: skip
    data.metadata["pairs"] = write_jsonl(join(data.path, "pairs.jsonl"), pairs, seed=seed)
    # The task's own word-level tokenizer: what an empty ``tokenizer`` parameter picks.
    return json.dumps([{"uri": join(data.uri, "pairs.jsonl"), "tokenizer": BUILTIN_WORDS}])


def find_data(data_uri: str, sft_data_uri: str, heldout_data_uri: str) -> str:
    """List the files ``data_uri`` (and, of roles "sft" and "heldout", ``sft_data_uri`` and
    ``heldout_data_uri``) match, with fingerprints (never cached: a glob moves)."""
    import json

    from pipelines import stage_io

    sources = stage_io.find_sources(data_uri)
    for role, uri in (("sft", sft_data_uri), ("heldout", heldout_data_uri)):
        if uri:
            found = stage_io.find_sources(uri, f"{role}_data_uri")
            sources += stage_io.with_role(found, role)
    return json.dumps(sources)


def plan_run(
    data_uri: str, sources: str, force_run: bool, anchor_policy: str, promoted_policy_uri: str
) -> NamedTuple("Plan", [("new_data", bool), ("anchor", str)]):
    """Whether the run trains (its data differs from the last promoted run's, or forced) and
    the anchor drift is measured from, with the past promotions' drift (never cached)."""
    from collections import namedtuple

    from pipelines.releases import realign

    train, anchor = realign.plan(data_uri, sources, force_run, anchor_policy, promoted_policy_uri)
    return namedtuple("Plan", ["new_data", "anchor"])(train, anchor)


def no_new_data(sources: str, promoted_policy_uri: str) -> str:
    """The result of a run that trains nothing: its data equals the last promoted run's."""
    from pipelines.releases import realign

    return realign.no_new_data_result(sources, promoted_policy_uri)


def check_policy(base_policy: str, sft_on_base: bool) -> NamedTuple(
    "Checked", [("Output", bool), ("reference", str)]
):
    """Whether sft trains the initial policy (``Output``: no base policy, or ``sft_on_base``)
    and a reference to the base policy with its fingerprint ('' for none); never cached.

    The verdict is named ``Output`` for kfp.local's conditions (see evaluate).
    """
    from collections import namedtuple

    from pipelines.releases import policies

    train, reference = policies.initial_policy(base_policy, sft_on_base)
    return namedtuple("Checked", ["Output", "reference"])(train, reference)


def given_policy(reference: str) -> str:
    """The initial policy when sft trains none: the base policy as checked (a Hugging Face
    folder is imported inside each task that reads it)."""
    return reference


def promote(
    policy: str,
    evaluation: Input[Artifact],
    sources: str,
    run_id: str,
    promoted_policy_uri: str,
    registry_model: str,
    promoted: Output[Model],
):
    """Copy the blessed policy to its artifact and, when given, promote it as a new version of
    ``promoted_policy_uri`` with its record: run, data, the evaluation's figures and reasons;
    with ``registry_model``, also as a new version of that Vertex Model Registry model."""
    import json

    from components.core import fileio
    from pipelines import stage_io
    from pipelines.releases import policies, registry

    aligned = stage_io.reference_details(policy)
    record = {
        **json.loads(fileio.read_text(fileio.join(evaluation.path, "eval.json"))),
        "run_id": run_id,
        "algorithm": aligned.get("algorithm", ""),
        "data": json.loads(sources),
        "data_fingerprint": stage_io.data_fingerprint(sources),
    }
    registered: dict = {}

    def register(version: int, folder: str) -> dict:
        registered.update(registry.register_version(registry_model, version, folder, run_id=run_id))
        return registered

    version = policies.promote(
        aligned["uri"], promoted.path, promoted_policy_uri, record=record,
        register=register if registry_model else None,
    )  # fmt: skip
    promoted.metadata["promoted_policy_uri"] = promoted_policy_uri
    promoted.metadata["version"] = version or 0
    if registered:
        promoted.metadata["registry_model"] = registered["model"]
        promoted.metadata["registry_version_id"] = registered["version_id"]
