"""Tokenizer, chat template and the UTF-8-safe incremental detokenizer."""

from __future__ import annotations

import pytest

from zerod.engine.config import EngineError
from zerod.engine.demo import write_tokenizer
from zerod.engine.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d)
    return Tokenizer(d)


TEXTS = ["Café naïve 🙂 — 日本語 ok", "🚀🚀 x", "ß", "plain ascii text", "中文 русский ελληνικά"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detok_never_emits_broken_utf8(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.encode("utf-8")) // 4   # multi-byte characters are split over tokens
    d = IncrementalDetokenizer(tok, tok.encode("Hello:", add_special_tokens=True))
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    assert all("\ufffd" not in p for p in pieces), pieces
    assert "".join(pieces) == text
    for p in pieces:
        p.encode("utf-8")        # each piece is valid on its own


def test_split_emoji_held_back_until_complete(tok):
    ids = tok.encode("🙂", add_special_tokens=False)
    assert len(ids) >= 2
    d = IncrementalDetokenizer(tok)
    assert [d.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.add(ids[-1]) == "🙂"


def test_out_of_vocab_ids_and_specials_decode_empty(tok):
    d = IncrementalDetokenizer(tok)
    assert d.add(tok.vocab_size + 5) == ""
    assert d.add(1) == ""  # </s> is special
    assert d.add(tok.encode("ok", add_special_tokens=False)[0]) != ""


def test_skip_special_tokens_false_keeps_their_text(tok):
    """skip_special_tokens: false (a request field) shows special tokens as their text."""
    d = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert d.add(1) == tok.decode([1], skip_special_tokens=False) != ""


def test_encode_adds_bos(tok):
    ids = tok.encode("hi")
    assert ids[0] == 0 and tok.encode("hi", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "hi"
    assert tok.eos_token_ids == [1]


def test_chat_template(tok):
    s = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": "hi"}])
    assert s == "<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    s2 = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert not s2.endswith("assistant\n")
    from jinja2.exceptions import TemplateError
    with pytest.raises(TemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_chat_template_hf_features(tmp_path):
    import json
    write_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template":
                             "{% for m in messages %}{{ m|tojson }}{% endfor %}"
                             "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(tmp_path)
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == '{"role": "user", "content": "é"}</s>'


def test_missing_tokenizer_refused(tmp_path):
    with pytest.raises(EngineError, match="tokenizer.json"):
        Tokenizer(tmp_path)
