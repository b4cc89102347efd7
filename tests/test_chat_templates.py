"""Chat templates render as ``transformers`` renders them, for each fixture family.

alignpipe renders conversational preference data with the model's own Jinja template
(``chat_templates.render_chat_template``) in the shard stage; the prompts of rollouts and
evaluation, and the samples and report, are the shards' rendered text. Here the same
multi-turn conversations, with and without a system message, go through both renderers.
``transformers`` is imported in this module only (its import costs seconds).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from components.core.data.tokenizers import load_tokenizer
from components.shard.formats import Invalid, to_text_pair
from components.shard.records import response_ids

transformers = pytest.importorskip("transformers")
from jinja2.exceptions import TemplateError  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
FAMILIES = ("llama", "qwen2", "gemma2", "qwen3", "mistral", "gemma3", "qwen3_5", "gemma4")
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


def _theirs(tokenizer, messages, add_generation_prompt: bool, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
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
    if family == "gemma3" and messages[0]["role"] == "system":
        assert messages[0]["content"] in _theirs(theirs, messages, add_generation_prompt)
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
    prompt = TURNS if family in ("gemma2", "mistral") else [SYSTEM, *TURNS]
    rejected = [{"role": "assistant", "content": "Grey, I suppose."}]
    record = {"prompt": prompt, "chosen": REPLY, "rejected": rejected}
    if family == "mistral":  # its template moves the system message once a reply follows
        with pytest.raises(Invalid, match="as a prefix") as refused:
            to_text_pair({**record, "prompt": [SYSTEM, *TURNS]}, FORMAT, ours)
        assert refused.value.reason == "chat_template"
    pair = to_text_pair(record, "conversational", ours)
    assert pair.prompt == _theirs(theirs, prompt, True)
    assert pair.prompt + pair.chosen == _theirs(theirs, prompt + REPLY, False)
    assert pair.prompt + pair.rejected == _theirs(theirs, prompt + rejected, False)


FORMAT = "conversational"
REASONING = [
    TURNS[0],
    {"role": "assistant", "content": "Blue.", "reasoning_content": "A colour: pick one."},
    TURNS[2],
    {"role": "assistant", "content": "<think>\nMore colours.\n</think>\n\nGreen."},
]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("enable_thinking", [True, False, None])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_qwen3_thinking_renders_as_transformers_does(renderers, family, enable_thinking, name):
    """Qwen3's and Qwen3.5's template argument ``enable_thinking`` both ways (and unset),
    their think blocks from ``reasoning_content`` and from the content, as transformers
    renders them. Qwen3.5 thinks by default: its generation prompt opens a think block."""
    ours, theirs = renderers[family]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    for messages in (CONVERSATIONS[name], [SYSTEM, *REASONING]):
        for generation in (True, False):
            expected = _theirs(theirs, messages, generation, **kwargs)
            assert ours.render_chat(messages, generation, **kwargs) == expected
    closed = "<think>\n\n</think>\n\n"
    prompt = ours.render_chat(TURNS[:1], True, **kwargs)
    assert prompt.endswith(closed) == (enable_thinking is False)
    opened = family == "qwen3_5" and enable_thinking is not False
    assert prompt.endswith("assistant\n<think>\n") == opened


def test_reasoning_content_and_text_parts_reach_the_template(renderers):
    ours, _ = renderers["qwen3"]
    record = {
        "prompt": [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
        "chosen": [{"role": "assistant", "content": "Blue.", "reasoning_content": "Think."}],
        "rejected": [{"role": "assistant", "content": "Grey."}],
    }
    pair = to_text_pair(record, "conversational", ours)
    assert "Name a colour." in pair.prompt
    assert pair.chosen.startswith("<think>\nThink.\n</think>\n\nBlue.<|im_end|>")
    assert pair.rejected.startswith("<think>\n\n</think>\n\nGrey.")
    image = [{"type": "image", "url": "x.png"}, {"type": "text", "text": "What is it?"}]
    with pytest.raises(Invalid, match="image part") as refused:
        to_text_pair({**record, "prompt": [{"role": "user", "content": image}]}, FORMAT, ours)
    assert refused.value.reason == "unsupported_content"


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "mistral", "llama", "qwen3_5", "gemma4"])
def test_a_response_ends_where_the_template_ends_the_turn(renderers, family):
    """The shard's response ids end with the template's end-of-turn (a stop id), nothing
    appended after: Gemma's ``<end_of_turn>``, not ``<end_of_turn>\\n<eos>``."""
    ours, _ = renderers[family]
    prompt = TURNS[:1]
    record = {"prompt": prompt, "chosen": REPLY, "rejected": [REPLY[0] | {"content": "No."}]}
    pair = to_text_pair(record, "conversational", ours)
    ids = response_ids(ours, pair.chosen)
    assert ids[-1] in ours.stop_ids and sum(i in ours.stop_ids for i in ids) == 1
    assert ours.decode(ids).strip() == ours.decode(ours.encode(pair.chosen)).strip()
    plain = response_ids(ours, "Green, like grass.")
    assert plain[-1] == ours.eos_id and plain[:-1] == ours.encode("Green, like grass.")


# Qwen's tool section, as its released templates write it (system block of function
# schemas, <tool_call> turns, tool replies as user turns): the fixtures' templates have none.
TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}}  # fmt: skip
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


def test_a_records_tools_and_tool_calls_reach_the_template_as_transformers_passes_them(tmp_path):
    """A dataset's ``tools`` column (function schemas; a JSON string of them too) and its
    messages' ``tool_calls``, tool replies and their ``name`` render as transformers renders
    ``apply_chat_template(messages, tools=...)``: TRL's tool-use records, for sft on the
    call or on the answer after the tool's reply, and for RL prompts that offer the tools."""
    import json
    import shutil

    folder = tmp_path / "qwen3_tools"
    shutil.copytree(FIXTURES / "qwen3", folder)
    (folder / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    ours, theirs = load_tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(folder)
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "name": "get_weather", "content": "18C, sunny"},
        {"role": "assistant", "content": "18C and sunny."},
    ]

    def rendered(messages: list, prompt: bool) -> str:
        return theirs.apply_chat_template(
            messages, tools=[WEATHER], tokenize=False, add_generation_prompt=prompt
        )

    for end, tools in ((2, [WEATHER]), (4, json.dumps([WEATHER]))):  # the call; the answer
        pair = to_text_pair({"messages": turns[:end], "tools": tools}, "messages", ours)
        assert pair.prompt == rendered(turns[: end - 1], True)
        assert pair.prompt + pair.chosen == rendered(turns[:end], False)
        assert '"name": "get_weather"' in pair.prompt  # the schema, in the system block
    call = to_text_pair({"messages": turns[:2], "tools": [WEATHER]}, "messages", ours)
    assert call.chosen.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city"')
    # A prompt-only record offers them to the policy: its prompt holds the schemas.
    prompt = to_text_pair({"prompt": turns[:1], "tools": [WEATHER]}, "conversational_prompt", ours)
    assert prompt.prompt == rendered(turns[:1], True) and "tools" in json.loads(prompt.columns)
    for bad in ("{not json", [3], 3):
        with pytest.raises(Invalid, match="field 'tools'"):
            to_text_pair({"messages": turns[:2], "tools": bad}, "messages", ours)


def test_a_records_own_template_arguments_override_the_runs(renderers):
    """A ``chat_template_kwargs`` column (SmolTalk2's rows carry ``enable_thinking``; TRL
    passes it to ``apply_chat_template``), an object or a JSON string, renders each record
    as transformers does with those arguments, over the run's ``chat_template_kwargs``."""
    import json

    ours, theirs = renderers["qwen3"]
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    prompts = {}
    for own in (False, True):
        prompts[own] = theirs.apply_chat_template(
            turns[:1], tokenize=False, add_generation_prompt=True, enable_thinking=own
        )
        for given in ({"enable_thinking": own}, json.dumps({"enable_thinking": own})):
            record = {"messages": turns, "chat_template_kwargs": given}
            pair = to_text_pair(record, "messages", ours, {"enable_thinking": not own})
            assert pair.prompt == prompts[own]
    assert prompts[False] != prompts[True]  # the argument matters to this template
    with pytest.raises(Invalid, match="field 'chat_template_kwargs' must be an object"):
        to_text_pair({"messages": turns, "chat_template_kwargs": [1]}, "messages", ours)


def test_a_processors_chat_template_json_is_the_template_when_the_folder_has_no_other(
    renderers, tmp_path
):
    """Multimodal releases saved by transformers 4.4x-4.5x keep their template in the
    processor's chat_template.json; a folder with no other template takes it, and carries it
    on as chat_template.jinja (where an export ships it and a tokenizer reads it)."""
    import json
    import shutil

    from components.core.data.tokenizers import TokenizerError

    folder = tmp_path / "gemma3_mm"
    shutil.copytree(FIXTURES / "gemma3_mm", folder, ignore=shutil.ignore_patterns("*.npz"))
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    ours = load_tokenizer(str(folder))
    assert ours.chat_template == template
    messages = CONVERSATIONS["system, multi-turn"]
    theirs = renderers["gemma3"][1]  # the same template, from the text fixture's .jinja
    assert ours.render_chat(messages, add_generation_prompt=True) == _theirs(theirs, messages, True)
    saved = tmp_path / "saved"
    ours.save(str(saved))
    assert (saved / "chat_template.jinja").read_text() == template
    assert not (saved / "chat_template.json").exists()
    assert load_tokenizer(str(saved)).fingerprint == ours.fingerprint
    # tokenizer_config.json's own template wins over the processor's.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{x}}"}))
    assert load_tokenizer(str(folder)).chat_template == "{{x}}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for bad in ("[1, 2]", '{"chat_template": ["a"]}'):
        (folder / "chat_template.json").write_text(bad)
        with pytest.raises(TokenizerError, match="chat_template.json"):
            load_tokenizer(str(folder))


def test_an_export_writes_a_template_its_copied_files_do_not_hold(tmp_path):
    """An export whose tokenizer read its template from a processor's chat_template.json
    (the original folder given as --tokenizer) ships it as chat_template.jinja; one the
    copied tokenizer_config.json states is left there."""
    import json

    from components.core.data.tokenizers import HFTokenizer
    from components.hf.export import _write_template

    tokenizer = HFTokenizer(
        (FIXTURES / "gemma3" / "tokenizer.json").read_bytes(), None,
        {"chat_template.json": json.dumps({"chat_template": "{{ x }}"}).encode()},
    )  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text("{}")
    _write_template(str(tmp_path), tokenizer)
    assert (tmp_path / "chat_template.jinja").read_text() == "{{ x }}"
    stated = tmp_path / "stated"
    stated.mkdir()
    (stated / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    _write_template(str(stated), tokenizer)
    assert not (stated / "chat_template.jinja").exists()
