"""Functions a user names by spec: ``PATH.py:FUNCTION`` (a Python file, local or ``gs://``,
run as a fresh module) or ``MODULE:FUNCTION`` (an importable module). Gold rewards
(``data/gold.py``) and reward functions (``rewards/functions.py``) are loaded this way; each
error names what was being loaded, the spec and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from collections.abc import Callable
from typing import Any

from components.core import fileio


@dataclasses.dataclass(frozen=True)
class FunctionKind:
    """What a spec names, for the errors: ``gold reward``, its signature, built-in names."""

    what: str  # "gold reward"
    signature: str  # "(prompt: str, response: str) -> float"
    builtins: tuple[str, ...] = ()
    module_prefix: str = "alignpipe_user"  # file modules register as <prefix>.<file stem>


def split_spec(spec: str, kind: FunctionKind) -> tuple[str, str]:
    """(file or module, function) of a ``SOURCE:FUNCTION`` spec."""
    source, _, name = spec.rpartition(":")
    if not source or not name.isidentifier():
        named = f"a built-in name ({', '.join(kind.builtins)}), " if kind.builtins else ""
        raise ValueError(
            f"{kind.what} {spec!r}: expected {named}PATH.py:FUNCTION or MODULE:FUNCTION "
            "(FUNCTION a Python name); fix the spec"
        )
    return source, name


def file_namespace(spec: str, path: str, kind: FunctionKind) -> dict[str, Any]:
    """The globals of the Python file at ``path`` after running it as a fresh module."""
    if not fileio.exists(path):
        raise ValueError(
            f"{kind.what} {spec!r}: file {path} does not exist; give the path of a .py file "
            "that defines the function"
        )
    stem = "".join(c if c.isalnum() else "_" for c in path.rsplit("/", 1)[-1][: -len(".py")])
    module = types.ModuleType(f"{kind.module_prefix}.{stem}")
    module.__file__ = path
    # Registered as imported modules are, so dataclasses and pickling inside it find it.
    sys.modules[module.__name__] = module
    try:
        exec(compile(fileio.read_text(path), path, "exec"), module.__dict__)
    except Exception as error:
        raise ValueError(
            f"{kind.what} {spec!r}: running {path} failed with {type(error).__name__}: "
            f"{error}; fix the file"
        ) from error
    return module.__dict__


def module_namespace(spec: str, module_name: str, kind: FunctionKind) -> dict[str, Any]:
    """The globals of the importable module ``module_name``."""
    try:
        return vars(importlib.import_module(module_name))
    except Exception as error:
        raise ValueError(
            f"{kind.what} {spec!r}: module {module_name!r} does not import "
            f"({type(error).__name__}: {error}); install it or put it on PYTHONPATH"
        ) from error


def load_function(spec: str, kind: FunctionKind) -> Callable[..., Any]:
    """The function a ``PATH.py:FUNCTION`` or ``MODULE:FUNCTION`` spec names (unchecked)."""
    source, name = split_spec(spec, kind)
    in_file = source.endswith(".py")
    if in_file:
        namespace = file_namespace(spec, source, kind)
    else:
        namespace = module_namespace(spec, source, kind)
    where = f"file {source}" if in_file else f"module {source!r}"
    if name not in namespace:
        raise ValueError(
            f"{kind.what} {spec!r}: {where} has no function {name!r}; define "
            f"{name}{kind.signature} there or fix the name"
        )
    function = namespace[name]
    if not callable(function):
        raise ValueError(
            f"{kind.what} {spec!r}: {name!r} in {where} is a {type(function).__name__}, not a "
            f"function; define {name}{kind.signature}"
        )
    return function
