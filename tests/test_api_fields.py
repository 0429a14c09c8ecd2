"""Every field of the published request schemas, walked: each one sent with a value other
than its default is either served (200) or refused with a 400 that names it (code
`unsupported`). A field added to a table without an entry here fails the walk, so nothing
can be silently ignored."""

from __future__ import annotations

import json

import pytest
from test_server_fake import FakeEngine, _post
from zerod.engine.api.server import ServerThread

MSGS = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]
OK, NO = "served", "refused"

# field -> (a non-default value, what the server does with it)
COMMON = {
    "model": ("fake", OK), "stream": (True, OK), "stream_options": ({"include_usage": True}, OK),
    "n": (2, OK), "best_of": (2, NO), "priority": (1, NO), "temperature": (0.5, OK),
    "top_p": (0.5, OK),
    "top_k": (5, OK), "min_tokens": (1, OK), "seed": (7, OK), "stop": (["zz"], OK),
    "stop_token_ids": ([5], OK), "ignore_eos": (True, OK), "presence_penalty": (0.5, OK),
    "frequency_penalty": (0.5, OK), "repetition_penalty": (1.2, OK),
    "logit_bias": ({"5": 10}, OK), "min_p": (0.1, OK), "include_stop_str_in_output": (True, OK),
    "skip_special_tokens": (False, OK), "spaces_between_special_tokens": (False, NO),
    "return_tokens_as_token_ids": (True, OK),
    "structured_outputs": ({"json": {"type": "object"}}, OK),
    "guided_json": ({"type": "object"}, OK), "guided_regex": ("a+", OK),
    "guided_choice": (["a", "b"], OK), "guided_grammar": ("root ::= 'a'", OK),
    "guided_decoding_backend": ("xgrammar", NO), "guided_whitespace_pattern": (" ", NO),
    "prompt_logprobs": (1, OK), "user": ("me", OK), "metadata": ({"k": "v"}, OK), "store": (False, OK),
    "service_tier": ("auto", OK), "prompt_cache_key": ("k", OK), "safety_identifier": ("s", OK),
}
COMPLETION = {**COMMON, "prompt": ("hello", OK), "max_tokens": (3, OK), "echo": (True, OK),
              "logprobs": (2, OK), "suffix": ("end", NO)}
CHAT = {**COMMON, "messages": (MSGS, OK), "max_tokens": (3, OK),
        "max_completion_tokens": (3, OK), "add_generation_prompt": (False, OK),
        "logprobs": (True, OK), "top_logprobs": (2, OK),
        "tools": (TOOLS, OK), "tool_choice": ("required", OK), "parallel_tool_calls": (False, OK),
        "response_format": ({"type": "json_object"}, OK),
        "chat_template_kwargs": ({"enable_thinking": False}, OK),
        "documents": ([{"title": "t", "text": "x"}], OK),
        "continue_final_message": (True, OK), "chat_template": ("{{ x }}", NO)}
# stream_options needs stream, top_logprobs logprobs; continue_final_message needs a final
# assistant message; tools without tool_choice mean "auto", which this server (no
# --tool-call-parser) refuses
NEEDS = {"stream_options": {"stream": True}, "top_logprobs": {"logprobs": True},
         "tools": {"tool_choice": "none"}, "tool_choice": {"tools": TOOLS},
         "continue_final_message": {"messages": MSGS + [{"role": "assistant", "content": "a"}],
                                    "add_generation_prompt": False}}


class _Compiler:
    """Accepts every grammar (the fake engine ignores it)."""

    def compile(self, spec):
        return spec


@pytest.fixture(scope="module")
def fake():
    eng = FakeEngine()
    eng.grammar_compiler = _Compiler()   # the walk checks the protocol; grammars: test_structured_*
    srv = ServerThread(eng).start()
    yield eng, srv
    srv.stop()
    eng.shutdown()


@pytest.mark.parametrize("path,schema,table,base", [
    ("/v1/completions", "CompletionRequest", COMPLETION, {"prompt": "x", "max_tokens": 2}),
    ("/v1/chat/completions", "ChatCompletionRequest", CHAT, {"messages": MSGS, "max_tokens": 2}),
])
async def test_every_published_field_is_served_or_refused_by_name(fake, path, schema, table,
                                                                  base):
    eng, srv = fake
    props = srv.server.schemas.completion.schema() if schema == "CompletionRequest" else \
        srv.server.schemas.chat.schema()
    assert set(props["properties"]) == set(table), "a published field has no entry here"
    assert props["additionalProperties"] is False
    for name, (value, expect) in table.items():
        body = {**base, **NEEDS.get(name, {}), name: value}
        st, _, raw = await _post(srv.url + path, body)
        if expect == OK:
            assert st == 200, (name, raw[:300])
        else:
            err = json.loads(raw)["error"]
            assert st == 400 and err["param"].split(".")[0] == name, (name, err)
            assert err["code"] == "unsupported", (name, err)


async def test_unknown_fields_refused_at_every_level(fake):
    eng, srv = fake
    for path, body, param in (
            ("/v1/completions", {"prompt": "x", "temprature": 0.5}, "temprature"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x",
                                                    "contnet": "y"}]}, "messages[0].contnet"),
            ("/v1/completions", {"prompt": "x", "stream": True,
                                 "stream_options": {"include_usge": True}},
             "stream_options.include_usge")):
        st, _, raw = await _post(srv.url + path, body)
        err = json.loads(raw)["error"]
        assert st == 400 and err["param"] == param and err["code"] == "unknown_field", err
