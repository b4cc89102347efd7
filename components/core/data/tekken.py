"""Mistral's ``tekken.json`` as a Hugging Face fast tokenizer.

Several Mistral releases (Devstral Small 2505; Ministral 3's cards load theirs with
``MistralCommonBackend``) ship ``tekken.json`` and no ``tokenizer.json``. Tekken is a
tiktoken-style byte-level BPE: its ``vocab`` lists each token's bytes (base64) by rank, the
merges are implied by the ranks, its special tokens take the first ids and the regular
tokens follow them, and a regular expression splits text before the BPE. This builds the
same ``tokenizers.Tokenizer`` as transformers' ``MistralConverter``
(``transformers.integrations.mistral.tokenizer``; tests compare the two), so an import needs
neither transformers nor mistral-common.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

FILE = "tekken.json"
# The specials' roles, as transformers maps them for a converted tekken tokenizer.
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


class TekkenError(ValueError):
    """A tekken.json this converter cannot read (named in the message)."""


def _byte_names() -> dict[int, str]:
    """GPT-2's printable character for each byte (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    names, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in names:
            names[b] = chr(256 + extra)
            extra += 1
    return names


def _specials(raw: dict[str, Any]) -> list[str]:
    """The special tokens' strings in rank order, padded with ``<SPECIAL_i>`` to the
    configured count."""
    entries = raw.get("special_tokens")
    if entries is None:
        raise TekkenError(
            "tekken.json of the older format (no special_tokens list): convert it with "
            "mistral-common's tokenizer, or use a tokenizer.json"
        )
    ranks = sorted(entry["rank"] for entry in entries)
    if ranks != list(range(len(ranks))):
        raise TekkenError(f"tekken.json special_tokens ranks must be 0..n-1, got {ranks}")
    strings = [str(entry["token_str"]) for entry in sorted(entries, key=lambda e: e["rank"])]
    count = raw["config"].get("default_num_special_tokens") or len(strings)
    return strings + [f"<SPECIAL_{i}>" for i in range(len(strings), count)]


def _vocab_and_merges(ranked: list[bytes]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level vocab (GPT-2's characters) and the merges the ranks imply: for each token,
    every split into two tokens that are in the vocab, ordered by the token's rank, then by
    its parts' ranks (transformers' ``_extract_merges``)."""
    names = _byte_names()
    rank_of = {token: rank for rank, token in enumerate(ranked)}

    def name(token: bytes) -> str:
        return "".join(names[b] for b in token)

    vocab = {name(token): rank for token, rank in rank_of.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in rank_of.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in rank_of and right in rank_of:
                merges.append((rank, rank_of[left], rank_of[right], left, right))
    merges.sort(key=lambda m: m[:3])
    return vocab, [(name(m[3]), name(m[4])) for m in merges]


def tokenizer_from_tekken(text: str) -> Tokenizer:
    """The fast tokenizer of a ``tekken.json``'s text."""
    try:
        raw = json.loads(text)
        config = raw["config"]
        specials = _specials(raw)
        regular = raw["vocab"]
        size = config.get("default_vocab_size")
        if size is not None:
            regular = regular[: size - len(specials)]
        ranked = [base64.b64decode(entry["token_bytes"]) for entry in regular]
        pattern = config["pattern"]
    except (KeyError, TypeError, ValueError) as error:
        if isinstance(error, TekkenError):
            raise
        raise TekkenError(f"tekken.json is not in Mistral's format: {error!r}") from error
    vocab, merges = _vocab_and_merges(ranked)
    vocab = {token: rank + len(specials) for token, rank in vocab.items()}
    vocab.update({token: rank for rank, token in enumerate(specials)})
    tokenizer = Tokenizer(BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def tokenizer_config(chat_template: str | None) -> dict[str, Any]:
    """The ``tokenizer_config.json`` of a converted tekken tokenizer: its specials' roles,
    and the folder's chat template when it has one."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIALS}
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config
