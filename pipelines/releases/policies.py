"""Which policy a name stands for, and promoting the blessed one: what the pipeline's light
tasks and preflight ask of the promotion history (promotion.py).

Component bodies import this module inside the task, so it imports nothing heavy at module
level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from components.core import fileio
from components.core.model.heads import require_head
from components.core.model.hf_folder import is_hf_dir
from pipelines import stage_io
from pipelines.releases import promotion


def check_policy(base_policy: str) -> str:
    """A reference to the policy ``base_policy`` names, refused unless it is one.

    An alignpipe policy folder holds ``config.json`` and ``params/`` (no scalar head); a
    Hugging Face folder (local or gs://) is taken as it is, to be imported inside the tasks
    that read it, and its reference says so (``hf``). A promotion root (a
    ``promoted_policy_uri``) stands for its current version's folder. The reference's
    fingerprint covers a Hugging Face folder's weights (``fingerprint``).
    """
    policy = promotion.resolve_policy(base_policy)
    shown = base_policy if policy == base_policy else f"{base_policy} (current: {policy})"
    if is_hf_dir(policy):
        return stage_io.reference(policy, stage_io.fingerprint(policy), hf=True)
    for name in promotion.POLICY_FILES:
        if not fileio.exists(fileio.join(policy, name)):
            raise FileNotFoundError(
                f"base_policy {shown!r} has no {name}; pass a model folder written by "
                "the sft, ppo or promote stage (config.json + params/), a Hugging Face "
                "model folder (config.json + *.safetensors + tokenizer.json), or '' to "
                "train one"
            )
    require_head(policy, scalar=False, flag="base_policy", shown=shown)
    return stage_io.reference(policy, stage_io.fingerprint(policy))


def initial_policy(base_policy: str, sft_on_base: bool) -> tuple[bool, str]:
    """Whether the run trains its initial policy with sft, and the reference sft starts from
    (or, without sft, the policy itself): '' for a fresh model of the preset."""
    if not base_policy:
        return True, ""
    return sft_on_base, check_policy(base_policy)


def model_tokenizer(folder: str, flag: str) -> str:
    """The tokenizer folder of a model (a promotion root's current version): a Hugging Face
    folder's own, or an alignpipe model's ``tokenizer/``; refused, naming ``flag``, when the
    model carries none (artifacts trained before models kept their tokenizer)."""
    from components.core.data.tokenizers import MODEL_TOKENIZER_DIR

    folder = promotion.resolve_policy(folder)
    if is_hf_dir(folder):
        return folder
    own = fileio.join(folder, MODEL_TOKENIZER_DIR)
    if not fileio.exists(own):
        raise FileNotFoundError(
            f"{flag} {folder!r} carries no {MODEL_TOKENIZER_DIR}/ (a model trained before "
            "models kept their tokenizer); pass --tokenizer with the tokenizer it was trained "
            "with (the tokenizer/ folder of its run's shards)"
        )
    return own


def shards_tokenizer(tokenizer: str, sources: list[dict[str, Any]], base_policy: str) -> str:
    """The tokenizer the shard stage uses: ``tokenizer`` when given, else the base policy's
    own, else the data's own (``stage_io.data_tokenizer``)."""
    if tokenizer:
        return tokenizer
    if base_policy:
        return model_tokenizer(base_policy, "base_policy")
    return stage_io.data_tokenizer(sources)


def promote(
    policy_dir: str,
    artifact_dir: str,
    promoted_policy_uri: str,
    *,
    record: dict[str, Any] | None = None,
    register: Callable[[int, str], dict[str, Any]] | None = None,
) -> int | None:
    """Copy the blessed policy to the promote task's artifact and, when given, promote it.

    At ``promoted_policy_uri`` it becomes a new version and the current one (promotion.py);
    ``record`` (run id, data fingerprint, the evaluation's eval.json) joins the history, and
    ``register`` (see promotion.promote) registers the version elsewhere.
    Returns the version number, or None when no URI is given.
    """
    fileio.copy_tree(policy_dir, artifact_dir)
    if not promoted_policy_uri:
        return None
    return promotion.promote(promoted_policy_uri, policy_dir, record, register)
