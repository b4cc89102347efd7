"""A Hugging Face checkpoint in, an aligned Hugging Face model out, through the whole pipeline.

For Llama 3.1, Qwen3 and Gemma 3 fixtures: conversational pairs and a gold judge
given as ``PATH.py:FUNCTION``, the fixture folder as ``base_policy`` and
``reward_base_policy`` with no import step, kfp.local from shard to promote, then
``alignpipe model export`` of the promotion root, loaded by ``transformers``: greedy, it
generates the tokens alignpipe's sampler generates on the eval prompts, both stopping on the
model's stop set (``generation_config.json``: Qwen3's ``<|im_end|>`` and ``<|endoftext|>``,
Gemma 3's ``<eos>`` and ``<end_of_turn>``), and its logits match. Llama fine-tunes its base
with sft first (``sft_on_base``), its held-out reward model on other annotators' pairs
(``heldout_data_uri``), Qwen3 is aligned as given with its template's
``enable_thinking`` off, and Gemma 3 (its system message folded into the first user turn
by its template) with LoRA adapters, exported merged and as a PEFT adapter (loaded by
``peft``); Qwen3.5 (hybrid Gated DeltaNet and attention layers, thinking on) with adapters
on every linear layer, aligned by DPO; Gemma 4 (its turns, its <eos> and <turn|> stops) fully
fine-tuned by GRPO. Qwen2 and Gemma 2 share these code paths; their
import and export are tested in test_hf_import.py and test_hf_export.py, which keeps this
module's four runs in the suite's time.
``transformers``, ``torch`` and ``peft`` are imported in this module only.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from components.core import fileio
from components.core.data.builtin_task import write_jsonl
from components.core.data.prompts import left_pad, unique_prompts
from components.core.data.tokenizers import load_tokenizer
from components.core.model.artifact import load_model
from components.core.model.sampler import generate
from components.core.rewards.members import reward_members
from components.hf.importer import import_hf
from pipelines.cli.main import main
from pipelines.releases import promotion
from pipelines.targets.local.result import format_summary
from pipelines.targets.local.run import run_local

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
GOLD = """
KIND = {"good", "great", "happy", "kind", "calm", "bright", "warm", "fine", "nice", "fair"}
UNKIND = {"bad", "sad", "cruel", "dull", "cold", "grim", "ugly", "poor", "sour", "harsh"}


def score(prompt: str, response: str) -> float:
    words = [w.strip(".?!,").lower() for w in response.split()]
    words = [w for w in words if w]
    return sum((w in KIND) - (w in UNKIND) for w in words) / len(words) if words else -1.0
"""
# Tiny steps: the point is the path from a Hugging Face folder to a transformers model.
SMALL = {
    "max_prompt_tokens": 96,  # the fixtures' 128 positions hold prompt + response
    "max_response_tokens": 32,
    "num_shards": 2,
    "sft_steps": 4,
    "sft_batch_size": 16,
    "reward_steps": 4,
    "reward_batch_size": 16,
    "min_eval_pairs": 16,
    "ppo_iterations": 2,
    "ppo_rollout_batch_size": 16,
    "ppo_epochs": 1,
    # Two iterations at the rate for pretrained weights move the logits by ~3e-4; a larger
    # rate moves them enough to tell the aligned model from its base apart.
    "ppo_learning_rate": 2e-3,
    "max_new_tokens": 16,
    "eval_max_new_tokens": 16,
    "max_eval_prompts": 16,
    "eval_samples_per_prompt": 2,
    "best_of_n": "1,2",
    "min_reward_accuracy": 0.0,  # four reward steps rank little
    "min_win_rate_lower": 0.0,  # bless what comes out: the promotion and export must run
}
FAMILIES = {
    "llama": {"sft_on_base": True},
    "qwen3": {"chat_template_kwargs": '{"enable_thinking": false}'},
    "gemma3": {"lora_rank": 4, "lora_alpha": 8.0},
    # Qwen3.5 thinks by default (its prompts open a think block); adapters on every linear
    # layer, the Gated DeltaNet projections included, trained by DPO: its DeltaNet programs
    # compile in every stage process, and DPO has one training stage to PPO's two (the run
    # took 380 s with PPO, twice the others').
    "qwen3_5": {
        "lora_rank": 4,
        "lora_alpha": 8.0,
        "algorithm": "dpo",
        "dpo_steps": 4,
        "dpo_batch_size": 16,
        "dpo_learning_rate": 2e-3,  # as ppo_learning_rate: enough to tell it from its base
    },
    # Gemma 4 (full layers of their own shapes, shared keys and values, per-layer inputs):
    # every weight trained, the per-layer input table included, by GRPO (no critic); its
    # rollouts decode through the shared layers' cache.
    "gemma4": {"algorithm": "grpo", "group_size": 2},  # 16 rollouts: 8 devices x 2
    # Qwen3 MoE (8 experts, 2 a token): every expert and router trained by PPO, the critic's
    # too; its evaluation samples each row under vmap through the routed experts.
    # At the others' rate its KL (0.12 nats/token) passed kl_stop and the guard restored
    # the initial policy.
    "qwen3_moe": {"chat_template_kwargs": '{"enable_thinking": false}', "ppo_learning_rate": 1e-3},
    # Mistral Small 4 as released (its Mistral 3 wrapper; latent attention and experts): GRPO
    # with adapters on the latent projections, as a 119B model is trained.
    "mistral4_mm": {"algorithm": "grpo", "group_size": 2, "lora_rank": 4, "lora_alpha": 8.0},
}
# The family an imported fixture is recorded as (a MoE is its dense family with experts).
FAMILY_OF = {"qwen3_moe": "qwen3", "mistral4_mm": "mistral"}
# The stage that aligned the policy, by its algorithm.
ALIGNING = {"dpo": "dpo", "grpo": "ppo"}
SYSTEM = {
    "llama": "You are a kind assistant.",
    "qwen3": "Answer kindly.",
    "gemma3": "Be kind.",
    "qwen3_5": "Answer briefly.",
    "gemma4": "Reply kindly.",
    "qwen3_moe": "Answer kindly.",
    "mistral4_mm": "Be kind.",
}
# The family whose run is also given a held-out reward model's own data (heldout_data_uri).
HELDOUT_DATA = "llama"
PROMPTS, NEW_TOKENS = 4, 12
LOGIT_ATOL = 1e-4  # fp32 on both sides; the import tests measure ~1e-6


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def aligned(request, tmp_path_factory, monkeypatch_module) -> dict:
    """The family's run: its values, result and promotion root."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    gold = root / "gold.py"
    gold.write_text(GOLD)
    data = root / "pairs.jsonl"
    write_jsonl(str(data), 240, seed=1, conversational=True, system=SYSTEM[family])
    folder = str(FIXTURES / family)
    values = {
        **SMALL,
        **FAMILIES[family],
        "data_uri": str(data),
        "base_policy": folder,  # no import step: the tasks import it themselves
        "reward_base_policy": folder,
        "gold_reward": f"{gold}:score",
        "promoted_policy_uri": str(root / "promoted"),
    }
    if family == HELDOUT_DATA:  # the held-out reward model learns from other annotators
        other = root / "other_annotators.jsonl"
        write_jsonl(str(other), 64, seed=2, conversational=True, system=SYSTEM[family])
        values["heldout_data_uri"] = str(other)
        # Two iterations on random weights: the held-out model's gain is noise about zero (its
        # sign moved with the installed packages: -0.12 std on 2026-12-07), so its gate rule,
        # tested in test_overoptimisation.py, is off here, as min_win_rate_lower is.
        values["min_heldout_gain"] = -1e9
    monkeypatch_module.setenv("ALIGNPIPE_CPU_DEVICES", "8")
    result = run_local(values, runs_dir=root / "runs", echo=False)
    assert not result.error, format_summary(result)
    return {"family": family, "values": values, "result": result, "root": root}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _export(aligned: dict, *extra: str) -> Path:
    out = aligned["root"] / ("export" + "-".join(("", *extra)).replace("--", "-"))
    root = aligned["values"]["promoted_policy_uri"]
    assert main(["model", "export", root, str(out), "--dtype", "float32", *extra]) == 0
    return out


def _eval_prompts(aligned: dict) -> list[np.ndarray]:
    shards = aligned["result"].run_dir / "shard" / "shards"
    return unique_prompts(fileio.glob(str(shards / "eval" / "*.tfrecord")))[:PROMPTS]


def _ours(policy_dir: str, prompts: list[np.ndarray]) -> list[list[int]]:
    """alignpipe's sampler, greedy, in fp32 (as transformers runs the fp32 export), left
    padded as rollouts and evaluation pad; each response cut after its eos."""
    model, info = load_model(policy_dir, dtype="float32")
    tokenizer = info["tokenizer"]
    width = max(len(p) for p in prompts)
    rows = [left_pad(p, width, tokenizer["pad_id"], tokenizer["bos_id"]) for p in prompts]
    tokens = jnp.asarray(np.stack([r[0] for r in rows]), jnp.int32)
    mask = jnp.asarray(np.stack([r[1] for r in rows]), jnp.int32)
    out = generate(
        model, tokens, mask, jax.random.key(0), max_new_tokens=NEW_TOKENS,
        eos_id=tuple(tokenizer["stop_ids"]), pad_id=tokenizer["pad_id"], temperature=0.0,
    )  # fmt: skip
    sampled = np.asarray(out.tokens)
    kept = np.asarray(out.mask)
    return [
        [int(t) for t, m in zip(row, keep, strict=True) if m]
        for row, keep in zip(sampled, kept, strict=True)
    ]


def _theirs(model, prompt: np.ndarray, stops=None, suppress=()) -> list[int]:
    """transformers' greedy generation, stopping on the export's generation_config.json
    stop set (or ``stops``), cut after the first stop token; ``suppress``: ids it may not
    choose (embedding rows past the tokenizer, which alignpipe's sampler never picks)."""
    ids = torch.tensor([prompt.tolist()])
    stops = stops or model.generation_config.eos_token_id
    stops = list(stops) if isinstance(stops, list | tuple) else [stops]
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
            do_sample=False, eos_token_id=stops, pad_token_id=stops[0],
            suppress_tokens=list(suppress) or None,
        )  # fmt: skip
    new = out[0, len(prompt) :].tolist()
    ends = [i for i, token in enumerate(new) if token in stops]
    return new[: ends[0] + 1] if ends else new


def _logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def _our_logits(policy_dir: str, tokens: list[int]) -> np.ndarray:
    model, _ = load_model(policy_dir, dtype="float32")
    ids = jnp.asarray([tokens], jnp.int32)
    return np.asarray(model.lm_logits(model(ids, jnp.ones_like(ids))))[0]


def _hf_model(folder: Path):
    """transformers' model of ``folder``: by its architecture's class (transformers 5.25's
    AutoModelForCausalLM has no mistral4), a multimodal wrapper's for a released folder."""
    architecture = json.loads((Path(folder) / "config.json").read_text())["architectures"][0]
    return (
        getattr(transformers, architecture)
        .from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
        .eval()
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_run_aligns_the_folder_with_its_own_tokenizer_and_promotes(aligned):
    result, values, family = aligned["result"], aligned["values"], aligned["family"]
    stages = {stage: record.status for stage, record in result.stages.items()}
    aligning = ALIGNING.get(values.get("algorithm", "ppo"), "ppo")
    assert stages["promote"] == "ran" and stages[aligning] == "ran"
    # The summary says where the initial policy came from.
    summary = format_summary(result)
    if values.get("sft_on_base"):
        assert result.stages["sft"].task == "sft"
        assert f"initial policy         sft on {values['base_policy']}" in summary
    else:
        assert result.stages["sft"].task == "given-policy"
        assert f"{values['base_policy']}, as given (no sft)" in summary
    # The shards use the model's own tokenizer (no --tokenizer given), chat template included.
    manifest = json.loads((result.run_dir / "shard" / "shards" / "manifest.json").read_text())
    own = load_tokenizer(values["base_policy"])
    assert manifest["tokenizer"]["fingerprint"] == own.fingerprint
    assert manifest["counts"]["rejected"] == 0 and manifest["counts"]["train"] > 0
    evaluation = json.loads((result.run_dir / "evaluate" / "evaluation" / "eval.json").read_text())
    if family == HELDOUT_DATA:
        # Every pair of the other annotators' file is in heldout, and nothing else is; the
        # held-out model trained on it watched the policy and judged it in evaluation.
        assert manifest["heldout_sources"] == [values["heldout_data_uri"]]
        assert manifest["counts"]["heldout"] + manifest["counts"]["duplicates"] == 64
        members = reward_members(str(result.run_dir / "reward" / "model"))
        stats = json.loads((Path(members.heldout) / "reward_stats.json").read_text())
        assert stats["trained_on"] == "heldout"
        heldout_gain = evaluation["summary"]["overoptimisation"]["heldout_gain"]
        assert np.isfinite(heldout_gain["difference"]["value"])
    else:
        assert "heldout" not in manifest["counts"]
    # The promoted version carries its tokenizer and the checkpoint's dtype, nothing imported.
    version = Path(promotion.resolve_policy(values["promoted_policy_uri"]))
    assert load_tokenizer(str(version / "tokenizer")).fingerprint == own.fingerprint
    info = json.loads((version / "config.json").read_text())
    assert info["hf"]["family"] == FAMILY_OF.get(family, family) and info["stage"] == aligning
    assert not list(version.rglob("imported_base")) and not list(version.rglob("hf_source"))
    # The judge of the run's figures: the gold function given as PATH.py:FUNCTION.
    gold = evaluation["summary"]["gold"]
    assert gold["name"] == values["gold_reward"] and gold["aligned"]["mean"] is not None


@pytest.mark.slow
def test_the_export_generates_in_transformers_what_alignpipe_generated(aligned):
    version = promotion.resolve_policy(aligned["values"]["promoted_policy_uri"])
    out = _export(aligned)
    model = _hf_model(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    ours = load_tokenizer(str(Path(version) / "tokenizer"))
    assert tokenizer.eos_token_id == ours.eos_id
    # The export's stop set is the model's: eos and, for Qwen3 and Gemma 3, the end of turn.
    stops = model.generation_config.eos_token_id
    assert sorted(stops if isinstance(stops, list) else [stops]) == sorted(ours.stop_ids)
    prompts = _eval_prompts(aligned)
    assert len(prompts) == PROMPTS
    generated = _ours(version, prompts)
    for prompt, tokens in zip(prompts, generated, strict=True):
        assert _theirs(model, prompt) == tokens
        sequence = [*prompt.tolist(), *tokens]
        np.testing.assert_allclose(
            _logits(model, sequence), _our_logits(version, sequence), atol=LOGIT_ATOL, rtol=0
        )
    # It is the aligned model: PPO moved the weights away from the folder it started from.
    moved = _logits(_hf_model(FIXTURES / aligned["family"]), sequence) - _logits(model, sequence)
    assert np.abs(moved).max() > 10 * LOGIT_ATOL
    # The rendered prompt round-trips through transformers' tokenizer to the same ids.
    text = tokenizer.decode(prompts[0].tolist())
    assert tokenizer.encode(text, add_special_tokens=False) == prompts[0].tolist()


@pytest.mark.slow
def test_a_lora_policy_exports_merged_and_as_a_peft_adapter(aligned):
    if not aligned["values"].get("lora_rank"):
        pytest.skip("this family's run trains no adapters")
    peft = pytest.importorskip("peft")
    version = promotion.resolve_policy(aligned["values"]["promoted_policy_uri"])
    out = _export(aligned, "--adapter")
    merged = _hf_model(out)
    adapted = peft.PeftModel.from_pretrained(_hf_model(out / "base"), str(out / "adapter"))
    sequence = _eval_prompts(aligned)[0].tolist()
    ours = _our_logits(version, sequence)
    np.testing.assert_allclose(_logits(merged, sequence), ours, atol=LOGIT_ATOL, rtol=0)
    np.testing.assert_allclose(_logits(adapted.eval(), sequence), ours, atol=LOGIT_ATOL, rtol=0)
    # The adapters matter: the base alone computes something else.
    base = _logits(_hf_model(out / "base"), sequence)
    assert np.abs(base - ours).max() > 10 * LOGIT_ATOL


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world!"}]


# make test stops Qwen3 (ChatML), Gemma 3 (turns) and Qwen3 MoE (experts); the slow tier the
# rest (Gemma 4's stop set and greedy decoding against transformers: test_gemma4.py).
@pytest.mark.parametrize(
    "family",
    [
        "qwen3",
        "gemma3",
        "qwen3_moe",
        *(
            pytest.param(family, marks=pytest.mark.slow)
            for family in (
                "gemma4",
                "qwen3_untied",
                "mistral",
                "gemma4_moe",
                "mixtral",
                "qwen2_moe",
                "qwen3_next",
                "mistral4_mm",
            )
        ),
    ],
)
def test_sampling_stops_on_any_stop_id_as_transformers_does(tmp_path, family):
    """The sampler ends a response on any id of the stop set, as ``generate`` does with an
    ``eos_token_id`` list: a stop id the greedy path meets mid-way (here the third token
    it generates) ends that row there, pads after, and transformers stops at the same place.
    Before it, greedy tokens equal ``generate``'s through the KV cache: Mistral's window (4
    tokens) and Gemma 3's local layers and two rotary tables act on every decode step."""
    folder = FIXTURES / family
    model = _hf_model(folder)
    tokenizer = load_tokenizer(str(folder))
    prompt = np.asarray(tokenizer.encode(tokenizer.render_chat(CHAT, True)), np.int32)
    free = _theirs(model, prompt, stops=[10**6])  # an id it never emits: NEW_TOKENS tokens
    stops = (tokenizer.eos_id, free[2])
    theirs = _theirs(model, prompt, stops=stops)
    assert theirs == free[: free.index(free[2]) + 1] and len(theirs) < NEW_TOKENS
    ours, _ = load_model(import_hf(str(folder), str(tmp_path / "m"))["out"], dtype="float32")
    tokens = jnp.asarray(prompt[None], jnp.int32)
    unstopped = generate(
        ours, tokens, jnp.ones_like(tokens), jax.random.key(0), max_new_tokens=NEW_TOKENS,
        eos_id=10**6, pad_id=tokenizer.pad_id, temperature=0.0,
    )  # fmt: skip
    assert np.asarray(unstopped.tokens[0]).tolist() == free
    out = generate(
        ours, tokens, jnp.ones_like(tokens), jax.random.key(0), max_new_tokens=NEW_TOKENS,
        eos_id=stops, pad_id=tokenizer.pad_id, temperature=0.0,
    )  # fmt: skip
    kept = np.asarray(out.mask[0]).astype(bool)
    assert np.asarray(out.tokens[0])[kept].tolist() == theirs
    assert not kept[len(theirs) :].any()


@pytest.mark.parametrize("family", ["qwen3", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_generate_prints_what_transformers_generates(family, capsys):
    """``alignpipe generate FOLDER PROMPT``: the folder's template (Gemma 3 folds the system
    message into the user turn), greedy to the model's stop set, as transformers does."""
    folder = FIXTURES / family
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    model = _hf_model(folder)
    rows = range(len(tokenizer), model.config.get_text_config().vocab_size)  # past the tokenizer
    theirs = _theirs(model, np.asarray(ids), suppress=rows)
    args = ["generate", str(folder), "Hi!", "--system", "Be brief.", "--dtype", "float32"]
    args.append("--max-new-tokens")
    assert main([*args, str(NEW_TOKENS)]) == 0
    assert capsys.readouterr().out == tokenizer.decode(theirs, skip_special_tokens=True) + "\n"
    # --compare: a second policy's answer beside the first, each under its name.
    assert main([*args, "4", "--compare", str(FIXTURES / "qwen2")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"── {folder}\n") and f"\n── {FIXTURES / 'qwen2'}\n" in out
