"""docs/parameters.md holds the parameter table the code generates (defaults: the configs)."""

from __future__ import annotations

from pathlib import Path

from pipelines.dag.params import markdown_table

PARAMETERS = Path(__file__).resolve().parent.parent / "docs" / "parameters.md"


def test_parameter_table_matches_the_configs() -> None:
    # Regenerate with: python -c "from pipelines.dag.params import markdown_table as t; print(t())"
    assert markdown_table() in PARAMETERS.read_text(encoding="utf-8")
