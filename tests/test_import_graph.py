"""The import graph of ``components/`` and ``pipelines/``: no cycles, and few floors.

Read statically (ast), every import counted wherever it sits, a function body's too: a
lazy import is still an arrow between two modules, and a cycle through one is a knot a
reader has to untie. An import of ``a.b`` by name counts as an arrow to the module
``a.b`` (or to the package ``a`` when ``b`` is a name in it, not a module).
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("components", "pipelines")
# The most floors (modules on one import chain) each may stack: ``pipelines`` alone, and the
# whole tree (a pipelines chain ends in a stage's, e.g. evaluate -> ... -> core.flags).
MAX_PIPELINES_CHAIN = 10
MAX_CHAIN = 21


def module_files() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Each module's arrows to the other modules of the packages."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in node.names:
                    submodule = f"{base}.{alias.name}"
                    targets.add(submodule if submodule in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle (its modules, the first repeated at the end), or [] when none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def longest_chain(graph: dict[str, set[str]], within: str = "") -> list[str]:
    """The longest import chain among the modules named ``within``* (the graph has no cycle)."""
    inside = {node for node in graph if node.startswith(within)}

    @cache
    def chain_from(node: str) -> tuple[str, ...]:
        below = [chain_from(target) for target in sorted(graph[node] & inside)]
        return (node, *max(below, key=len, default=()))

    return list(max((chain_from(node) for node in sorted(inside)), key=len))


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_longest_import_chain_stays_short():
    graph = import_graph()
    for within, most in (("pipelines", MAX_PIPELINES_CHAIN), ("", MAX_CHAIN)):
        chain = longest_chain(graph, within)
        print(f"longest chain in {within or 'the tree'} ({len(chain)}): " + " -> ".join(chain))
        assert len(chain) <= most, " -> ".join(chain)


def test_cli_modules_import_no_other_command_module():
    """Commands share flags through cli/options.py only; main.py alone knows every module."""
    graph = import_graph()
    shared = {"pipelines.cli", "pipelines.cli.options"}
    for name, targets in graph.items():
        if name.startswith("pipelines.cli.") and name != "pipelines.cli.main":
            crossing = {t for t in targets if t.startswith("pipelines.cli")} - shared
            assert not crossing, f"{name} imports {sorted(crossing)}"


def test_help_lists_every_command_once_by_group(capsys):
    from pipelines.cli.main import GROUPS, build_parser, commands

    text = build_parser().format_help()
    table = commands()
    assert len({c.name for c in table}) == len(table)
    assert {c.group for c in table} == set(GROUPS)
    for command in table:
        assert f"    {command.name} " in text
    positions = [text.index(f"  {group} (") for group in GROUPS]
    assert positions == sorted(positions)
    assert text.startswith("usage: alignpipe [-h] COMMAND ...")


def test_a_command_usage_names_only_its_own_path(capsys):
    from pipelines.cli.main import main

    with pytest.raises(SystemExit):
        main(["model", "export", "--help"])
    assert capsys.readouterr().out.startswith("usage: alignpipe model export [-h]")


def test_graph_reads_lazy_and_relative_imports():
    graph = import_graph()
    # A function-level import is an arrow too: check-policy's task imports stage_io lazily.
    assert any(target.startswith("pipelines") for target in graph["pipelines.demo"])
    assert "components.core.fileio" in graph["components.core.model.hf_folder"]
