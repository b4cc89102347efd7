"""A policy's answer to a conversation: the chat template, the model's stop tokens, the
sampler; what ``alignpipe generate`` prints, and how a user talks to a model."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from components.core.data.tokenizers import Tokenizer
from components.core.model.sampler import generate
from components.core.model.transformer import Transformer


@dataclasses.dataclass(frozen=True, slots=True)
class Sampling:
    """How to sample: 0 temperature is greedy; top_p 1.0 and top_k 0 filter nothing."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def render(
    tokenizer: Tokenizer,
    user: str,
    *,
    system: str = "",
    template_kwargs: dict[str, Any] | None = None,
    raw: bool = False,
) -> str:
    """The prompt text: ``user`` as it is (``raw``), or the conversation (a system message
    when given, then the user's) rendered with the model's chat template and its
    generation prompt."""
    if raw:
        return user
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    return tokenizer.render_chat(messages, True, **(template_kwargs or {}))


def fit_conversation(
    tokenizer: Tokenizer,
    messages: list[dict[str, str]],
    room: int,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[str, list[dict[str, str]]]:
    """The rendered conversation (its generation prompt after it) and the messages it holds:
    the oldest exchanges dropped (a leading system message kept) until its tokens fit
    ``room``; the last user message alone must fit."""
    kept = list(messages)
    while True:
        prompt = tokenizer.render_chat(kept, True, **(template_kwargs or {}))
        if len(tokenizer.encode_prompt(prompt)) <= room:
            return prompt, kept
        first = 1 if kept and kept[0]["role"] == "system" else 0
        if len(kept) - first <= 1:
            raise ValueError(
                f"the message alone has more tokens than the model's {room} positions left "
                "for a prompt; shorten it or lower --max-new-tokens"
            )
        del kept[first : first + 2]  # the oldest user turn and its answer


def respond(model: Transformer, tokenizer: Tokenizer, prompt: str, sampling: Sampling) -> str:
    """The model's response to the rendered ``prompt``, ended at its first stop token (the
    tokenizer's ``stop_ids``: eos and the template's end of turn), special tokens dropped."""
    ids = tokenizer.encode_prompt(prompt)  # as the shard stage writes prompts
    room = model.config.max_seq_len - sampling.max_new_tokens
    if len(ids) > room:
        raise ValueError(
            f"the prompt has {len(ids)} tokens and max_new_tokens is "
            f"{sampling.max_new_tokens}: together they pass the model's "
            f"{model.config.max_seq_len} positions; shorten one"
        )
    tokens = jnp.asarray([ids], jnp.int32)
    out = generate(
        model, tokens, jnp.ones_like(tokens), jax.random.key(sampling.seed),
        max_new_tokens=sampling.max_new_tokens, eos_id=tokenizer.stop_ids,
        pad_id=tokenizer.pad_id, temperature=sampling.temperature, top_k=sampling.top_k,
        top_p=sampling.top_p, vocab_size=tokenizer.vocab_size,
    )  # fmt: skip
    kept = np.asarray(out.mask[0]).astype(bool)
    return tokenizer.decode(np.asarray(out.tokens[0])[kept])
