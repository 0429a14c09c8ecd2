"""protocol.py alone: pre-encoded chunks equal json.dumps of OpenAI's shapes; validation."""

from __future__ import annotations

import json

import pytest
from zerod.engine.api import protocol as P
from zerod.engine.core.request import SamplingParams


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
    u = json.loads(enc.usage(3, 4, 2)[6:])
    assert u["choices"] == [] and u["usage"] == {"prompt_tokens": 3, "completion_tokens": 4,
                                                 "total_tokens": 7,
                                                 "prompt_tokens_details": {"cached_tokens": 2}}
    if kind == "chat":
        r = json.loads(enc.role()[6:])
        assert r["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        f = json.loads(enc.finish("stop")[6:])
        assert f["choices"][0]["delta"] == {} and f["choices"][0]["finish_reason"] == "stop"


SCHEMAS = P.RequestSchemas(P.Limits(max_model_len=100, vocab_size=50, max_prompt_chars=400))


def test_completion_prompt_forms():
    parse = SCHEMAS.parse_completion
    assert parse({"prompt": "a"}).prompt_text == "a"
    assert parse({"prompt": ["a"]}).prompt_text == "a"
    assert parse({"prompt": [1, 2]}).prompt_ids == [1, 2]
    assert parse({"prompt": [[1, 2]]}).prompt_ids == [1, 2]
    r = parse({"prompt": "a"})
    assert r.max_tokens == 16 and not r.stream
    assert parse({"prompt": "a", "max_tokens": None}).max_tokens is None
    assert parse({"prompt": "a", "max_tokens": 7.0}).max_tokens == 7  # JSON's integer


def test_context_and_sampling_params():
    r = SCHEMAS.parse_chat({"messages": [{"role": "user", "content": [
                                {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                            "temperature": 0, "top_k": -1, "stop": "x", "seed": 7,
                            "stream": True, "stream_options": {"include_usage": True}})
    assert r.messages == [{"role": "user", "content": "ab"}] and r.include_usage
    assert P.check_context(r, 10, 100) == 90  # chat default: what the context leaves
    assert P.check_context(r, 10, 100, default_max_tokens=32) == 32
    assert P.check_context(r, 90, 100, default_max_tokens=32) == 10
    sp = P.sampling_params(r, 90)
    assert isinstance(sp, SamplingParams)
    assert (sp.temperature, sp.top_k, sp.stop, sp.seed, sp.max_tokens) == (0.0, 0, ["x"], 7, 90)
    r.max_tokens = 91
    with pytest.raises(P.APIError) as e:
        P.check_context(r, 10, 100)
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    with pytest.raises(P.APIError):
        P.check_context(r, 100, 100)


@pytest.mark.parametrize("body,param", [
    ({"prompt": "a", "top_k": 51}, "top_k"),
    ({"prompt": "a", "min_tokens": 101}, "min_tokens"),
    ({"prompt": [50]}, "prompt"),
    ({"prompt": "a", "stop_token_ids": [3, 50]}, "stop_token_ids"),
    ({"prompt": "a", "seed": 2**63}, "seed"),
    ({"prompt": "a", "temperature": float("nan")}, "temperature"),
    ({"prompt": "a", "top_p": float("inf")}, "top_p"),
    ({"prompt": "a", "max_tokens": 101}, "max_tokens"),
])
def test_numeric_fields_bounded_by_the_engine(body, param):
    with pytest.raises(P.APIError) as e:
        SCHEMAS.parse_completion(body)
    assert e.value.status == 400 and e.value.param == param


def test_text_that_cannot_fit_is_refused_before_tokenizing():
    SCHEMAS.parse_completion({"prompt": "a" * 400})
    for body, parse in (({"prompt": "a" * 401}, SCHEMAS.parse_completion),
                        ({"messages": [{"role": "user", "content": "a" * 200},
                                       {"role": "user", "content": "b" * 201}]},
                         SCHEMAS.parse_chat)):
        with pytest.raises(P.APIError) as e:
            parse(body)
        assert e.value.code == "context_length_exceeded"
        assert "maximum context length is 100 tokens" in e.value.message


def test_json_depth_limit():
    ok = json.dumps({"prompt": "a", "x": json.loads("[" * 63 + "]" * 63)}).encode()
    assert P.parse_body(ok)["prompt"] == "a"
    for raw in (json.dumps({"x": json.loads("[" * 64 + "]" * 64)}).encode(),
                b"[" * 200_000 + b"]" * 200_000):
        with pytest.raises(P.APIError) as e:
            P.parse_body(raw)
        assert e.value.status == 400 and "nested deeper than 64" in e.value.message


def test_schema_is_the_validation_table():
    """The published schema carries the same bounds the validator enforces."""
    props = SCHEMAS.completion.schema()["properties"]
    assert props["top_k"]["anyOf"][0] == {"type": "integer", "minimum": -1, "maximum": 50}
    assert props["min_tokens"]["anyOf"][0]["maximum"] == 100
    ids = props["prompt"]["anyOf"][1]
    assert ids["items"] == {"type": "integer", "minimum": 0, "maximum": 49}
    assert SCHEMAS.completion.schema()["required"] == ["prompt"]
    chat = SCHEMAS.chat.schema()
    assert chat["required"] == ["messages"]
    role = chat["properties"]["messages"]["items"]["properties"]["role"]
    assert set(role["enum"]) == {"system", "user", "assistant", "tool", "developer"}


@pytest.mark.parametrize("text", ["a", 'q"', "\\", "\n\t", "é中😀", "\x1f", "\u2028", "\ud800x"])
def test_json_str_fast_path_equals_json(text):
    raw = P._json_str(text)
    assert json.loads(raw) == text
    if text != "\ud800x":
        assert raw == json.dumps(text, ensure_ascii=False).encode()


def test_engine_bounds_behind_the_schema_answer_400_not_500():
    """A value the schema lets through but the engine's SamplingParams refuses is still a
    400 naming the field (schemathesis found repetition_penalty=5e-324 answering 500)."""
    from zerod.engine.api import protocol as P

    schemas = P.RequestSchemas(P.Limits(max_model_len=64, vocab_size=100))
    req = schemas.parse_completion({"prompt": "x", "max_tokens": 4, "repetition_penalty": 1.5})
    req.repetition_penalty = 5e-324            # as if the schema's bound had drifted
    with pytest.raises(P.APIError) as ei:
        P.sampling_params(req, 4)
    assert ei.value.status == 400 and ei.value.param == "repetition_penalty"
    # and the schema itself now carries the engine's bound
    with pytest.raises(P.APIError) as ei:
        schemas.parse_completion({"prompt": "x", "repetition_penalty": 5e-324})
    assert ei.value.status == 400
