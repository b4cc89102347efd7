"""Chat templates render as ``transformers`` renders them, for each fixture family.

alignpipe renders conversational preference data with the model's own Jinja template
(``tokenizers.render_chat_template``) in the shard stage; the prompts of rollouts and
evaluation, and the samples and report, are the shards' rendered text. Here the same
multi-turn conversations, with and without a system message, go through both renderers.
``transformers`` is imported in this module only (its import costs seconds).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core.data.tokenizers import load_tokenizer
from components.shard.formats import to_text_pair

transformers = pytest.importorskip("transformers")
from jinja2.exceptions import TemplateError  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ("llama", "qwen2", "gemma2")
SYSTEM = {"role": "system", "content": "You are a kind assistant.  "}
TURNS = [
    {"role": "user", "content": "  Name a colour, please."},
    {"role": "assistant", "content": "Blue.\n"},
    {"role": "user", "content": "Another one? ünïcode 🙂"},
]
REPLY = [{"role": "assistant", "content": "Green, like\tgrass."}]
CONVERSATIONS = {
    "one turn": TURNS[:1],
    "multi-turn": TURNS,
    "system, multi-turn": [SYSTEM, *TURNS],
    "system, multi-turn, reply": [SYSTEM, *TURNS, *REPLY],
}


@pytest.fixture(scope="module")
def renderers() -> dict:
    """Per family: alignpipe's tokenizer and transformers' for the same folder."""
    return {
        family: (
            load_tokenizer(str(FIXTURES / family)),
            transformers.AutoTokenizer.from_pretrained(str(FIXTURES / family)),
        )
        for family in FAMILIES
    }


def _theirs(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_rendering_is_transformers_own(renderers, family, name, add_generation_prompt):
    ours, theirs = renderers[family]
    messages = CONVERSATIONS[name]
    if family == "gemma2" and messages[0]["role"] == "system":
        # Gemma 2's template refuses a system role: both raise the template's own error.
        with pytest.raises(TemplateError, match="System role not supported"):
            _theirs(theirs, messages, add_generation_prompt)
        with pytest.raises(TemplateError, match="System role not supported"):
            ours.render_chat(messages, add_generation_prompt)
        return
    expected = _theirs(theirs, messages, add_generation_prompt)
    assert ours.render_chat(messages, add_generation_prompt) == expected
    assert ours.chat_template == theirs.chat_template
    # The rendered text tokenizes to the ids transformers gives it (special tokens included).
    assert ours.encode(expected) == theirs.encode(expected, add_special_tokens=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_conversational_pair_is_sharded_as_transformers_renders_it(renderers, family):
    """The shard stage's prompt is the rendering with the generation prompt, and each
    response the rest of the rendered conversation (its end-of-turn tokens included)."""
    ours, theirs = renderers[family]
    prompt = TURNS if family == "gemma2" else [SYSTEM, *TURNS]
    rejected = [{"role": "assistant", "content": "Grey, I suppose."}]
    record = {"prompt": prompt, "chosen": REPLY, "rejected": rejected}
    pair = to_text_pair(record, "conversational", ours)
    assert pair.prompt == _theirs(theirs, prompt, True)
    assert pair.prompt + pair.chosen == _theirs(theirs, prompt + REPLY, False)
    assert pair.prompt + pair.rejected == _theirs(theirs, prompt + rejected, False)
