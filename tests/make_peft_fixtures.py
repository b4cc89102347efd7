"""Write tests/fixtures/peft (run by hand; needs torch, transformers and peft: the bench extra).

Builds the LoRA policy of tests/test_peft_export.py (``lora_policy``), exports it with
alignpipe's ``export_peft``, loads the base folder with ``transformers`` and the adapter
folder with ``peft.PeftModel.from_pretrained``, and stores the adapter files peft loaded
and peft's fp32 logits on fixed tokens::

    .venv/bin/python tests/make_peft_fixtures.py

It also checks, and prints, that alignpipe's own logits, the merged export loaded by
transformers, and the adapter peft saves back all agree with what peft computed.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile

import numpy as np
import peft
import torch
import transformers

TESTS = pathlib.Path(__file__).resolve().parent
OUT = TESTS / "fixtures" / "peft"
SEQ_LEN = 8
sys.path[:0] = [str(TESTS.parent), str(TESTS)]

from test_peft_export import BASE_MODEL, logits, lora_policy, read_tensors  # noqa: E402

from components.core.model.artifact import load_model  # noqa: E402
from components.hf.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_peft  # noqa: E402


def hf_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy().astype(np.float32)


def load_hf(folder: pathlib.Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )


def main() -> None:
    """Export, load with peft, write the fixture and print the measured differences."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        policy, tokenizer = lora_policy(tmp)
        out = root / "hf"
        export_peft(policy, str(out), tokenizer_dir=tokenizer, dtype="float32",
                    base_model=BASE_MODEL)  # fmt: skip
        vocab = json.loads((out / "config.json").read_text())["vocab_size"]
        tokens = np.random.default_rng(1).integers(0, vocab, size=(2, SEQ_LEN))
        adapted = peft.PeftModel.from_pretrained(load_hf(out / "base"), out / "adapter")
        expected = hf_logits(adapted, tokens)
        ours = logits(load_model(policy)[0], tokens)
        merged = hf_logits(load_hf(out), tokens)
        base = hf_logits(load_hf(out / "base"), tokens)
        adapted.save_pretrained(root / "resaved")
        ours_tensors = read_tensors(out / "adapter" / ADAPTER_WEIGHTS)
        resaved = read_tensors(root / "resaved" / ADAPTER_WEIGHTS)
        same = sorted(resaved) == sorted(ours_tensors) and all(
            np.array_equal(resaved[name], ours_tensors[name]) for name in ours_tensors
        )
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir(parents=True)
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copy(out / "adapter" / name, OUT / name)
        np.savez_compressed(OUT / "reference.npz", tokens=tokens, logits=expected)
    print(f"peft {peft.__version__}, transformers {transformers.__version__}, "
          f"torch {torch.__version__}")  # fmt: skip
    print(f"max |alignpipe - peft| logits:        {np.abs(ours - expected).max():.2e}")
    print(f"max |merged export - peft| logits:    {np.abs(merged - expected).max():.2e}")
    print(f"max |base - peft| logits (adapters):  {np.abs(base - expected).max():.2e}")
    print(f"peft's save_pretrained gives our adapter tensors back: {same}")
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT} ({total / 1024:.0f} KiB)")
    assert same and np.abs(ours - expected).max() < 1e-4


if __name__ == "__main__":
    main()
