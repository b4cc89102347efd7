"""Model shapes the benchmarks share: the demo preset's, and a real-shaped one scaled to CPU."""

from __future__ import annotations

from typing import Any, NamedTuple

# The demo preset's widths (components/core/model/presets.py), as TRL's LlamaConfig takes them.
DEMO = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, hidden_dim=384)
# Twice the demo's width, heads of 64 like Llama's, two layers (twice the demo's parameters):
# at 256-token responses, 4 layers made one PPO iteration take minutes on 2 CPU cores.
REAL = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=768)


class Shape(NamedTuple):
    """A benchmark's model widths (overrides of the demo preset) and batch shape."""

    name: str
    model: dict[str, Any]
    batch: int  # sequences
    prompt: int  # tokens
    response: int  # tokens


# Real-shaped rollouts: 64-token prompts, 256-token responses.
REAL_PROMPT, REAL_RESPONSE = 64, 256
