"""Mistral's 2025-2026 checkpoints, read as the ``mistral`` family.

``Mistral3ForConditionalGeneration`` wraps a language model and a Pixtral vision tower:
Mistral Small 3.1/3.2, Magistral Small and Devstral Small 1.x wrap a Mistral
(``text_config.model_type`` "mistral"); Ministral 3 (3B, 8B, 14B) and Devstral Small 2
wrap a ``ministral3``, Mistral's blocks with yarn rotary and a query temperature past the
original context (``llama_4_scaling_beta``). ``Ministral3ForCausalLM`` (Devstral 2) is the
latter without the wrapper. The language model is imported, text only, and exported as
``MistralForCausalLM`` or, with a query temperature, ``Ministral3ForCausalLM``.

A ``text_config`` leaves out the fields that equal its class's defaults; they are filled
in from the classes of transformers 5.25 (below). The head is tied as transformers 5 ties
it: by the outer config's ``tie_word_embeddings`` (``text_config``'s is not read), and
where that says tie, only if the checkpoint holds no ``lm_head`` of its own
(:func:`tie_by_checkpoint`).
Ministral 3 Instruct's FP8 release (one scale a weight, under the outer
``quantization_config``) imports dequantized (``fp8.py``); other quantized releases are
refused by name: their BF16 releases import.
"""

from __future__ import annotations

import json
from typing import Any

from components.hf import fp8, mistral4
from components.hf.refusals import refuse

# MistralConfig's class defaults (transformers 5.25), for the fields a text_config omits.
MISTRAL_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
}
# Ministral3Config's (transformers 5.25): yarn over a 16k original context, and the
# query temperature past it.
MINISTRAL3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 34,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-5,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 1_000_000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 16384,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": 1.0,
        "mscale": 1.0,
        "llama_4_scaling_beta": 0.1,
    },
}
TEXT_DEFAULTS = {"mistral": MISTRAL_TEXT_DEFAULTS, "ministral3": MINISTRAL3_TEXT_DEFAULTS}


def ministral3_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A ``ministral3`` causal LM's config with Ministral3Config's defaults filled in (its
    yarn table too where ``rope_parameters`` is missing or null, as the class does)."""
    filled = {**MINISTRAL3_TEXT_DEFAULTS, **hf}
    if hf.get("rope_scaling"):  # the older key wins, as transformers 5 converts it
        filled["rope_parameters"] = hf["rope_scaling"]
    elif not hf.get("rope_parameters"):
        filled["rope_parameters"] = MINISTRAL3_TEXT_DEFAULTS["rope_parameters"]
    return filled


def tie_by_checkpoint(hf: dict[str, Any]) -> bool:
    """Whether a Mistral 3 checkpoint's tie is the checkpoint's to decide: its outer
    ``tie_word_embeddings`` says tie (Mistral3Config's default, so also where it says
    nothing, as Mistral Small 3.1's config, saved by 4.50, does), and transformers 5 then
    unties a head the checkpoint holds apart from the embedding. Safetensors saved by
    transformers hold no tied head, so the import unties where one is present."""
    wrapped = "Mistral3ForConditionalGeneration" in (hf.get("architectures") or [])
    return wrapped and bool(hf.get("tie_word_embeddings", True))


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a ``Mistral3ForConditionalGeneration`` checkpoint:
    its ``text_config`` with its class's defaults and the head tied as transformers 5 ties
    it; a quantized release other than FP8 (its outer ``quantization_config``) is refused."""
    text = dict(hf.get("text_config") or {})
    kind = text.get("model_type", "mistral")
    refuse(
        kind not in (*TEXT_DEFAULTS, "mistral4"),
        f"Mistral3ForConditionalGeneration wrapping a {kind!r} language model (alignpipe "
        f"reads {sorted(TEXT_DEFAULTS)} and 'mistral4')",
    )
    tied = bool(hf.get("tie_word_embeddings", True))  # the outer flag: 5.25 reads no other
    if kind == "mistral4":  # Mistral Small 4 (mistral4.py)
        filled, architecture = mistral4.filled(text), mistral4.ARCHITECTURE
    elif kind == "ministral3":
        filled, architecture = ministral3_config(text), "Ministral3ForCausalLM"
    else:
        filled, architecture = {**MISTRAL_TEXT_DEFAULTS, **text}, "MistralForCausalLM"
    filled.update(tie_word_embeddings=tied, architectures=[architecture], model_type=kind)
    quantized = hf.get("quantization_config")
    refuse(
        fp8.refused(quantized),
        f"quantization_config={json.dumps(quantized)}: {fp8.REFUSED} (Ministral 3's: the "
        "repository named -BF16, e.g. mistralai/Ministral-3-8B-Instruct-2512-BF16)",
    )
    return filled
