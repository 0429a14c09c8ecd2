"""protocol.py alone: pre-encoded chunks equal json.dumps of OpenAI's shapes; validation."""

from __future__ import annotations

import json

import pytest
from zerod.engine import protocol as P
from zerod.engine.request import SamplingParams


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text,fr", [("hi", None), ('q"\\\n\u00e9\u4e2d\U0001f600', None),
                                     ("end", "stop"), ("", "length")])
def test_chunk_encoder_matches_json(kind, include_usage, text, fr):
    enc = P.ChunkEncoder(kind, "id-1", 123, 'm"x', include_usage)
    raw = enc.content(text, fr)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    obj = json.loads(raw[6:])
    choice = {"index": 0}
    if kind == "chat":
        choice.update(delta={"content": text}, logprobs=None, finish_reason=fr)
    else:
        choice.update(text=text, logprobs=None, finish_reason=fr)
    want = {"id": "id-1", "object": "chat.completion.chunk" if kind == "chat" else
            "text_completion", "created": 123, "model": 'm"x', "choices": [choice]}
    if include_usage:
        want["usage"] = None
    assert obj == want
    assert list(obj) == list(want)  # key order as OpenAI sends it
    u = json.loads(enc.usage(3, 4)[6:])
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                 "total_tokens": 7}
    if kind == "chat":
        r = json.loads(enc.role()[6:])
        assert r["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        f = json.loads(enc.finish("stop")[6:])
        assert f["choices"][0]["delta"] == {} and f["choices"][0]["finish_reason"] == "stop"


def test_completion_prompt_forms():
    assert P.parse_completion({"prompt": "a"}).prompt_text == "a"
    assert P.parse_completion({"prompt": ["a"]}).prompt_text == "a"
    assert P.parse_completion({"prompt": [1, 2]}).prompt_ids == [1, 2]
    assert P.parse_completion({"prompt": [[1, 2]]}).prompt_ids == [1, 2]
    r = P.parse_completion({"prompt": "a"})
    assert r.max_tokens == 16 and not r.stream
    assert P.parse_completion({"prompt": "a", "max_tokens": None}).max_tokens is None


def test_context_and_sampling_params():
    r = P.parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}],
                      "temperature": 0, "top_k": -1, "stop": "x", "seed": 7,
                      "stream": True, "stream_options": {"include_usage": True}})
    assert r.messages == [{"role": "user", "content": "ab"}] and r.include_usage
    assert P.check_context(r, 10, 100) == 90  # chat default: what the context leaves
    assert P.check_context(r, 10, 100, default_max_tokens=32) == 32
    assert P.check_context(r, 90, 100, default_max_tokens=32) == 10
    sp = P.build_sampling_params(SamplingParams, r, 90)
    assert (sp.temperature, sp.top_k, sp.stop, sp.seed, sp.max_tokens) == (0.0, 0, ["x"], 7, 90)
    r.max_tokens = 91
    with pytest.raises(P.APIError) as e:
        P.check_context(r, 10, 100)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(P.APIError):
        P.check_context(r, 100, 100)


def test_unknown_sampling_field_refused_when_engine_lacks_it():
    from dataclasses import dataclass

    @dataclass
    class Small:
        max_tokens: int = 16
        temperature: float = 1.0

    r = P.parse_completion({"prompt": "a", "temperature": 0.5})
    assert P.build_sampling_params(Small, r, 5) == Small(5, 0.5)
    r = P.parse_completion({"prompt": "a", "top_k": 5})
    with pytest.raises(P.APIError) as e:
        P.build_sampling_params(Small, r, 5)
    assert e.value.param == "top_k"


@pytest.mark.parametrize("text", ["a", 'q"', "\\", "\n\t", "é中😀", "\x1f", "\u2028", "\ud800x"])
def test_json_str_fast_path_equals_json(text):
    raw = P._json_str(text)
    assert json.loads(raw) == text
    if text != "\ud800x":
        assert raw == json.dumps(text, ensure_ascii=False).encode()
