"""Logit parity with transformers at long context, per Hugging Face family fixture.

Each fixture of tests/fixtures/hf (tiny random weights saved by transformers' own classes)
is copied with ``max_position_embeddings`` raised to hold the longest length, imported
with alignpipe, and run on the same random tokens as ``transformers`` runs it (fp32, eager
attention); the largest absolute logit difference is printed per length. The fixtures'
sliding windows are 4 tokens, so at these lengths the local layers attend through windows
that move across nearly every position, and Gemma 3's two rotary tables are both long.

    python benchmarks/bench_hf_parity.py [--lengths 512,2048] [--families qwen3,gemma3]

Needs torch and transformers (the test extra).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile
import time

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from components.core.model.artifact import load_model
from components.hf.importer import import_hf

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
FAMILIES = (
    "llama", "qwen2", "gemma2", "qwen3", "qwen3_untied", "mistral", "gemma3", "gemma3_mm",
    "qwen3_5", "qwen3_5_mm", "gemma4", "gemma4_mm", "ministral3", "ministral3_mm", "mistral4_mm",
)  # fmt: skip


def long_copy(family: str, length: int, root: pathlib.Path) -> pathlib.Path:
    """The fixture with room for ``length`` positions (nothing else changed)."""
    folder = root / family
    shutil.copytree(FIXTURES / family, folder)
    config = json.loads((folder / "config.json").read_text())
    target = config.get("text_config", config)
    target["max_position_embeddings"] = length
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def transformers_logits(folder: pathlib.Path, tokens: np.ndarray, multimodal: bool) -> np.ndarray:
    auto = (
        transformers.AutoModelForImageTextToText
        if multimodal
        else transformers.AutoModelForCausalLM
    )
    model = auto.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.set_num_threads(2)
    print(f"{'family':<14}" + "".join(f"{'max |diff| @' + str(n):>18}" for n in lengths) + "   s")
    for family in args.families.split(","):
        started, row = time.perf_counter(), []
        with tempfile.TemporaryDirectory() as tmp:
            root = pathlib.Path(tmp)
            folder = long_copy(family, max(lengths), root)
            model, _ = load_model(
                import_hf(str(folder), str(root / "artifact"))["out"], dtype="float32"
            )
            vocab = load_vocab(folder)
            for length in lengths:
                tokens = np.random.default_rng(length).integers(0, vocab, size=(1, length))
                theirs = transformers_logits(folder, tokens, family.endswith("_mm"))
                ids = jnp.asarray(tokens, jnp.int32)
                ours = np.asarray(model.lm_logits(model(ids, jnp.ones_like(ids))))
                row.append(float(np.abs(ours - theirs).max()))
        cells = "".join(f"{diff:>18.2e}" for diff in row)
        print(f"{family:<14}{cells}   {time.perf_counter() - started:.0f}")


def load_vocab(folder: pathlib.Path) -> int:
    """Token ids the tokenizer has (the embedding may hold more rows)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(
        with_added_tokens=True
    )


if __name__ == "__main__":
    main()
