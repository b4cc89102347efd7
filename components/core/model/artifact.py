"""Building models for a stage: fresh from a preset, or loaded from a model artifact."""

from __future__ import annotations

import logging
from typing import Any

import jax
from flax import nnx

from components.core.config import LoRASettings
from components.core.model.heads import ModelMismatchError, require_head
from components.core.model.hf_folder import is_hf_dir
from components.core.model.transformer import ModelConfig, Transformer, model_config
from components.core.training.checkpoint import export_model, load_model_params, read_model_config
from components.core.training.host import on_host

log = logging.getLogger(__name__)


def create_model(
    preset: str, vocab_size: int, *, scalar_head: bool, seed: int, **overrides: Any
) -> Transformer:
    """A freshly initialised model of ``preset`` (overrides with empty values are ignored)."""
    overrides = {k: v for k, v in overrides.items() if v not in ("", None)}
    config = model_config(preset, vocab_size, **overrides)
    with on_host():
        return Transformer(config, rngs=nnx.Rngs(seed), scalar_head=scalar_head)


def _pure_params(model_dir: str, config: ModelConfig, has_head: bool) -> dict:
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), scalar_head=has_head))
    return nnx.to_pure_dict(load_model_params(model_dir, nnx.state(abstract, nnx.Param)))


def load_model(
    model_dir: str,
    *,
    scalar_head: bool | None = None,
    seed: int = 0,
    **overrides: Any,
) -> tuple[Transformer, dict[str, Any]]:
    """The model of an artifact and its ``config.json``.

    ``scalar_head=True`` on a policy artifact adds a fresh head (a reward model or
    critic warm-started from the policy); ``False`` drops a stored head.
    ``overrides`` (e.g. ``remat``, ``dtype``) change how the model computes, not its shape.
    """
    info = read_model_config(model_dir)
    overrides = {k: v for k, v in overrides.items() if v not in ("", None)}
    config = ModelConfig.from_dict({**info["model"], **overrides})
    has_head = bool(info.get("scalar_head", False))
    want_head = has_head if scalar_head is None else scalar_head

    def build() -> Transformer:
        return Transformer(config, rngs=nnx.Rngs(seed), scalar_head=want_head)

    if want_head and not has_head:
        # A fresh head, drawn from ``seed``: initialise the whole model, so the head is the
        # one a from-scratch model of this seed gets; the stored parameters replace the rest.
        with on_host():  # host memory: the stage places the parameters itself (host.py)
            model = build()
    else:
        # Every parameter comes from the artifact: shapes only, nothing initialised (a
        # random draw would be thrown away, at a model's size in time and host memory).
        model = nnx.eval_shape(build)
    stored = _pure_params(model_dir, ModelConfig.from_dict(info["model"]), has_head)
    if not want_head:
        stored.pop("scalar_head", None)
    target = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(target)
    pure.update(stored)
    nnx.replace_by_pure_dict(target, pure)
    nnx.update(model, target)
    return model, info


def check_tokenizer(info: dict[str, Any], manifest: dict[str, Any], model_dir: str) -> None:
    """Refuse a model whose tokenizer differs from the one the shards were made with."""
    model_tok = info.get("tokenizer", {}).get("fingerprint")
    data_tok = manifest.get("tokenizer", {}).get("fingerprint")
    if model_tok != data_tok:
        raise ModelMismatchError(
            f"{model_dir} was trained with tokenizer {model_tok}, but the shards use {data_tok}; "
            "re-shard the data with the model's tokenizer (shard --tokenizer <model>/tokenizer)"
        )


def require_policy(info: dict[str, Any], model_dir: str, flag: str, note: str = "") -> None:
    """Refuse a reward model (an artifact with a scalar head) given where a policy goes."""
    require_head(model_dir, scalar=False, flag=flag, info=info, note=note)


def save_model(
    output: str,
    model: Transformer,
    params: Any,
    *,
    tokenizer: dict[str, Any],
    stage: str,
    training: dict[str, Any],
    step: int,
    pretrained: bool = False,
    tokenizer_dir: str = "",
    hf: dict[str, Any] | None = None,
    **extra: Any,
) -> None:
    """Export a model artifact: ``config.json`` (model, tokenizer, training, step) + params.

    ``pretrained``: the model descends from pretrained weights (its start was one, see
    :func:`is_pretrained`); later stages read it to pick learning rates for such weights.
    ``tokenizer_dir``: the tokenizer folder the model was trained with (the shards'
    ``tokenizer/``), copied into the artifact's ``tokenizer/`` so the model travels with its
    tokenizer: the next run's shards, a promotion and ``model export`` need nothing else.
    ``hf``: the Hugging Face checkpoint the model descends from (:func:`hf_source`), kept in
    its config.json when there is one.
    """
    from components.core.data.tokenizers import MODEL_TOKENIZER_DIR
    from components.core.fileio import copy_tree, join

    export_model(
        output,
        model_config=model.config.to_dict(),
        params=jax.device_get(params),
        extra_config={
            "tokenizer": tokenizer,
            "stage": stage,
            "scalar_head": model.scalar_head is not None,
            "training": training,
            "step": step,
            "pretrained": pretrained,
            **({"hf": hf} if hf else {}),
            **extra,
        },
    )
    if tokenizer_dir and jax.process_index() == 0:
        copy_tree(tokenizer_dir, join(output, MODEL_TOKENIZER_DIR))


def is_pretrained(model: str | dict[str, Any]) -> bool:
    """Whether a model holds pretrained weights rather than ones trained from scratch.

    ``model`` is a model folder (an artifact or a Hugging Face folder) or an artifact's
    ``config.json`` as read. True for a Hugging Face folder, an imported one (stage
    ``import``), and an artifact saved with ``pretrained`` (a descendant of either).
    """
    if isinstance(model, str):
        if is_hf_dir(model):
            return True
        model = read_model_config(model)
    return bool(model.get("pretrained")) or model.get("stage") == "import"


def hf_source(model_dir: str) -> dict[str, Any] | None:
    """The Hugging Face checkpoint a model artifact descends from (``hf`` in its
    config.json: family, architecture, dtype), as its import recorded it and every stage
    after it carries on; None for a model trained from scratch or none given. ``model
    export`` writes the weights in that checkpoint's dtype."""
    if not model_dir:
        return None
    return read_model_config(model_dir).get("hf")


def stage_model(
    manifest: dict[str, Any],
    *,
    base: str,
    preset: str,
    scalar_head: bool,
    seed: int,
    remat: str = "",
    dtype: str = "",
    adapters: LoRASettings | None = None,
) -> Transformer:
    """The model a training stage starts from: ``base`` if given, else ``preset``.

    ``base`` is a model artifact (a stage imports a Hugging Face folder first:
    ``hf.importer.resolve_base``). It must fit the shards' tokenizer, checked
    before any training. Adapters a base was trained with are merged into it; with
    ``adapters`` of a non-zero rank the model gets fresh ones (lora.attach).
    """
    from components.core.data.input_pipeline import check_vocab

    if base:
        model, info = load_model(base, scalar_head=scalar_head, seed=seed, remat=remat, dtype=dtype)
        check_tokenizer(info, manifest, base)
    else:
        vocab = int(manifest["tokenizer"]["vocab_size"])
        model = create_model(
            preset, vocab, scalar_head=scalar_head, seed=seed, remat=remat, dtype=dtype
        )
    check_vocab(manifest, model.config.vocab_size)
    if not base and adapters is not None and adapters.lora_rank:
        # Adapters on random weights would only learn a low-rank model; a fresh start
        # trains every parameter, and the stages after it adapt what it learned.
        log.warning("lora_rank %d: no base model to adapt, so every parameter trains",
                    adapters.lora_rank)  # fmt: skip
        adapters = None
    return with_adapters(model, adapters, seed)


def with_adapters(model: Transformer, adapters: LoRASettings | None, seed: int) -> Transformer:
    """``model`` with its own adapters merged, and fresh ones where ``adapters`` asks."""
    from components.core.model import lora

    if adapters is None:
        return lora.merge(model)
    return lora.attach(
        model, rank=adapters.lora_rank, alpha=adapters.lora_alpha,
        targets=adapters.lora_target_modules(), seed=seed,
    )  # fmt: skip
