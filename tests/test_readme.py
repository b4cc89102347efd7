"""The README's parameter table is the one the code generates (defaults live in the configs)."""

from __future__ import annotations

from pathlib import Path

from pipelines.dag.params import markdown_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_parameter_table_matches_the_configs() -> None:
    # Regenerate with: python -c "from pipelines.dag.params import markdown_table as t; print(t())"
    assert markdown_table() in README.read_text(encoding="utf-8")
