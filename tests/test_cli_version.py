"""``alignpipe --version`` and ``alignpipe generate``'s refusals (its answers are compared
with transformers' in test_hf_pipeline.py)."""

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
