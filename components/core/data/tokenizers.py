"""Tokenizers: a built-in byte-level one, Hugging Face ``tokenizer.json``, SentencePiece.

Every tokenizer has a pad id distinct from its eos id (training masks padding
and samplers stop on eos). Where a tokenizer file has no separate pad token,
one id past its vocabulary is added, and ``vocab_size`` counts it.

A tokenizer saves itself into a folder (the shard stage's ``tokenizer/``), with
``alignpipe_tokenizer.json`` recording its kind, special ids, fingerprint and
chat template, so later stages load it from that folder alone.

A Hugging Face tokenizer carries its model folder's side files: its chat template
(``chat_templates.folder_template``) and ``generation_config.json``, whose ``eos_token_id``
list is the model's stop set (Llama 3 instruct: ``<|eot_id|>`` and ``<|end_of_text|>``;
Gemma: ``<end_of_turn>`` and ``<eos>``; Qwen: ``<|im_end|>`` and ``<|endoftext|>``).
"""

from __future__ import annotations

import abc
import hashlib
import importlib
import json
import logging
import os
from typing import Any

from components.core import fileio
from components.core.data.chat_templates import (
    DEFAULT_CHAT_TEMPLATE,
    folder_template,
    render_chat_template,
)

log = logging.getLogger(__name__)

INFO_FILE = "alignpipe_tokenizer.json"
# A Hugging Face folder's files beside tokenizer.json that a tokenizer carries along (a
# processor's chat_template.json as chat_template.jinja: chat_templates.folder_template).
SIDE_FILES = ("chat_template.jinja", "chat_template.json", "generation_config.json")
SCHEMA_VERSION = 1
# A model folder's tokenizer lives here (an imported or trained alignpipe model artifact).
MODEL_TOKENIZER_DIR = "tokenizer"
# Reserved tokens that serve as pad when the tokenizer names none apart from eos and the
# embedding has no spare row (Llama 3.1+ ships <|finetune_right_pad_id|> for exactly this).
# Reserved tokens a model without a pad lends to padding (pads are masked everywhere):
# Llama 3's, then the usual names; Mistral's <unk> last (its byte fallback never emits it).
PAD_CANDIDATES = (
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_0|>",
    "<pad>",
    "[PAD]",
    "<unk>",
)


class TokenizerError(ValueError):
    """A tokenizer input the user can fix."""


class Tokenizer(abc.ABC):
    """Common interface: ``encode``, ``decode``, special ids, ``save``, ``fingerprint``."""

    kind: str = ""
    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None
    chat_template: str | None = None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Every id that ends a response: eos, and the model's other stop tokens."""
        return (self.eos_id,)

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a prompt, bos first, once: a chat template may already write it."""
        ids = self.encode(text)
        if self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    @abc.abstractmethod
    def decode(self, ids: Any) -> str:
        """Text of ``ids``; special ids are dropped."""

    def _files(self) -> dict[str, bytes]:
        """The tokenizer's own files, by name, as saved into its folder."""
        return {}

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        digest.update(json.dumps(self._special(), sort_keys=True).encode())
        for name, data in sorted(self._files().items()):
            digest.update(name.encode())
            digest.update(hashlib.sha256(data).digest())
        return digest.hexdigest()[:16]

    def _special(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
        }

    def info(self) -> dict[str, Any]:
        """What the manifest and model configs record of this tokenizer."""
        return {
            **self._special(),
            "stop_ids": list(self.stop_ids),
            "fingerprint": self.fingerprint,
            "schema_version": SCHEMA_VERSION,
        }

    def special_tokens(self) -> dict[str, str]:
        """``bos_token``/``eos_token``/``pad_token`` strings, as chat templates expect them."""
        return {}

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, **template_kwargs: Any
    ) -> str:
        """Messages rendered with the tokenizer's chat template (or the default one);
        ``template_kwargs`` are the template's own arguments (Qwen3's ``enable_thinking``),
        passed as transformers' ``apply_chat_template`` passes its extra keywords."""
        return render_chat_template(
            self.chat_template or DEFAULT_CHAT_TEMPLATE,
            messages,
            add_generation_prompt,
            **{**self.special_tokens(), **template_kwargs},
        )

    def save(self, directory: str) -> None:
        """Write the tokenizer files and ``alignpipe_tokenizer.json`` into ``directory``."""
        fileio.makedirs(directory)
        for name, data in self._files().items():
            fileio.write_bytes(fileio.join(directory, name), data)
        info = {**self.info(), "files": sorted(self._files()), "chat_template": self.chat_template}
        fileio.write_text(fileio.join(directory, INFO_FILE), json.dumps(info, indent=2) + "\n")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: ids 0 pad, 1 bos, 2 eos, then byte ``b`` is ``b + 3``."""

    kind = "byte"
    OFFSET = 3

    def __init__(self) -> None:
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.vocab_size = 256 + self.OFFSET

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Any) -> str:
        data = bytes(int(i) - self.OFFSET for i in ids if int(i) >= self.OFFSET)
        return data.decode("utf-8", errors="replace")


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer (``tokenizer.json``), read with the ``tokenizers`` package."""

    kind = "hf"

    def __init__(
        self,
        tokenizer_json: bytes,
        tokenizer_config: bytes | None = None,
        side_files: dict[str, bytes] | None = None,
    ) -> None:
        """``side_files``: the folder's :data:`SIDE_FILES` that exist, by name."""
        from tokenizers import Tokenizer as RustTokenizer

        self._json = tokenizer_json
        self._config_bytes = tokenizer_config
        self._tok = RustTokenizer.from_str(tokenizer_json.decode("utf-8"))
        config = json.loads(tokenizer_config) if tokenizer_config else {}
        config = config if isinstance(config, dict) else {}
        side = {name: data for name, data in (side_files or {}).items() if data}
        try:
            self.chat_template, self._side = folder_template(config, side)
        except ValueError as error:
            raise TokenizerError(f"tokenizer: {error}") from None
        base_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._special_id(config, "eos_token", ["</s>", "<|endoftext|>", "<eos>"])
        if self.eos_id is None:
            raise TokenizerError(
                "tokenizer: no end-of-sequence token found; "
                "set 'eos_token' in tokenizer_config.json"
            )
        self.bos_id = self._special_id(config, "bos_token", ["<s>", "<bos>", "<|begin_of_text|>"])
        pad = self._special_id(config, "pad_token", ["<pad>", "[PAD]"])
        if pad is None or pad == self.eos_id:
            pad = base_vocab  # one added id: pad must differ from eos
            base_vocab += 1
        self.pad_id = pad
        self.vocab_size = base_vocab
        self._stops = self._generation_stops()

    def _generation_stops(self) -> tuple[int, ...]:
        """eos, then generation_config.json's other ``eos_token_id`` entries in its order."""
        raw = self._side.get("generation_config.json")
        try:
            config = json.loads(raw) if raw else {}
        except ValueError as error:
            raise TokenizerError(
                f"generation_config.json is not valid JSON ({error}); download it again"
            ) from None
        ids = config.get("eos_token_id") if isinstance(config, dict) else None
        ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
        limit = self._tok.get_vocab_size(with_added_tokens=True)
        stops = [self.eos_id]
        for token_id in ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise TokenizerError(
                    f"generation_config.json: eos_token_id {ids} must be token ids (integers)"
                )
            if not 0 <= token_id < limit:
                raise TokenizerError(
                    f"generation_config.json: eos_token_id {token_id} is not an id of the "
                    f"tokenizer (0..{limit - 1}); use the files released with the model"
                )
            if token_id not in stops:
                stops.append(token_id)
        return tuple(stops)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stops

    def _special_id(self, config: dict, key: str, fallbacks: list[str]) -> int | None:
        names = [_token_content(config.get(key))] + fallbacks
        for name in names:
            if name:
                token_id = self._tok.token_to_id(name)
                if token_id is not None:
                    return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def special_tokens(self) -> dict[str, str]:
        ids = {"bos_token": self.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id}
        tokens = {name: self._tok.id_to_token(i) for name, i in ids.items() if i is not None}
        return {name: token for name, token in tokens.items() if token is not None}

    def decode(self, ids: Any) -> str:
        limit = self._tok.get_vocab_size(with_added_tokens=True)
        return self._tok.decode([int(i) for i in ids if int(i) < limit], skip_special_tokens=True)

    def _files(self) -> dict[str, bytes]:
        files = {"tokenizer.json": self._json, **self._side}
        if self._config_bytes:
            files["tokenizer_config.json"] = self._config_bytes
        return files


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model file."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes) -> None:
        import sentencepiece as spm

        self._proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        size = self._sp.get_piece_size()
        if self._sp.eos_id() < 0:
            raise TokenizerError("tokenizer: the SentencePiece model defines no eos piece (eos_id)")
        self.eos_id = self._sp.eos_id()
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        pad = self._sp.pad_id()
        if pad < 0 or pad == self.eos_id:
            pad, size = size, size + 1
        self.pad_id = pad
        self.vocab_size = size

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def special_tokens(self) -> dict[str, str]:
        ids = {"bos_token": self.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id}
        size = self._sp.get_piece_size()
        return {n: self._sp.id_to_piece(i) for n, i in ids.items() if i is not None and i < size}

    def decode(self, ids: Any) -> str:
        size = self._sp.get_piece_size()
        return self._sp.decode([int(i) for i in ids if 0 <= int(i) < size])

    def _files(self) -> dict[str, bytes]:
        return {"tokenizer.model": self._proto}


def fit_to_embedding(
    tokenizer_json: bytes,
    config_bytes: bytes | None,
    embedding_rows: int,
    where: str,
    side_files: dict[str, bytes] | None = None,
) -> HFTokenizer:
    """A model's own tokenizer, with a pad id inside its ``embedding_rows``.

    A tokenizer without a pad apart from eos gets one id past its vocabulary
    (:class:`HFTokenizer`); a pretrained model has no row for it, so a reserved token
    (``PAD_CANDIDATES``) serves instead, recorded in its tokenizer_config.json. ``where``
    names the model folder in errors.
    """
    from tokenizers import Tokenizer as RustTokenizer

    try:
        vocab = RustTokenizer.from_str(tokenizer_json.decode()).get_vocab(with_added_tokens=True)
        tokenizer = HFTokenizer(tokenizer_json, config_bytes, side_files)
    except TokenizerError:
        raise
    except Exception as error:  # the tokenizers library raises bare Exceptions on bad files
        raise TokenizerError(
            f"{where}: tokenizer.json or tokenizer_config.json cannot be read ({error}); "
            "download the model's tokenizer files again"
        ) from None
    token_rows = max(vocab.values()) + 1
    if token_rows > embedding_rows:
        raise TokenizerError(
            f"{where}: the tokenizer has ids up to {token_rows - 1} but the embedding has "
            f"{embedding_rows} rows (config.json vocab_size); the tokenizer belongs to "
            "another model: use the tokenizer files released with these weights"
        )
    if tokenizer.vocab_size <= embedding_rows:
        return tokenizer
    pad = next((name for name in PAD_CANDIDATES if name in vocab), None)
    if pad is None:
        raise TokenizerError(
            f"{where}: the tokenizer has no pad token apart from eos and the embedding "
            f"({embedding_rows} rows) has no spare row for one; set 'pad_token' in "
            "tokenizer_config.json to an unused special token"
        )
    config = json.loads(config_bytes) if config_bytes else {}
    config["pad_token"] = pad
    config_bytes = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
    return HFTokenizer(tokenizer_json, config_bytes, side_files)


def side_files(folder: str) -> dict[str, bytes]:
    """The :data:`SIDE_FILES` of a Hugging Face folder that exist, by name."""
    paths = {name: fileio.join(folder, name) for name in SIDE_FILES} if folder else {}
    return {name: fileio.read_bytes(path) for name, path in paths.items() if fileio.exists(path)}


def model_embedding_rows(directory: str) -> int | None:
    """The embedding rows of a Hugging Face model folder (config.json ``vocab_size``), or None
    when ``directory`` holds no model config (a tokenizer-only folder)."""
    path = fileio.join(directory, "config.json")
    if not fileio.exists(path):
        return None
    try:
        config = json.loads(fileio.read_text(path))
    except ValueError as error:
        raise TokenizerError(f"{path} is not valid JSON ({error}); download it again") from None
    if isinstance(config, dict) and isinstance(config.get("text_config"), dict):
        config = config["text_config"]  # a multimodal checkpoint: its language model's
    rows = config.get("vocab_size") if isinstance(config, dict) else None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else None


def _load_saved(directory: str) -> Tokenizer:
    info = json.loads(fileio.read_text(fileio.join(directory, INFO_FILE)))
    if info.get("schema_version") != SCHEMA_VERSION:
        raise TokenizerError(
            f"tokenizer {directory}: schema_version {info.get('schema_version')} is not "
            f"{SCHEMA_VERSION}; re-run the shard stage with this alignpipe version"
        )
    tokenizer = _load_files(directory, info["kind"])
    if tokenizer.fingerprint != info["fingerprint"]:
        raise TokenizerError(
            f"tokenizer {directory}: files do not match the recorded fingerprint "
            f"{info['fingerprint']}; the folder was modified after it was written"
        )
    return tokenizer


def has_hf_tokenizer(directory: str) -> bool:
    """Whether ``directory`` holds ``tokenizer.json`` or Mistral's ``tekken.json``."""
    return any(fileio.exists(fileio.join(directory, f)) for f in ("tokenizer.json", "tekken.json"))


def hf_tokenizer_files(directory: str) -> tuple[bytes, bytes | None]:
    """A Hugging Face folder's ``tokenizer.json`` and ``tokenizer_config.json`` (or None); a
    ``tekken.json`` alone converted as transformers converts it (core/data/tekken.py)."""
    from components.core.data import tekken

    config_path = fileio.join(directory, "tokenizer_config.json")
    config = fileio.read_bytes(config_path) if fileio.exists(config_path) else None
    json_path = fileio.join(directory, "tokenizer.json")
    if fileio.exists(json_path):
        return fileio.read_bytes(json_path), config
    try:
        converted = tekken.tokenizer_from_tekken(
            fileio.read_text(fileio.join(directory, tekken.FILE))
        )
    except tekken.TekkenError as error:
        raise TokenizerError(f"{directory}/{tekken.FILE}: {error}") from None
    if config is None:
        template_path, template = fileio.join(directory, "chat_template.json"), None
        if fileio.exists(template_path):
            template = json.loads(fileio.read_text(template_path)).get("chat_template")
        config = json.dumps(tekken.tokenizer_config(template)).encode("utf-8")
    return converted.to_str().encode("utf-8"), config


def _load_files(directory: str, kind: str) -> Tokenizer:
    if kind == "byte":
        return ByteTokenizer()
    if kind == "hf":
        tokenizer_json, config = hf_tokenizer_files(directory)
        side = side_files(directory)
        rows = model_embedding_rows(directory)
        if rows is None:
            return HFTokenizer(tokenizer_json, config, side)
        # A model folder: its tokenizer as the model uses it (a pad that fits the embedding).
        return fit_to_embedding(tokenizer_json, config, rows, directory, side)
    if kind == "sentencepiece":
        return SentencePieceTokenizer(fileio.read_bytes(fileio.join(directory, "tokenizer.model")))
    raise TokenizerError(f"tokenizer {directory}: unknown kind {kind!r}")


BUILTIN_WORDS = "builtin-words"
# The built-in tasks' word-level tokenizers, by spec: (module, function giving their files).
BUILTIN_TOKENIZERS = {
    BUILTIN_WORDS: ("builtin_task", "word_tokenizer_files"),
    "builtin-arithmetic": ("reasoning_task", "reasoning_tokenizer_files"),
}


def load_tokenizer(spec: str) -> Tokenizer:
    """Load a tokenizer from ``"byte"``, a built-in task's word-level one (BUILTIN_TOKENIZERS),
    a saved folder, an alignpipe model folder (its ``tokenizer/``), a HF folder
    (a model folder's as :func:`fit_to_embedding` fits it) or ``tokenizer.json``, or a
    SentencePiece ``.model``.

    A file the libraries cannot parse is a :class:`TokenizerError` naming it: ``tokenizers``
    raises a bare ``Exception`` ("Model missing"), SentencePiece a ``RuntimeError``.
    """
    try:
        return _load_tokenizer(spec)
    except TokenizerError:
        raise
    except Exception as error:  # noqa: BLE001 - see the docstring
        raise TokenizerError(
            f"tokenizer {spec}: cannot be read ({type(error).__name__}: {error}); pass a "
            "Hugging Face tokenizer.json, a SentencePiece .model, a folder holding one, or 'byte'"
        ) from error


def _load_tokenizer(spec: str) -> Tokenizer:
    if spec in ("", "byte"):
        return ByteTokenizer()
    if spec in BUILTIN_TOKENIZERS:
        module, files = BUILTIN_TOKENIZERS[spec]
        task = importlib.import_module(f"components.core.data.{module}")
        return HFTokenizer(*getattr(task, files)())
    if fileio.isdir(spec):
        if fileio.exists(fileio.join(spec, INFO_FILE)):
            return _load_saved(spec)
        if fileio.exists(fileio.join(spec, MODEL_TOKENIZER_DIR, INFO_FILE)):
            return _load_saved(fileio.join(spec, MODEL_TOKENIZER_DIR))  # an alignpipe model
        if has_hf_tokenizer(spec):
            return _load_files(spec, "hf")
        if fileio.exists(fileio.join(spec, "tokenizer.model")):
            return _load_files(spec, "sentencepiece")
        raise TokenizerError(
            f"tokenizer {spec}: the folder holds no tokenizer.json, tokenizer.model or "
            f"{INFO_FILE}; pass 'byte' or a Hugging Face / SentencePiece tokenizer"
        )
    if not fileio.exists(spec):
        raise TokenizerError(f"tokenizer {spec}: no such file or folder; pass 'byte' or a path")
    if spec.endswith(".json"):
        folder = os.path.dirname(spec)
        config_path = fileio.join(folder, "tokenizer_config.json") if folder else ""
        config = (
            fileio.read_bytes(config_path) if config_path and fileio.exists(config_path) else None
        )
        return HFTokenizer(fileio.read_bytes(spec), config, side_files(folder))
    if spec.endswith(".model"):
        return SentencePieceTokenizer(fileio.read_bytes(spec))
    raise TokenizerError(
        f"tokenizer {spec}: unrecognised file; expected tokenizer.json (Hugging Face) or a "
        "SentencePiece .model file"
    )
