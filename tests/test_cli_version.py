"""``alignpipe --version``, ``alignpipe generate``'s refusals and ``alignpipe chat``
(generate's answers are compared with transformers' in test_hf_pipeline.py)."""

from __future__ import annotations

import pytest

from pipelines.cli.main import main


def test_version_names_the_release_and_the_commit(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("alignpipe 0.1.0")


def test_generate_refuses_what_it_cannot_talk_to(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "Hi"]) == 2
    assert str(tmp_path / "missing") in capsys.readouterr().err
    args = ["generate", str(tmp_path), "Hi", "--chat-template-kwargs", "[1]"]
    assert main(args) == 2
    assert "must be a JSON object" in capsys.readouterr().err


QWEN2 = str(__import__("pathlib").Path(__file__).resolve().parent / "fixtures" / "hf" / "qwen2")


def test_chat_carries_the_conversation_and_answers_as_generate_does(monkeypatch, capsys):
    """Each turn renders the whole conversation; the first answer is generate's for the
    same message (greedy), and /reset starts a fresh conversation."""
    from components.core.model import respond

    prompts = []
    real = respond.respond

    def recording(model, tokenizer, prompt, sampling):
        prompts.append(prompt)
        return real(model, tokenizer, prompt, sampling)

    monkeypatch.setattr(respond, "respond", recording)
    lines = iter(["Hi!", "And then?", "/reset", "Hi!", "/exit", "never read"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", QWEN2, "--max-new-tokens", "6", "--system", "Be brief."]) == 0
    out = capsys.readouterr().out.splitlines()
    answers = [line.split("> ", 1)[1] for line in out if line.startswith("qwen2> ")]
    assert len(answers) == 3 and answers[2] == answers[0]
    assert prompts[0] == prompts[2] and prompts[1].startswith(prompts[0])
    assert prompts[1].count("<|im_start|>user") == 2 and "Be brief." in prompts[1]
    monkeypatch.setattr(respond, "respond", real)
    assert main(["generate", QWEN2, "Hi!", "--system", "Be brief.", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == answers[0] + "\n"


def test_a_long_conversation_drops_its_oldest_turns_and_keeps_the_system_message():
    from components.core.data.tokenizers import load_tokenizer
    from components.core.model.respond import fit_conversation

    tokenizer = load_tokenizer(QWEN2)
    system = {"role": "system", "content": "Be brief."}
    turns = [{"role": r, "content": f"{r} message {i} " * 4} for i in range(4)
             for r in ("user", "assistant")][:-1]  # fmt: skip
    whole, kept = fit_conversation(tokenizer, [system, *turns], 10_000)
    assert kept == [system, *turns]
    needed = len(tokenizer.encode_prompt(whole))
    prompt, kept = fit_conversation(tokenizer, [system, *turns], needed - 1)
    assert kept[0] == system and kept[1:] == turns[2:]  # one exchange dropped
    assert len(tokenizer.encode_prompt(prompt)) <= needed - 1
    with pytest.raises(ValueError, match="shorten it or lower --max-new-tokens"):
        fit_conversation(tokenizer, [system, turns[-1]], 5)
