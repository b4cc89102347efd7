"""Whether a model artifact is a policy or a reward model (a scalar head): one rule and one
message for the stages, the pipeline's light tasks and preflight. Reads only config.json,
so it needs no JAX."""

from __future__ import annotations

import json
from typing import Any

from components.core import fileio


class ModelMismatchError(ValueError):
    """A model artifact that does not fit the data or the stage."""


def require_head(
    model_dir: str,
    *,
    scalar: bool,
    flag: str,
    shown: str = "",
    info: dict[str, Any] | None = None,
    note: str = "",
) -> None:
    """Refuse a reward model (scalar head) where a policy goes, or the reverse, naming ``flag``.

    ``info``: the model's config.json when the caller has read it (else it is read here);
    ``shown``: how the message names the model (default ``model_dir``); ``note`` ends the
    message's first clause (e.g. what the stage takes instead).
    """
    if info is None:
        path = fileio.join(model_dir, "config.json")
        try:
            info = json.loads(fileio.read_text(path))
            info.get("scalar_head")
        except (ValueError, AttributeError) as error:  # not JSON, or not an object
            raise ModelMismatchError(f"{path} is not a model's config ({error})") from None
    has_head = bool(info.get("scalar_head"))
    if has_head == scalar:
        return
    shown = shown or model_dir
    stage = info.get("stage")
    if has_head:
        raise ModelMismatchError(
            f"{flag} {shown!r} is a reward model (stage {stage!r}, with a scalar head), not a "
            f"policy{note}; pass a policy as {flag} (the output of the sft, ppo or dpo stage)"
        )
    raise ModelMismatchError(
        f"{flag} {shown!r} is a policy (stage {stage!r}, no scalar head), not a reward "
        f"model{note}; pass the reward stage's model folder (e.g. <run>/reward/model)"
    )
