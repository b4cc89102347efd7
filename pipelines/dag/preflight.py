"""A local run's inputs on this machine, checked before any task runs.

``params.validate`` checks the parameters' values; these checks look at what the local
paths among them point to (the data files, the tokenizer, the policies and models, the
promotion root), with the validators the tasks themselves use, so that a typo fails in
a second naming its flag instead of after minutes of sharding and training. A ``gs://``
URI is left to the task that reads it: nothing here reaches the network.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from typing import Any, NamedTuple

from components.core import fileio
from components.core.model.heads import require_head
from components.core.training import trackers
from pipelines import stage_io
from pipelines.dag import params
from pipelines.releases import policies, promotion, realign


class PreflightError(ValueError):
    """A local input the run would fail on; the message names its flag and the fix."""


def flag(name: str) -> str:
    """The command-line flag of a pipeline parameter (``base_policy`` → ``--base-policy``)."""
    return "--" + name.replace("_", "-")


def is_local(uri: str) -> bool:
    """Whether ``uri`` is a path on this machine (not gs:// or another scheme)."""
    return "://" not in uri


def check(values: dict[str, Any]) -> None:
    """Refuse the first local input the run would fail on; ``values`` as params.validate
    returns them (every parameter, defaults filled in)."""
    for name, checker in CHECKS.items():
        value = values[name]
        if not value or not is_local(value) or not _applies(name, values):
            continue
        try:
            checker(value, values)
        except (ValueError, FileNotFoundError) as error:  # TokenizerError is a ValueError
            raise PreflightError(f"{flag(name)}: {error}") from None
    try:
        check_data_kind(values)
        check_heldout_kind(values)
        check_sft_kind(values)
        check_tokenizers(values)
        check_chat_template(values)
    except (ValueError, FileNotFoundError) as error:
        raise PreflightError(str(error)) from None
    try:  # the trackers' packages, here where the local run's tasks import them
        trackers.require_installed(trackers.parse_report_to(values["report_to"]))
    except ValueError as error:
        raise PreflightError(
            f"{flag('report_to')}: {str(error).removeprefix('report_to: ')}"
        ) from None


# The models a run reads, whose token ids must be the shards'.
MODEL_PARAMS = ("base_policy", "reward_base_policy", "anchor_policy", "eval_reward_model")


def check_tokenizers(values: dict[str, Any]) -> None:
    """Every given model must use the tokenizer the shards will be made with: ``tokenizer``
    when set, else the base policy's, else the data's.

    A model trained on other token ids would fail only in its task, after sharding and the
    training before it; here it fails at once, naming both sides. Remote inputs are left
    to the tasks.
    """
    from components.core.data.tokenizers import load_tokenizer

    given = [n for n in MODEL_PARAMS if values[n] and _applies(n, values)]
    if any(not is_local(values[n]) for n in (*given, "tokenizer") if values[n]):
        return  # the shards' tokenizer, or a model's, lies where only the tasks look
    spec, origin = _shards_tokenizer(values)
    if spec is None:
        return
    shards = load_tokenizer(spec).fingerprint
    for name in given:
        own = model_tokenizer_fingerprint(values[name])
        if own != shards:
            raise PreflightError(
                f"{flag(name)}: {values[name]!r} uses tokenizer {own}, but the shards would use "
                f"{shards} ({origin}); every model of a run must share the shards' tokenizer: "
                f"pass models that share one, or --tokenizer with {flag(name)}'s own"
            )


class FirstRecord(NamedTuple):
    """The first record of a data parameter's first local file, as the shard stage reads it
    (``components.shard.sources``); line 0 and no format if the file holds none."""

    uri: str
    line: int
    raw: str | None
    parsed: Any
    fmt: str | None


def _first_record(
    data_uri: str, data_format: str, name: str = "data_uri", columns: dict | None = None
) -> FirstRecord:
    """The first record of the ``name`` parameter's first local file (its format read with
    ``columns`` renamed)."""
    from components.shard.sources import read_source

    first = stage_io.find_sources(data_uri, name)[0]["uri"]
    bundle = next(read_source(first, data_format, 1, columns), None)
    if not isinstance(bundle, list) or not bundle:
        return FirstRecord(first, 0, None, None, None)
    return FirstRecord(first, *bundle[0])


def check_data_kind(values: dict[str, Any]) -> None:
    """Refuse data the run cannot train on, before any task: prompt-completion data as the
    run's data (it trains sft alone: ``sft_data_uri``), and prompt-only data (TRL's
    ``{"prompt": ...}`` records) unless reward functions alone score the rollouts
    (``train_reward_model`` false; the reward model and DPO train on pairs), there is a
    policy to start from (``base_policy``, or sft on ``sft_data_uri``) and the responses'
    length is given (``max_new_tokens``, ``eval_max_new_tokens``)."""
    from components.shard.formats import COMPLETION_FORMATS, PROMPT_FORMATS

    data_uri = values["data_uri"]
    if not data_uri or not _applies("data_uri", values):
        return
    first, line, _, _, fmt = _first_record(
        data_uri, values["data_format"], columns=_columns(values["data_columns"])
    )
    if fmt in COMPLETION_FORMATS:
        raise PreflightError(
            f"{flag('data_uri')}: {first} line {line} is a prompt-completion record ({fmt}): "
            "one response each, which trains the sft stage only, not the reward model or DPO. "
            f"Fix: give them as {flag('sft_data_uri')} (the sft stage's own data) beside "
            "preference pairs or prompts"
        )
    if fmt not in PROMPT_FORMATS:
        return
    fixes = []
    if values["algorithm"] == "dpo" or values["train_reward_model"]:
        fixes.append(
            f"{flag('train_reward_model')} false and {flag('reward_functions')} to score the "
            "rollouts (ppo, grpo or rloo; the reward model and DPO train on preference pairs)"
        )
    if not values["base_policy"] and not values["sft_data_uri"]:
        fixes.append(
            f"{flag('base_policy')} (the policy to start from) or {flag('sft_data_uri')} "
            "(formatted solutions the sft stage trains one on)"
        )
    unsized = [name for name in ("max_new_tokens", "eval_max_new_tokens") if not values[name]]
    if unsized:
        fixes.append(
            " and ".join(flag(name) for name in unsized) + " (0 takes the longest response in "
            "the data, and prompts come without responses), e.g. 256"
        )
    if fixes:
        raise PreflightError(
            f"{flag('data_uri')}: {first} line {line} is a prompt-only record ({fmt}). Fix: "
            "give " + "; and ".join(fixes)
        )


def check_heldout_kind(values: dict[str, Any]) -> None:
    """Refuse held-out data that is not preference pairs: the held-out reward model trains
    on (prompt, chosen, rejected) alone."""
    from components.shard.formats import COMPLETION_FORMATS, PROMPT_FORMATS

    uri = values["heldout_data_uri"]
    if not uri or not _applies("heldout_data_uri", values):
        return
    first, line, _, _, fmt = _first_record(
        uri, values["data_format"], "heldout_data_uri", _columns(values["data_columns"])
    )
    if fmt in (*COMPLETION_FORMATS, *PROMPT_FORMATS):
        kind = "prompt-completion" if fmt in COMPLETION_FORMATS else "prompt-only"
        raise PreflightError(
            f"{flag('heldout_data_uri')}: {first} line {line} is a {kind} record ({fmt}); the "
            "held-out reward model trains on preference pairs (prompt, chosen, rejected). "
            "Fix: give other annotators' pairs, or leave it ''"
        )


def check_sft_kind(values: dict[str, Any]) -> None:
    """Refuse sft data of prompts alone: the sft stage trains on a response (a completion,
    or a pair's chosen one)."""
    from components.shard.formats import PROMPT_FORMATS

    uri = values["sft_data_uri"]
    if not uri or not all(is_local(p) for p in _patterns(uri)):
        return
    columns = _columns(values["sft_data_columns"] or values["data_columns"])
    first, line, _, _, fmt = _first_record(uri, values["data_format"], "sft_data_uri", columns)
    if fmt in PROMPT_FORMATS:
        raise PreflightError(
            f"{flag('sft_data_uri')}: {first} line {line} is a prompt-only record ({fmt}); the "
            "sft stage trains on responses (prompt-completion records or pairs). Fix: give "
            f"the response column its name, e.g. {flag('sft_data_columns')} "
            '\'{"question": "prompt", "answer": "completion"}\''
        )


def check_chat_template(values: dict[str, Any]) -> None:
    """Render the first record of the data (``data_uri``, then ``heldout_data_uri``) with
    the shards' chat template (its arguments and the system-message rule included) before
    the Beam job: a template that refuses the data's shape (Gemma 2's "System role not
    supported") stops the run here with the template's own message and the fix, not after
    every record went to rejected/."""
    from components.shard.config import ShardConfig

    # Not the built-in task, nor remote data (only its task lists it).
    given = [name for name in ("data_uri", "heldout_data_uri") if values[name]]
    local = [name for name in given if _applies(name, values)]
    if not local:
        return
    spec, origin = _shards_tokenizer(values)
    if spec is None or not is_local(spec):
        return
    config = ShardConfig(
        format=values["data_format"],
        chat_template_kwargs=values["chat_template_kwargs"],
        system_message=values["system_message"],
        columns=values["data_columns"],
    )
    for name in local:
        _render_first(name, values[name], spec, origin, config)


def _render_first(name: str, uri: str, spec: str, origin: str, config: Any) -> None:
    """Render the first record of the ``name`` parameter's first file, if conversational
    (an empty file is the shard stage's to report)."""
    from components.core.data.tokenizers import load_tokenizer
    from components.shard.formats import Invalid, to_text_pair
    from components.shard.invalid import renamed

    first, line, raw, obj, fmt = _first_record(uri, config.format, name, config.column_map())
    if fmt != "conversational" or isinstance(obj, Invalid):
        return
    try:
        record = renamed(json.loads(raw) if obj is None else obj, config.column_map())
        to_text_pair(
            record, fmt, load_tokenizer(spec), config.template_kwargs(), config.system_message
        )
    except Invalid as invalid:
        if invalid.reason != "chat_template":
            return  # one bad record goes to rejected/ with its reason
        raise PreflightError(
            f"{flag(name)}: {first} line {line}: the chat template of {origin} refuses "
            f"the data: {invalid.detail}. Fix: {flag('system_message')} fold (the system "
            "message into the first user turn) or drop, if the template has no system role; "
            "else give data in the shape the template takes"
        ) from None


def _columns(columns: str) -> dict[str, str]:
    """A column renaming (``data_columns``, ``sft_data_columns``) as the shard stage reads
    it, old name to new."""
    from components.shard.config import ShardConfig

    return ShardConfig(columns=columns).column_map()


def _shards_tokenizer(values: dict[str, Any]) -> tuple[str | None, str]:
    """The tokenizer spec the shard stage will use (policies.shards_tokenizer) and where it
    comes from, as words; None when it depends on remote data (listed by the task)."""
    if values["tokenizer"]:
        return values["tokenizer"], f"{flag('tokenizer')} {values['tokenizer']}"
    if values["base_policy"]:
        return policies.model_tokenizer(values["base_policy"], "base_policy"), (
            f"{flag('base_policy')}'s own"
        )
    if not values["data_uri"]:
        from components.core.data.tokenizers import BUILTIN_WORDS

        return BUILTIN_WORDS, "the built-in task's"
    if not _applies("data_uri", values):
        return None, ""
    return stage_io.data_tokenizer([]), "the data's default"


def model_tokenizer_fingerprint(folder: str) -> str:
    """The fingerprint of the tokenizer a model folder was made with: an alignpipe model's
    config.json records it; a Hugging Face folder's is read (fitted to its embedding)."""
    import json

    from components.core.data.tokenizers import load_tokenizer
    from components.core.model.hf_folder import is_hf_dir

    folder = promotion.resolve_policy(folder)
    if is_hf_dir(folder):
        return load_tokenizer(folder).fingerprint
    info = json.loads(fileio.read_text(fileio.join(folder, "config.json")))
    return str(info.get("tokenizer", {}).get("fingerprint"))


def _applies(name: str, values: dict[str, Any]) -> bool:
    """Whether the run reads the parameter: the reward stage's base only when it trains."""
    if name == "reward_base_policy":
        return "reward" in params.trained_stages(values)
    if name in ("data_uri", "heldout_data_uri"):  # one remote pattern: the task lists them
        return all(is_local(p) for p in _patterns(values[name]))  # all, with credentials
    return True


def _patterns(data_uri: str) -> list[str]:
    """The comma-separated paths or globs of ``data_uri``."""
    return [p.strip() for p in data_uri.split(",") if p.strip()]


def _data(data_uri: str, values: dict[str, Any]) -> None:
    """At least one file, as find-data lists them (a folder: a Hugging Face dataset's train
    split, hf_datasets.dataset_files)."""
    stage_io.find_sources(data_uri)


def _heldout_data(heldout_data_uri: str, values: dict[str, Any]) -> None:
    """At least one file, as find-data lists them (``_data``)."""
    stage_io.find_sources(heldout_data_uri, "heldout_data_uri")


def _tokenizer(spec: str, values: dict[str, Any]) -> None:
    """The shard stage's own loader; built-in names need no file."""
    from components.core.data.tokenizers import load_tokenizer

    load_tokenizer(spec)


def _exists(path: str, expected: str) -> None:
    """Refuse a path that does not exist, saying what to pass instead."""
    if not fileio.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist; pass {expected}")


def _base_policy(path: str, values: dict[str, Any]) -> None:
    """A policy folder, a Hugging Face folder or a promotion root (its current version), as
    check-policy sees it; a Hugging Face folder passes every check of its import."""
    _exists(
        path,
        "a policy folder written by the sft, ppo, dpo or promote stage (config.json + params/), "
        "a Hugging Face model folder, a promoted_policy_uri (its current version), or '' to "
        "train one with sft",
    )
    policies.check_policy(path)
    _hf_folder(promotion.resolve_policy(path))


def _reward_base(path: str, values: dict[str, Any]) -> None:
    """A model artifact or a Hugging Face folder: either holds a config.json; a Hugging Face
    folder passes every check of its import."""
    expected = "a model folder (an alignpipe model or a Hugging Face checkpoint), or ''"
    _exists(path, expected)
    if not fileio.exists(fileio.join(path, "config.json")):
        raise FileNotFoundError(f"{path!r} has no config.json; pass {expected}")
    _hf_folder(path)


def _hf_folder(path: str) -> None:
    """Run a Hugging Face folder's import checks (architecture and its options, tokenizer
    against the embedding, every tensor's name and shape), reading no weight."""
    from components.core.model.hf_folder import is_hf_dir

    if is_hf_dir(path):
        from components.hf.importer import check_hf

        check_hf(path)


def _eval_reward_model(path: str, values: dict[str, Any]) -> None:
    """A reward model folder (config.json + params/), as the reward stage writes it."""
    expected = "the reward stage's model folder (config.json + params/, e.g. <run>/reward/model)"
    _exists(path, expected)
    for name in promotion.POLICY_FILES:
        if not fileio.exists(fileio.join(path, name)):
            raise FileNotFoundError(f"{path!r} has no {name}; pass {expected}")
    require_head(path, scalar=True, flag="eval_reward_model")


def _anchor(path: str, values: dict[str, Any]) -> None:
    """A policy folder or a promotion root, as plan-run resolves it."""
    _exists(path, "a policy folder, a promoted_policy_uri, or '' for the first promoted version")
    realign.anchor_folder(path, values["promoted_policy_uri"])


def _promoted_root(path: str, values: dict[str, Any]) -> None:
    """A folder (made on the first promotion); an existing one must read as a promotion root."""
    if fileio.exists(path) and not fileio.isdir(path):
        raise PreflightError(
            f"{path!r} is a file; pass a folder for the promoted versions (made when missing)"
        )
    if fileio.isdir(path):
        promotion.read_history(path)


def _beam_args(text: str, values: dict[str, Any]) -> None:
    """Shell-style options, split as the shard task splits them."""
    try:
        shlex.split(text)
    except ValueError as error:
        raise PreflightError(
            f"{text!r} does not split into options ({error}); quote as in a shell, e.g. "
            "--beam-args='--runner=DataflowRunner --project=P'"
        ) from None


CHECKS: dict[str, Callable[[str, dict[str, Any]], None]] = {
    "data_uri": _data,
    "heldout_data_uri": _heldout_data,
    "tokenizer": _tokenizer,
    "base_policy": _base_policy,
    "reward_base_policy": _reward_base,
    "eval_reward_model": _eval_reward_model,
    "promoted_policy_uri": _promoted_root,
    "anchor_policy": _anchor,
    "beam_args": _beam_args,
}
