"""The model commands: ``alignpipe model import | export`` (Hugging Face checkpoints in,
aligned policies out), ``alignpipe evaluate`` (the evaluate stage on a policy) and
``alignpipe report`` (a local run's report.html)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import webbrowser
from typing import Any

from components.core import fileio
from components.core.model.config import DTYPES, REMAT_POLICIES

REPORT_FILE = "report.html"


def add_model(parser: argparse.ArgumentParser) -> None:
    """``alignpipe model import|export``."""
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    _add_import(sub)
    _add_export(sub)


def _add_import(sub: argparse._SubParsersAction) -> None:
    """``alignpipe model import HF_DIR OUT``."""
    imp = sub.add_parser(
        "import",
        help="a local HF folder (Llama 3.x, Qwen2/2.5, Gemma 2) -> a model artifact",
        description="Write a model artifact (config.json, params/, tokenizer/) from a local "
        "Hugging Face model folder. Shard data with --tokenizer OUT/tokenizer and start "
        "sft/reward from it with base_policy=OUT.",
    )
    imp.add_argument("hf_dir", metavar="HF_DIR", help="folder with config.json, *.safetensors, "
                     "tokenizer.json, tokenizer_config.json")  # fmt: skip
    imp.add_argument("out", metavar="OUT", help="the model artifact folder to write")
    imp.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="",
        help="compute dtype (params are float32); default: bfloat16 for 16-bit checkpoints",
    )
    imp.add_argument("--remat", choices=list(REMAT_POLICIES), default="full")
    imp.set_defaults(handler=_import)


def _add_export(sub: argparse._SubParsersAction) -> None:
    """``alignpipe model export MODEL_DIR HF_OUT``."""
    exp = sub.add_parser(
        "export",
        help="a policy artifact -> a HF folder that transformers loads",
        description="Write config.json, safetensors weights and tokenizer files that "
        "transformers' AutoModelForCausalLM / AutoTokenizer load unchanged. A model trained "
        "with LoRA adapters exports merged (W + A·B·alpha/r). With --adapter, HF_OUT also "
        "gets base/ (an HF folder of the frozen base) and adapter/ (adapter_config.json + "
        "adapter_model.safetensors) for peft.PeftModel.from_pretrained(base, adapter).",
    )
    exp.add_argument("model_dir", metavar="MODEL_DIR", help="a policy artifact (import/sft/ppo)")
    exp.add_argument("out", metavar="HF_OUT", help="the Hugging Face folder to write")
    exp.add_argument(
        "--tokenizer",
        default="",
        help="tokenizer folder the model was trained with (default: MODEL_DIR/tokenizer)",
    )
    exp.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="",
        help="weight dtype (default: the imported checkpoint's, else bfloat16)",
    )
    exp.add_argument(
        "--max-shard-gb", type=float, default=5.0, help="largest safetensors file (GiB)"
    )
    exp.add_argument(
        "--adapter",
        action="store_true",
        help="also write HF_OUT/base (the base, adapters left out) and HF_OUT/adapter (the "
        "LoRA adapters in PEFT's format, float32) for a model trained with lora_rank > 0",
    )
    exp.add_argument(
        "--base-model",
        default="",
        help="with --adapter: base_model_name_or_path in adapter_config.json (default: the "
        "absolute path of HF_OUT/base; a Hub id only if the base is that checkpoint unchanged)",
    )
    exp.set_defaults(handler=_export)


def add_generate(parser: argparse.ArgumentParser) -> None:
    """``alignpipe generate POLICY PROMPT``: a policy's answer, as its users will see it."""
    parser.description = (
        "Print a policy's answer to PROMPT: rendered with the model's chat template (a "
        "system message first with --system), sampled until the model's stop tokens "
        "(eos and the template's end of turn). POLICY: a model artifact (sft, ppo, an "
        "import), a promoted_policy_uri (its current version) or a Hugging Face folder."
    )
    parser.add_argument("policy", metavar="POLICY")
    parser.add_argument("prompt", metavar="PROMPT", help="the user's message")
    parser.add_argument("--system", default="", help="a system message before it")
    parser.add_argument(
        "--raw", action="store_true", help="PROMPT is the model's input as it is (no template)"
    )
    _sampling_flags(parser)
    parser.add_argument(
        "--compare", default="", metavar="REFERENCE",
        help="also print REFERENCE's answer (e.g. the sft policy or the base), same sampling",
    )  # fmt: skip
    parser.set_defaults(handler=_generate)


def add_chat(parser: argparse.ArgumentParser) -> None:
    """``alignpipe chat POLICY``: talk to a policy, turn after turn."""
    parser.description = (
        "Talk to a policy: each line you type is a user turn; the whole conversation is "
        "rendered with the model's chat template and answered until its stop tokens. "
        "/reset starts over, /exit (or end of input) leaves. The oldest turns are dropped "
        "when the conversation outgrows the model's positions."
    )
    parser.add_argument("policy", metavar="POLICY")
    parser.add_argument("--system", default="", help="a system message first")
    _sampling_flags(parser)
    parser.set_defaults(handler=_chat)


def _sampling_flags(parser: argparse.ArgumentParser) -> None:
    """What generate and chat share: the template's arguments, sampling, the dtype."""
    parser.add_argument(
        "--chat-template-kwargs", default="",
        help='JSON object of the template\'s own arguments (Qwen3: \'{"enable_thinking": false}\')',
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="",
        help="compute dtype (default: the model's; a 16-bit checkpoint computes in bfloat16)",
    )  # fmt: skip


def _sampling(args: argparse.Namespace) -> Any:
    """The sampling flags generate and chat share (``_sampling_flags``), as a Sampling."""
    from components.core.model.respond import Sampling

    return Sampling(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed,
    )  # fmt: skip


def _chat(args: argparse.Namespace, rest: list[str]) -> int:
    import dataclasses
    import tempfile

    from components.core.model.respond import fit_conversation, respond
    from components.shard.config import parse_template_kwargs

    sampling = _sampling(args)
    with tempfile.TemporaryDirectory() as workdir:
        try:
            kwargs = parse_template_kwargs(args.chat_template_kwargs)
            model, tokenizer = _policy_for_chat(args.policy, workdir, args.dtype)
        except (*_errors(), ValueError, FileNotFoundError) as error:
            return _refuse(str(error))
        system = [{"role": "system", "content": args.system}] if args.system else []
        messages = list(system)
        room = model.config.max_seq_len - sampling.max_new_tokens
        print(f"chatting with {args.policy}; /reset starts over, /exit leaves", flush=True)
        turn = 0
        while True:
            try:
                line = input("you> ")
            except EOFError:
                return 0
            if line.strip() == "/exit":
                return 0
            if line.strip() == "/reset":
                messages = list(system)
                print("(a new conversation)")
                continue
            if not line.strip():
                continue
            try:
                prompt, kept = fit_conversation(
                    tokenizer, [*messages, {"role": "user", "content": line}], room, kwargs
                )
            except ValueError as error:
                print(f"error: {error}", file=sys.stderr)
                continue
            if len(kept) < len(messages) + 1:
                print(f"(the oldest turns were dropped to fit {room} positions)")
            turn += 1
            seeded = dataclasses.replace(sampling, seed=sampling.seed + turn)
            answer = respond(model, tokenizer, prompt, seeded)
            print(f"{args.policy.rstrip('/').rsplit('/', 1)[-1]}> {answer}", flush=True)
            messages = [*kept, {"role": "assistant", "content": answer}]


def _policy_for_chat(path: str, workdir: str, dtype: str):
    """(model, tokenizer) of ``path``: an artifact, a promotion root or an HF folder."""
    from components.core.data.tokenizers import load_tokenizer
    from components.core.model.artifact import load_model
    from components.hf.importer import resolve_base
    from pipelines.releases import promotion

    folder = resolve_base(promotion.resolve_policy(path), workdir)
    model, info = load_model(folder, **({"dtype": dtype} if dtype else {}))
    if info.get("scalar_head"):
        raise ValueError(f"{path} is a reward or value model (a scalar head); pass a policy")
    return model, load_tokenizer(folder)


def _generate(args: argparse.Namespace, rest: list[str]) -> int:
    import tempfile

    from components.core.model.respond import render, respond
    from components.shard.config import parse_template_kwargs

    sampling = _sampling(args)
    try:
        kwargs = parse_template_kwargs(args.chat_template_kwargs)
        answers = []
        for path in filter(None, (args.policy, args.compare)):
            with tempfile.TemporaryDirectory() as workdir:
                model, tokenizer = _policy_for_chat(path, workdir, args.dtype)
                prompt = render(
                    tokenizer, args.prompt, system=args.system, template_kwargs=kwargs,
                    raw=args.raw,
                )  # fmt: skip
                answers.append((path, respond(model, tokenizer, prompt, sampling)))
    except (*_errors(), ValueError, FileNotFoundError) as error:
        return _refuse(str(error))
    if len(answers) == 1:
        print(answers[0][1])
        return 0
    for path, answer in answers:
        print(f"── {path}\n{answer}\n")
    return 0


def add_evaluate(parser: argparse.ArgumentParser) -> None:
    """``alignpipe evaluate …``: the evaluate stage's own entry point parses the flags, so the
    two never drift apart."""
    parser.set_defaults(handler=_evaluate, accepts_extra=True)


def add_report(parser: argparse.ArgumentParser) -> None:
    """``alignpipe report RUN_DIR``: where a local run's report.html is."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a local run or pipeline-root folder")
    parser.add_argument("--open", action="store_true", help="open the newest report in a browser")
    parser.set_defaults(handler=_report)


def _errors() -> tuple[type[Exception], ...]:
    """The user-fixable errors of import and export (printed, exit status 2)."""
    from components.core.data.tokenizers import TokenizerError
    from components.core.training.checkpoint import ModelArtifactError
    from components.hf.export import ExportError
    from components.hf.families import HFImportError
    from components.hf.safetensors_io import CheckpointFileError

    return HFImportError, CheckpointFileError, ExportError, ModelArtifactError, TokenizerError


def _unwritable(out: str, source: str, name: str) -> str | None:
    """Why the local folder ``out`` must not be written from ``source``, or None.

    Import and export write their files into ``out`` by name: into a folder that holds
    another model they would replace its config.json and leave the rest (an artifact that
    no longer loads, or old safetensors shards that the index still names), so only a new
    or empty folder outside ``source`` is taken.
    """
    if "://" in out:
        return None
    if os.path.isfile(out):
        return f"{name} {out} is a file; pass a new or empty folder"
    if fileio.is_within(out, source):
        return f"{name} {out} is {source} or inside it, which is read from; pass another folder"
    if os.path.isdir(out) and os.listdir(out):
        return (
            f"{name} {out} already holds files, which this would mix with the new model's "
            "(nothing was written); pass a new or empty folder, or remove it first"
        )
    return None


def _promoted_version(model_dir: str) -> str:
    """``model_dir``, or the version its CURRENT names when it is a promotion root."""
    from pipelines.releases import promotion

    folder = promotion.resolve_policy(model_dir)
    if folder != model_dir:
        print(f"exporting {folder}: the current version of {model_dir}", file=sys.stderr)
    return folder


def _refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _import(args: argparse.Namespace, rest: list[str]) -> int:
    from components.hf.importer import import_hf

    if problem := _unwritable(args.out, args.hf_dir, "OUT"):
        return _refuse(problem)
    try:
        summary = import_hf(args.hf_dir, args.out, dtype=args.dtype, remat=args.remat)
    except _errors() as error:
        return _refuse(str(error))
    if "text_only" in summary:
        print(
            f"{args.hf_dir} is a multimodal {summary['architecture']}: imported its language "
            f"model only ({summary['text_only']['tensors_left_out']} tensors of its other towers "
            "left out); the run is text-only, and export writes a text-only "
            f"{summary['text_only']['exports_as']}",
            file=sys.stderr,
        )
    print(json.dumps(summary))
    return 0


def _export(args: argparse.Namespace, rest: list[str]) -> int:
    from components.hf.export import export_hf
    from components.hf.peft import export_peft

    if not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):
        return _refuse(f"--max-shard-gb {args.max_shard_gb}: pass a size in GiB above 0 (5)")
    if problem := _unwritable(args.out, args.model_dir, "HF_OUT"):
        return _refuse(problem)
    try:
        model_dir = _promoted_version(args.model_dir)
    except (ValueError, FileNotFoundError) as error:  # a damaged promotion root
        return _refuse(str(error))
    options = dict(
        tokenizer_dir=args.tokenizer,
        dtype=args.dtype,
        max_shard_bytes=int(args.max_shard_gb * 2**30),
    )
    if args.base_model and not args.adapter:
        return _refuse("--base-model names the adapter's base; add --adapter")
    try:
        if args.adapter:
            summary = export_peft(model_dir, args.out, base_model=args.base_model, **options)
        else:
            summary = export_hf(model_dir, args.out, **options)
    except _errors() as error:
        return _refuse(str(error))
    print(json.dumps(summary))
    return 0


def _evaluate(args: argparse.Namespace, rest: list[str]) -> int:
    from components.evaluate.__main__ import main

    return main(rest, prog="alignpipe evaluate")


def find_reports(run_dir: str) -> list[str]:
    """Every report.html under ``run_dir``, newest first (a link to a file that is gone is
    no report)."""
    found = [
        os.path.join(folder, REPORT_FILE)
        for folder, _, files in os.walk(run_dir)
        if REPORT_FILE in files and os.path.isfile(os.path.join(folder, REPORT_FILE))
    ]
    return sorted(found, key=lambda path: (os.path.getmtime(path), path), reverse=True)


def _report(args: argparse.Namespace, rest: list[str]) -> int:
    if not os.path.isdir(args.run_dir):
        print(f"error: {args.run_dir} is not a folder; pass a local run folder", file=sys.stderr)
        return 1
    reports = find_reports(args.run_dir)
    if not reports:
        print(
            f"error: no {REPORT_FILE} under {args.run_dir}; the evaluate step has not run "
            "there yet (run the pipeline or `alignpipe evaluate … --output DIR`)",
            file=sys.stderr,
        )
        return 1
    for path in reports:
        print(os.path.abspath(path))
    if args.open:
        webbrowser.open("file://" + os.path.abspath(reports[0]))
    return 0
