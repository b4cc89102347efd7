"""Tokenizers: byte, Hugging Face, SentencePiece; pad distinct from eos; save and load."""

import json

import pytest

from components.core.data.tokenizers import (
    INFO_FILE,
    ByteTokenizer,
    HFTokenizer,
    TokenizerError,
    load_tokenizer,
)


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert len(ids) == len("héllo".encode()) and min(ids) >= 3
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == "héllo"
    assert len({tok.pad_id, tok.eos_id, tok.bos_id}) == 3 and tok.vocab_size == 259


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "<s>": 2, "hello": 3, "world": 4, "good": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "eos_token": "</s>",
        "bos_token": "<s>",
        "chat_template": "{{ messages[0]['content'] }}|",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_hf_tokenizer_adds_a_pad_id_distinct_from_eos(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [3, 4]
    assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.vocab_size) == (1, 2, 6, 7)
    assert tok.render_chat([{"role": "user", "content": "hi"}], True) == "hi|"


def test_saved_tokenizer_loads_with_same_fingerprint_and_detects_tampering(hf_dir, tmp_path):
    tok = load_tokenizer(str(hf_dir / "tokenizer.json"))
    tok.save(str(tmp_path / "saved"))
    again = load_tokenizer(str(tmp_path / "saved"))
    assert again.fingerprint == tok.fingerprint and again.info() == tok.info()
    data = json.loads((tmp_path / "saved" / "tokenizer.json").read_text())
    data["model"]["vocab"]["extra"] = 6
    (tmp_path / "saved" / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="fingerprint"):
        load_tokenizer(str(tmp_path / "saved"))


def test_sentencepiece_tokenizer(tmp_path):
    import sentencepiece as spm

    text = ["the good river is calm and bright"] * 50 + ["a bad cold city and a warm lake"] * 50
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=40,
        model_type="bpe",
        pad_id=-1,
    )
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    assert tok.kind == "sentencepiece"
    assert tok.pad_id not in (tok.eos_id, tok.bos_id) and tok.pad_id == tok.vocab_size - 1
    assert tok.decode(tok.encode("the good river")) == "the good river"


def test_bad_tokenizer_inputs_name_the_fix(tmp_path):
    with pytest.raises(TokenizerError, match="no such file"):
        load_tokenizer(str(tmp_path / "nope.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="holds no tokenizer.json"):
        load_tokenizer(str(tmp_path / "empty"))
    # Damaged files: each library's own error, named with the file and what to pass.
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "sp.model").write_bytes(b"not a model")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / INFO_FILE).write_text('{"schema_version": 1}')
    for damaged, error in [("tokenizer.json", "Model missing"), ("sp.model", "RuntimeError")]:
        with pytest.raises(
            TokenizerError, match=f"{damaged}: cannot be read .*{error}.* or 'byte'"
        ):
            load_tokenizer(str(tmp_path / damaged))
    with pytest.raises(TokenizerError, match="saved: cannot be read .KeyError: 'kind'"):
        load_tokenizer(str(tmp_path / "saved"))


def test_builtin_word_tokenizer_covers_the_task_one_token_per_word():
    from components.core.data.builtin_task import generate_pairs

    tok = load_tokenizer("builtin-words")
    assert tok.kind == "hf" and len({tok.pad_id, tok.eos_id, tok.bos_id}) == 3
    (unk,) = tok.encode("xyzzy")  # a word outside the task maps to <unk>
    for pair in generate_pairs(200, seed=9):
        for text in (pair["prompt"], pair["chosen"], pair["rejected"]):
            ids = tok.encode(text)
            assert unk not in ids and len(ids) == len(
                text.replace(".", " .").replace("?", " ?").split()
            )
            assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text
