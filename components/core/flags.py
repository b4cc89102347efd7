"""Command-line flags generated from typed config dataclasses.

Each stage's config dataclass is the one place its defaults live; this module
turns its fields into ``--flag`` options (help text from field metadata) and
back, so the container entry point, the ``alignpipe`` CLI and the pipeline all
share those defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def field(default: Any = dataclasses.MISSING, *, help: str, **kwargs: Any) -> Any:
    """A dataclass field that carries its flag's help text."""
    if isinstance(default, list | dict):
        value = default
        return dataclasses.field(
            default_factory=lambda: type(value)(value), metadata={"help": help}
        )
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """The scalar type behind an annotation, and whether it is a list."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin is list:
        return typing.get_args(annotation)[0], True
    if origin is typing.Literal:
        return type(typing.get_args(annotation)[0]), False
    return annotation, False


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_config_flags(parser: argparse.ArgumentParser, config_cls: type, skip: tuple = ()) -> None:
    """Add one ``--flag`` per field of ``config_cls`` (all optional: unset keeps the default)."""
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        if f.name in skip or not f.init:
            continue
        base, is_list = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        help_text = f.metadata.get("help", "")
        choices = None
        literal = [
            a for a in typing.get_args(hints[f.name]) if typing.get_origin(a) is typing.Literal
        ]
        if typing.get_origin(hints[f.name]) is typing.Literal:
            choices = list(typing.get_args(hints[f.name]))
        elif literal:
            choices = list(typing.get_args(literal[0]))
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS}
        kwargs["help"] = f"{help_text} (default: {default!r})"
        if base is bool:
            kwargs["type"] = _parse_bool
            kwargs["nargs"] = "?"
            kwargs["const"] = True
            kwargs["metavar"] = "BOOL"
        elif is_list:
            kwargs["type"] = base
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = base
        if choices:
            kwargs["choices"] = choices
        parser.add_argument(_flag_name(f.name), **kwargs)


class _Renamed(argparse.Action):
    """An old spelling of a flag: refused, naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        parser.error(f"{option_string} is now {self.default}; pass {self.default} instead")


def add_renamed(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Refuse ``old`` (a flag renamed to ``new``) with the new name; hidden from --help."""
    parser.add_argument(
        old, action=_Renamed, nargs="?", default=new, dest="_renamed_" + old.lstrip("-"),
        help=argparse.SUPPRESS,
    )  # fmt: skip


def config_from_flags(config_cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Build ``config_cls`` from the flags that were given; the rest keep their defaults."""
    names = {f.name for f in dataclasses.fields(config_cls) if f.init}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return config_cls(**values)
