"""Run configuration files: the pipeline parameters as YAML, nested by stage.

``alignpipe run|compile|submit|schedule|plan --config run.yaml`` reads one; flags given
beside it override it, and ``alignpipe config dump`` writes one with every default. The
table is the flags' (``param_table.PARAMS``), so no second list of parameters exists: a
parameter that sets one stage's config field sits under that stage by the field's name
(``ppo: {rollout_batch_size: 64}`` is ``--ppo-rollout-batch-size 64``); one shared by
several stages (``seed``, ``max_len``) or owned by the pipeline (``data_uri``) at the top.
A parameter's flat name is taken anywhere at the top too (``ppo_rollout_batch_size: 64``).

Written with the table already here rather than a config library (jsonargparse, tyro):
they would parse the stage dataclasses again, where the pipeline's parameters are a
table over them with their own names, defaults and shared fields; this is 100 lines.
"""

from __future__ import annotations

import difflib
from typing import Any

import yaml

from components.core import fileio
from pipelines.dag import param_table, params

SECTIONS = ("shard", "sft", "reward", "ppo", "dpo", "evaluate")


class ConfigFileError(ValueError):
    """A config file the pipeline cannot read, with the key and the fix."""


def placement() -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """Where each parameter sits: ``{param: (section, key)}`` for those under a stage,
    ``{param: param}`` (top level) for the rest; and the reverse ``{"section.key": param}``."""
    where, reverse = {}, {}
    for param in param_table.PARAMS:
        stages = {stage for stage, _ in param.targets}
        if len(stages) == 1 and len(param.targets) == 1:
            section, key = param.targets[0]
            where[param.name] = (section, key)
            reverse[f"{section}.{key}"] = param.name
        else:
            where[param.name] = ("", param.name)
            reverse[param.name] = param.name
    return where, reverse


def read(path: str) -> dict[str, Any]:
    """The parameter values a config file sets, by parameter name, in their types."""
    try:
        data = yaml.safe_load(fileio.read_text(path)) or {}
    except FileNotFoundError:
        raise ConfigFileError(f"--config {path}: no such file") from None
    except yaml.YAMLError as error:
        raise ConfigFileError(f"--config {path}: not YAML ({error})") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config {path}: expected a mapping of parameters, got {data!r}")
    _, reverse = placement()
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS and isinstance(value, dict):
            for field, inner in value.items():
                values[_name(path, reverse, f"{key}.{field}")] = inner
        elif key in SECTIONS:
            raise ConfigFileError(f"--config {path}: {key} must hold a mapping of its parameters")
        else:
            values[_name(path, reverse, str(key))] = value
    return {name: _typed(path, name, value) for name, value in values.items()}


def _name(path: str, reverse: dict[str, str], key: str) -> str:
    """The parameter a key names: ``section.field`` or a flat parameter name at the top."""
    if key in reverse:
        return reverse[key]
    if "." not in key and key in params.BY_NAME:  # a flat name, at the top level
        return key
    field = key.rpartition(".")[2]
    if "." in key and field in params.BY_NAME:
        place = placement()[0][field]
        where = f"{place[0]}.{place[1]}" if place[0] else f"the top level as {field}"
        raise ConfigFileError(f"--config {path}: {key} is {field}, which sits at {where}")
    close = difflib.get_close_matches(key, [*reverse, *params.BY_NAME], n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]}?" if close else "; `alignpipe config dump` lists them all"
    raise ConfigFileError(f"--config {path}: unknown parameter {key}{hint}")


def _typed(path: str, name: str, value: Any) -> Any:
    """``value`` in the parameter's type: YAML's own where it is one, else read as a flag."""
    kind = params.BY_NAME[name].type()
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, (dict, list)) or value is None:
        raise ConfigFileError(f"--config {path}: {name} takes a {kind.__name__}, got {value!r}")
    try:
        return params.coerce(name, str(value).lower() if isinstance(value, bool) else str(value))
    except params.ParamError as error:
        raise ConfigFileError(f"--config {path}: {error}") from None


def dump(values: dict[str, Any] | None = None) -> str:
    """A config file of every parameter (``values`` over the defaults), nested by stage, each
    with its help as a comment."""
    values = values or {}
    where, _ = placement()
    sections: dict[str, list[str]] = {"": [], **{s: [] for s in SECTIONS}}
    for param in param_table.PARAMS:
        section, key = where[param.name]
        value = values.get(param.name, param.default_value())
        text = yaml.safe_dump({key: value}, default_flow_style=True, width=10**6).strip()[1:-1]
        indent = "  " if section else ""
        help_text = " ".join(param.help_text().split())
        sections[section].append(f"{indent}# {help_text}")
        sections[section].append(f"{indent}{text}")
    lines = ["# alignpipe run configuration: `alignpipe run --config FILE`; flags override it."]
    lines += sections[""]
    for section in SECTIONS:
        if sections[section]:
            lines += ["", f"{section}:", *sections[section]]
    return "\n".join(lines) + "\n"
