"""The report page's building blocks: escaping, dotted lookups into the summary, figures
tagged with their path (``data-key``), intervals, inline images and who judged."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping
from typing import Any

from components.evaluate.judges import JUDGE_GOLD

# The reports' style (report.py, verifiable_report.py).
CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.text { white-space: pre-wrap; max-width: 28em; }
.verdict { padding: 0.6em 1em; border-radius: 6px; }
.blessed { background: #e6f4ea; border: 1px solid #34a853; }
.rejected { background: #fce8e6; border: 1px solid #d93025; }
.missing { color: #777; font-style: italic; }
figure { margin: 1em 0; }
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def at(tree: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` (a list's items by number), or None where it is missing."""
    node: Any = tree
    for key in path.split("."):
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        elif isinstance(node, Mapping) and key in node:
            node = node[key]
        else:
            return None
    return node


def format_figure(value: Any) -> str:
    """How the report shows a number: ints whole, floats to 4 significant digits, else n/a."""
    if isinstance(value, bool) or value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return "n/a"


def figure(summary: Mapping[str, Any], path: str, tag: str = "td") -> str:
    """One number of the summary as an element tagged with its path."""
    css = ' class="num"' if tag == "td" else ""
    text = format_figure(at(summary, path))
    return f'<{tag}{css} data-key="{esc(path)}">{esc(text)}</{tag}>'


def interval_cells(summary: Mapping[str, Any], path: str) -> str:
    low, high = figure(summary, f"{path}.low", "span"), figure(summary, f"{path}.high", "span")
    return f'<td class="num">[{low}, {high}]</td>'


def is_gold_judged(summary: Mapping[str, Any]) -> bool:
    """Whether the gold reward judged the responses (no reward model was given)."""
    return at(summary, "judge") == JUDGE_GOLD


def judge_name(summary: Mapping[str, Any]) -> str:
    """The judge as the page names it: "reward model", or the gold reward's name."""
    if is_gold_judged(summary):
        return at(summary, "gold.name") or "gold reward"
    return "reward model"


def image(png: bytes | None, caption: str, missing: str) -> str:
    if png is None:
        return f'<p class="missing">{esc(missing)}</p>'
    data = base64.b64encode(png).decode("ascii")
    return (
        f'<figure><img alt="{esc(caption)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{esc(caption)}</figcaption></figure>"
    )
