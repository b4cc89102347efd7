"""Write the Hugging Face fixtures of tests/test_hf_*.py (run by hand; needs torch + transformers).

For each family (Llama 3.1, Qwen2, Gemma 2, and Qwen3 tied and untied, Mistral; Gemma 3,
Ministral 3, Qwen3.5 and Gemma 4 text and multimodal) a tiny randomly initialised
checkpoint, saved as ``transformers`` saves it, with a byte-level BPE tokenizer, its chat
template (the newer families' in ``chat_template.jinja``, as transformers 5 saves it,
written to reproduce the real
template's structure), its stop tokens in ``generation_config.json``, reference logits
and tokenizer cases::

    .venv/bin/python tests/make_hf_fixtures.py            # (re)write tests/fixtures/hf
    .venv/bin/python tests/make_hf_fixtures.py qwen3 gemma3   # only these
    .venv/bin/python tests/make_hf_fixtures.py --verify-export

``--verify-export`` imports each fixture with alignpipe, exports it back, and
checks that ``transformers`` loads the export unchanged (model, tokenizer, chat
template) and computes the reference logits from it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np
import torch
import transformers
from hf_fixture_configs import hf_config  # tests/hf_fixture_configs.py
from hf_templates import (  # tests/hf_templates.py (this script runs from tests/)
    GEMMA3_TEMPLATE,
    GEMMA4_TEMPLATE,
    GEMMA_TEMPLATE,
    LLAMA_TEMPLATE,
    MISTRAL3_TEMPLATE,
    MISTRAL_TEMPLATE,
    QWEN3_5_TEMPLATE,
    QWEN3_TEMPLATE,
    QWEN_TEMPLATE,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
BPE_VOCAB = 300
SEQ_LEN = 8
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Reward models score the chosen reply above the rejected one.",
    "Proximal policy optimisation keeps the policy near the reference.",
    "def main():\n    return 0\n",
    "Ünïcödé, emoji 🙂 and   spaces\tand tabs.",
]
TEXT_CASES = [
    "Hello world!",
    "The policy keeps close to its reference.",
    "  leading spaces, trailing tab\t",
    "ünïcode 🙂 and numbers 12345",
    "",
]
CHAT_CASES = [
    [{"role": "user", "content": "How are you?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]

QWEN3 = dict(
    specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    stop=["<|im_end|>", "<|endoftext|>"],
    template=QWEN3_TEMPLATE,
    template_file=True,
    dtype=torch.bfloat16,
    extra_rows=20,
    shard_size="10MB",
)
GEMMA3 = dict(
    specials=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"],
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    stop=["<eos>", "<end_of_turn>"],
    template=GEMMA3_TEMPLATE,
    template_file=True,
    dtype=torch.bfloat16,
    extra_rows=8,  # Gemma 3 4B's embedding has rows past its tokenizer (262208)
    shard_size="10MB",
)

# Mistral 3's tekken specials (Ministral 3: <pad> is id 11; [IMG] its image token).
MINISTRAL3 = dict(
    specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]",
              "[/SYSTEM_PROMPT]", "[IMG]", "<pad>"],
    bos="<s>",
    eos="</s>",
    pad="<pad>",
    stop=["</s>"],
    template=MISTRAL3_TEMPLATE,
    template_file=True,
    dtype=torch.bfloat16,
    extra_rows=0,
    shard_size="10MB",
)  # fmt: skip
QWEN3_5 = dict(
    specials=[
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
    ],
    bos=None,
    eos="<|im_end|>",
    pad="<|endoftext|>",
    stop=["<|im_end|>", "<|endoftext|>"],
    template=QWEN3_5_TEMPLATE,
    template_file=True,
    dtype=torch.bfloat16,
    extra_rows=12,  # Qwen3.5 pads its embedding past the tokenizer (248320 rows)
    shard_size="10MB",
)

GEMMA4 = dict(
    specials=[
        "<pad>",
        "<eos>",
        "<bos>",
        "<|turn>",
        "<turn|>",
        "<|think|>",
        "<|channel>",
        "<channel|>",
        "<mask>",
        "<|image>",
        "<image|>",
        "<|image|>",
    ],  # fmt: skip
    bos="<bos>",
    eos="<eos>",  # as Google's tokenizer_config.json; the turn ends with <turn|>
    pad="<pad>",
    stop=["<eos>", "<turn|>"],  # generation_config.json's [1, 106]
    template=GEMMA4_TEMPLATE,
    template_file=True,
    dtype=torch.bfloat16,
    extra_rows=6,
    shard_size="10MB",
)

FAMILIES = {
    "llama": dict(
        specials=[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|finetune_right_pad_id|>",
        ],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad=None,  # as Llama 3: no pad token; alignpipe picks the reserved pad token
        template=LLAMA_TEMPLATE,
        dtype=torch.bfloat16,
        extra_rows=0,
        shard_size="40KB",  # several shards and an index, as real checkpoints have
    ),
    "qwen2": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        template=QWEN_TEMPLATE,
        dtype=torch.float32,
        extra_rows=20,  # Qwen pads its embedding past the tokenizer (151936 vs 151665)
        shard_size="10MB",
    ),
    "gemma2": dict(
        specials=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
        bos="<bos>",
        eos="<eos>",
        pad="<pad>",
        template=GEMMA_TEMPLATE,
        dtype=torch.bfloat16,
        extra_rows=0,
        shard_size="10MB",
    ),
    "qwen3": QWEN3,
    "qwen3_untied": QWEN3,
    "mistral": dict(
        specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        bos="<s>",
        eos="</s>",
        pad=None,
        stop=["</s>"],
        template=MISTRAL_TEMPLATE,
        template_file=True,
        dtype=torch.bfloat16,
        extra_rows=0,
        shard_size="10MB",
    ),
    "gemma3": GEMMA3,
    "gemma3_mm": GEMMA3,
    "ministral3": MINISTRAL3,
    "ministral3_mm": MINISTRAL3,
    "qwen3_5": QWEN3_5,
    "qwen3_5_mm": QWEN3_5,
    "gemma4": GEMMA4,
    "gemma4_mm": GEMMA4,
    "qwen3_moe": QWEN3,
    "gemma4_moe": GEMMA4,
    # Its experts fused, as Qwen3.5 MoE's released checkpoints store them (fuse_experts).
    "qwen3_5_moe_mm": {**QWEN3_5, "fused_experts": True},
    "mistral4_mm": MINISTRAL3,  # Mistral Small 4: tekken, as Mistral 3's
}
# Mixtral and Qwen2 MoE (experts apart, Mixtral's under its names): their dense kin's tokenizers.
FAMILIES.update(mixtral=FAMILIES["mistral"], qwen2_moe=FAMILIES["qwen2"], qwen3_next=QWEN3_5)
# Qwen3-VL MoE's releases store the fused experts transposed ([E, D, 2F], [E, F, D]).
FAMILIES.update(qwen3_vl=QWEN3, qwen3_vl_moe={**QWEN3, "transposed_experts": True})
MULTIMODAL = (
    "gemma3_mm", "ministral3_mm", "qwen3_5_mm", "gemma4_mm", "qwen3_5_moe_mm", "qwen3_vl",
    "qwen3_vl_moe", "mistral4_mm",
)  # fmt: skip


def train_tokenizer(specials: list[str], bos: str | None) -> Tokenizer:
    """A byte-level BPE of BPE_VOCAB ids trained on CORPUS, specials first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    if bos:
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tokenizer


def write_tokenizer(out: pathlib.Path, spec: dict) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (chat template included)."""
    tokenizer = train_tokenizer(spec["specials"], spec["bos"])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec["bos"],
        "eos_token": spec["eos"],
        "pad_token": spec["pad"],
        "model_max_length": 128,
        "chat_template": None if spec.get("template_file") else spec["template"],
    }
    text = json.dumps({k: v for k, v in config.items() if v is not None}, indent=2)
    (out / "tokenizer_config.json").write_text(text + "\n")
    if spec.get("template_file"):  # transformers 5 saves the template beside the config
        (out / "chat_template.jinja").write_text(spec["template"])
    return tokenizer


def randomise(model: torch.nn.Module, family: str) -> None:
    """Non-trivial values everywhere (HF starts norms at 1 or 0 and biases at 0)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's, start at 1
                param.copy_(1.0 + 0.2 * noise)
            elif "norm" in name:
                # Gemma 4's norms apply w itself (start at 1), Gemma 2 and 3's 1 + w.
                zero_centred = family.startswith(("gemma2", "gemma3")) or (
                    family.startswith(("qwen3_5", "qwen3_next")) and "linear_attn.norm" not in name
                )
                base = 0.0 if zero_centred else 1.0
                param.copy_(base + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            else:
                # Qwen3.5's fixture is compared over 512 tokens: smaller weights keep its
                # float32 logits within 1e-4 of float64's (at 0.25, transformers' own
                # float32 run strays 5e-4 from its float64 run).
                # Gemma 4's nine layers: 0.04 keeps its float32 logits at 512 tokens as near
                # float64's as transformers' own float32 run (3-5e-5; at 0.06 one position
                # in 1,024 strayed 1.5e-4).
                # Ministral 3's fixture is compared over 512 tokens too (its query
                # temperature starts at 256).
                scale = 0.04 if family.startswith("gemma4") else 0.06
                long = ("qwen3_5", "qwen3_next", "gemma4", "ministral3", "mistral4")
                param.copy_((scale if family.startswith(long) else 0.25) * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scalar (saved)
                buffer.copy_(0.8 + 0.4 * torch.rand(buffer.shape, generator=generator))


def write_family(family: str, spec: dict) -> None:
    """Write one family's checkpoint, tokenizer and reference logits."""
    out = ROOT / family
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):
        old.unlink()
    tokenizer = write_tokenizer(out, spec)
    vocab = tokenizer.get_vocab_size() + spec["extra_rows"]
    ids = {
        f"{k}_token_id": tokenizer.token_to_id(spec[k]) if spec[k] else None
        for k in ("bos", "eos", "pad")
    }
    torch.manual_seed(0)
    config = hf_config(family, vocab, ids)
    model_class = (
        transformers.AutoModelForImageTextToText
        if family in MULTIMODAL
        else transformers.AutoModelForCausalLM
    )
    model = model_class.from_config(config, attn_implementation="eager")
    randomise(model, family)
    if spec.get("stop"):  # the stop set as the real checkpoints' generation_config.json
        model.generation_config.eos_token_id = [tokenizer.token_to_id(t) for t in spec["stop"]]
    model.to(spec["dtype"]).save_pretrained(out, max_shard_size=spec["shard_size"])
    if spec.get("fused_experts"):
        fuse_experts(out / "model.safetensors")
    if spec.get("transposed_experts"):
        transpose_experts(out / "model.safetensors")
    write_reference(out, family, tokenizer.get_vocab_size(), model_class)
    write_tokenizer_cases(out, tokenizer)


def fuse_experts(path: pathlib.Path) -> None:
    """Rewrite transformers 5's per-expert tensors as Qwen3.5 MoE's releases store them:
    ``mlp.experts.gate_up_proj`` [E, 2F, D] (gate rows, then up) and ``mlp.experts.down_proj``
    [E, D, F], which transformers loads as they are."""
    from safetensors.torch import load_file, save_file

    tensors, experts = {}, {}
    for name, value in load_file(path).items():
        head, dot, tail = name.partition(".mlp.experts.")
        if not dot:
            tensors[name] = value
            continue
        index, projection, _ = tail.split(".")
        experts.setdefault(head, {})[(int(index), projection)] = value
    for head, parts in experts.items():
        count = 1 + max(index for index, _ in parts)
        tensors[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(count)]
        )
        tensors[f"{head}.mlp.experts.down_proj"] = torch.stack(
            [parts[(e, "down_proj")] for e in range(count)]
        )
    save_file(tensors, path, metadata={"format": "pt"})


def transpose_experts(path: pathlib.Path) -> None:
    """Rewrite the fused experts as Qwen3-VL MoE's releases store them, transposed;
    transformers' qwen3_vl_moe conversion transposes them back on load."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    for name, value in tensors.items():
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            tensors[name] = value.transpose(1, 2).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def write_reference(out: pathlib.Path, family: str, token_count: int, model_class) -> None:
    """Logits of the saved checkpoint loaded in fp32 (as alignpipe will load it)."""
    model = model_class.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    tokens = np.random.default_rng(0).integers(0, token_count, size=(2, SEQ_LEN))
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits.numpy()
    np.savez_compressed(out / "reference.npz", tokens=tokens, logits=logits.astype(np.float32))
    print(f"{family}: {sum(p.numel() for p in model.parameters())} params")


def write_tokenizer_cases(out: pathlib.Path, tokenizer: Tokenizer) -> None:
    """Token ids (``tokenizers``) and rendered chats (``transformers``) to compare against."""
    fast = transformers.AutoTokenizer.from_pretrained(out)
    chats = []
    for messages in CHAT_CASES:
        for generation in (True, False):
            rendered = fast.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation
            )
            chats.append(dict(messages=messages, add_generation_prompt=generation, text=rendered))
    cases = {
        "texts": [
            dict(text=text, ids=tokenizer.encode(text, add_special_tokens=False).ids)
            for text in TEXT_CASES
        ],
        "chats": chats,
    }
    (out / "tokenizer_cases.json").write_text(json.dumps(cases, indent=1, ensure_ascii=False))


def verify_export() -> None:
    """Import and export each fixture with alignpipe; transformers must load it unchanged."""
    sys.path.insert(0, str(ROOT.parents[2]))
    from components.hf.export import export_hf
    from components.hf.importer import import_hf

    for family in FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            artifact, exported = f"{tmp}/artifact", f"{tmp}/hf"
            import_hf(str(ROOT / family), artifact)
            export_hf(artifact, exported)
            # By its architecture's class: transformers 5.25's AutoModelForCausalLM has no
            # mistral4 (its AutoModelForPreTraining has).
            architecture = json.loads((pathlib.Path(exported) / "config.json").read_text())
            model = getattr(transformers, architecture["architectures"][0]).from_pretrained(
                exported, dtype=torch.float32, attn_implementation="eager"
            )
            reference = np.load(ROOT / family / "reference.npz")
            with torch.no_grad():
                logits = model(torch.tensor(reference["tokens"])).logits.numpy()
            error = float(np.abs(logits - reference["logits"]).max())
            fast = transformers.AutoTokenizer.from_pretrained(exported)
            chat = fast.apply_chat_template(CHAT_CASES[0], tokenize=False)
            original = transformers.AutoTokenizer.from_pretrained(ROOT / family)
            same_chat = chat == original.apply_chat_template(CHAT_CASES[0], tokenize=False)
            print(f"{family}: export loads in transformers {transformers.__version__}, "
                  f"max |logit diff| {error:.2e}, chat template same: {same_chat}")  # fmt: skip
            assert error < 1e-4 and same_chat


def main() -> None:
    """Write every family's fixture, or verify exports with ``--verify-export``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verify-export", action="store_true")
    parser.add_argument("families", nargs="*", help="only these (default: every family)")
    args = parser.parse_args()
    if args.verify_export:
        verify_export()
        return
    torch.set_num_threads(1)
    for family, spec in FAMILIES.items():
        if not args.families or family in args.families:
            write_family(family, spec)
    total = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    print(f"wrote {ROOT} ({total / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
