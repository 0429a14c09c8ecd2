"""Structured outputs with --reasoning-parser on the real engine, through the official
`openai` client: the grammar constrains the answer after `</think>`, never the reasoning.

The model has random weights and a tokenizer with `<think>` and `</think>` as tokens
(as Qwen3's and DeepSeek-R1's); it writes `</think>` when `logit_bias` pushes it, so
where the reasoning ends is the test's choice, and every valid answer is the mask's
doing. Its chat template closes the thinking in the prompt with enable_thinking: false,
as Qwen3's does.
"""

from __future__ import annotations

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from zerod.engine.reasoning import THINK_END, THINK_START
from zerod.engine.api.server import ServerThread
from zerod.engine.sampling.reasoning_gate import ReasoningGate
from zerod.engine.sampling.structured import (GrammarCompiler, GrammarSpec, advance_all,
                                              fill_masks)

MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
          "properties": {"city": {"type": "string", "maxLength": 8},
                         "days": {"type": "integer", "minimum": 0, "maximum": 9}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
EOS = 1   # demo.make_checkpoint's
SEEDS = range(6)


def _with_think_tokens(d):
    """The demo checkpoint's tokenizer with `<think>` / `</think>` as single tokens, and
    a template that closes the thinking in the prompt under enable_thinking: false."""
    from tokenizers import AddedToken, Tokenizer

    from zerod.engine.demo import CHAT_TEMPLATE, make_checkpoint

    make_checkpoint(d, "llama")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in (THINK_START, THINK_END)])
    tok.save(str(d / "tokenizer.json"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    gen = "<|im_start|>assistant\n{% endif %}"
    assert gen in CHAT_TEMPLATE
    cfg["chat_template"] = CHAT_TEMPLATE.replace(gen, (
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}"))
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok.token_to_id(THINK_START), tok.token_to_id(THINK_END)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from zerod.engine.core.engine import Engine, EngineConfig

    d = tmp_path_factory.mktemp("think-model")
    start, end = _with_think_tokens(d)
    eng = Engine(EngineConfig(model=str(d), device="cpu", max_model_len=512, kv_pages=512,
                              max_num_seqs=16, seed=0))
    eng.start()
    servers = {p: ServerThread(eng, reasoning_parser=p).start() for p in ("deepseek_r1", "qwen3")}
    clients = {p: openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
               for p, s in servers.items()}
    yield eng, clients, start, end
    for s in servers.values():
        s.stop()
    eng.shutdown(0)


def _ask(c, eng, seed, bias, **kw):
    kw.setdefault("max_tokens", 300)
    return c.chat.completions.create(model=eng.model_name, messages=kw.pop("messages", MSGS),
                                     seed=seed, logit_bias={str(k): v for k, v in bias.items()},
                                     **kw)


def _streamed(c, eng, seed, bias, **kw):
    """(reasoning, content, tool-call deltas, finish reason) of a stream."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in _ask(c, eng, seed, bias, stream=True, **kw):
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    return reasoning or None, content or None, calls, finish


def test_the_answer_after_the_reasoning_follows_the_schema(live):
    eng, clients, _, end = live
    thought = []
    for seed in SEEDS:
        # `</think>` comes after a few free tokens; no end of text before the answer
        r = _ask(clients["deepseek_r1"], eng, seed, {end: 6, EOS: -100}, response_format=FORMAT)
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), SCHEMA)
        reasoning = ch.message.model_extra["reasoning_content"]
        assert reasoning == ch.message.model_extra["reasoning"]
        assert THINK_END not in (reasoning or "")   # (the answer's strings may hold it)
        thought.append(reasoning)
    assert sum(bool(t) for t in thought) >= len(SEEDS) // 2, thought   # some thinking first


def test_the_reasoning_is_not_constrained_and_a_cut_one_has_no_answer(live):
    eng, clients, _, end = live
    for parser, fmt in (("deepseek_r1", {"structured_outputs": {"regex": "[0-9]+"}}),
                        ("deepseek_r1", {"guided_json": SCHEMA})):
        for seed in SEEDS[:3]:
            r = _ask(clients[parser], eng, seed, {end: -100, EOS: -100}, max_tokens=12,
                     extra_body=fmt)
            ch = r.choices[0]
            assert ch.finish_reason == "length" and ch.message.content is None, ch
            reasoning = ch.message.model_extra["reasoning_content"]
            assert reasoning and r.usage.completion_tokens == 12
            # text neither grammar allows where the answer starts
            assert not re.fullmatch(r"[0-9]+", reasoning) and not reasoning.startswith("{")
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):   # a named function cut while thinking: no call at all
        kw = dict(max_tokens=8, tools=[WEATHER], tool_choice=named)
        if stream:
            reasoning, content, calls, finish = _streamed(clients["deepseek_r1"], eng, 0,
                                                          {end: -100, EOS: -100}, **kw)
        else:
            ch = _ask(clients["deepseek_r1"], eng, 0, {end: -100, EOS: -100}, **kw).choices[0]
            reasoning, content = ch.message.model_extra["reasoning_content"], ch.message.content
            calls, finish = ch.message.tool_calls or [], ch.finish_reason
        assert (content, calls, finish) == (None, [], "length") and reasoning


def test_a_stream_splits_as_the_whole_answer(live):
    eng, clients, _, end = live
    for seed in SEEDS[:3]:
        for bias, tokens in (({end: 6, EOS: -100}, 300), ({end: -100, EOS: -100}, 10)):
            whole = _ask(clients["deepseek_r1"], eng, seed, bias, max_tokens=tokens,
                         response_format=FORMAT).choices[0]
            got = _streamed(clients["deepseek_r1"], eng, seed, bias, max_tokens=tokens,
                            response_format=FORMAT)
            assert got == (whole.message.model_extra["reasoning_content"],
                           whole.message.content, [], whole.finish_reason)


def test_tool_choice_required_and_named_call_after_the_reasoning(live):
    eng, clients, _, end = live
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in SEEDS[:3]:
        r = _ask(clients["deepseek_r1"], eng, seed, {end: 6, EOS: -100}, tools=[WEATHER],
                 tool_choice="required")
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in ch.message.tool_calls]
        assert calls and all(name == "get_weather" for name, _ in calls)
        for _, args in calls:
            jsonschema.validate(args, SCHEMA)
        assert THINK_END not in (ch.message.model_extra["reasoning_content"] or "")
        _, _, deltas, finish = _streamed(clients["deepseek_r1"], eng, seed, {end: 6, EOS: -100},
                                         tools=[WEATHER], tool_choice="required")
        streamed: dict[int, list[str]] = {}
        for d in deltas:
            got = streamed.setdefault(d.index, ["", ""])
            got[0] += d.function.name or ""
            got[1] += d.function.arguments or ""
        assert finish == "tool_calls"
        assert [(name, json.loads(args)) for name, args in streamed.values()] == calls

        r = _ask(clients["deepseek_r1"], eng, seed, {end: 6, EOS: -100}, tools=[WEATHER],
                 tool_choice=named)
        [call] = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_a_prompt_that_closed_the_thinking_is_all_answer(live):
    """enable_thinking: false closes the thinking in the prompt: the grammar runs from the
    first token and the output is all content, with either parser."""
    eng, clients, _, end = live
    for parser in ("deepseek_r1", "qwen3"):
        for seed in SEEDS[:3]:
            r = _ask(clients[parser], eng, seed, {end: 6, EOS: -100}, response_format=FORMAT,
                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            ch = r.choices[0]
            assert ch.finish_reason == "stop", ch
            jsonschema.validate(json.loads(ch.message.content), SCHEMA)
            assert ch.message.model_extra["reasoning_content"] is None


def test_qwen3_thinks_only_when_the_output_opens_with_think(live):
    """qwen3: an output opening with `<think>` reasons until `</think>`; one that does not
    is all answer, the grammar's from its first token. Either way the answer is valid."""
    eng, clients, start, end = live
    for seed in SEEDS[:3]:
        thinks = _ask(clients["qwen3"], eng, seed, {start: 8, end: 8, EOS: -100},
                      response_format=FORMAT).choices[0]
        assert thinks.finish_reason == "stop", thinks
        jsonschema.validate(json.loads(thinks.message.content), SCHEMA)
        assert thinks.message.model_extra["reasoning_content"] is not None
        plain = _ask(clients["qwen3"], eng, seed, {start: -100, EOS: -100},
                     response_format=FORMAT).choices[0]
        jsonschema.validate(json.loads(plain.message.content), SCHEMA)
        assert plain.message.model_extra["reasoning_content"] is None


# ---------------------------------------------------------------- the gate, token by token

@pytest.fixture(scope="module")
def demo_tok():
    from zerod.engine.demo import demo_model_dir
    from zerod.engine.tokenizer import Tokenizer

    tok = Tokenizer(demo_model_dir())
    return tok, GrammarCompiler(tok, tok.vocab_size)


def _mask_row(compiler, state):
    import torch
    m = torch.zeros(1, compiler.mask_words, dtype=torch.int32)
    fill_masks([state], m, [0])
    return m[0]


def test_an_end_tag_written_in_several_tokens_opens_the_grammar_after_its_last(demo_tok):
    """A tokenizer without `</think>` as a token: the model writes it in pieces; the
    rows stay free until the piece that completes it, then the grammar's first mask."""
    tok, compiler = demo_tok
    grammar = compiler.compile(GrammarSpec("regex", "[0-9]+"))
    prompt = tok.encode("hi", add_special_tokens=True)
    state = compiler.new_state(grammar, ReasoningGate("deepseek_r1", tok, prompt, True))
    ids = tok.encode("zz" + THINK_END, add_special_tokens=False)
    tag = [i for i in ids if tok.decode([i]) in THINK_END]
    assert len(tag) > 1   # the tag is several tokens here
    fresh = _mask_row(compiler, compiler.new_state(grammar))
    for i in ids:
        assert state.gated and bool((_mask_row(compiler, state) == -1).all())
        assert advance_all([state], [i]) == [True]
    assert not state.gated
    assert bool((_mask_row(compiler, state) == fresh).all())   # the grammar from its start


def test_qwen3_first_mask_is_the_grammars_and_think(demo_tok):
    tok, compiler = demo_tok
    grammar = compiler.compile(GrammarSpec("regex", "[0-9]+"))
    gate = ReasoningGate("qwen3", tok, tok.encode("hi"), True)
    state = compiler.new_state(grammar, gate)
    row = _mask_row(compiler, state)
    fresh = _mask_row(compiler, compiler.new_state(grammar))

    def allowed(r):
        return {t for t in range(tok.vocab_size) if (int(r[t // 32]) >> (t % 32)) & 1}

    assert allowed(row) == allowed(fresh) | {gate.opening[0]}
    for k, t in enumerate(gate.opening):   # then the rest of `<think>`, one way only
        if k:
            assert allowed(_mask_row(compiler, state)) == {t}
        advance_all([state], [t])
    assert state.gated and bool((_mask_row(compiler, state) == -1).all())   # reasoning
    digit = tok.encode("7", add_special_tokens=False)
    other = compiler.new_state(grammar, ReasoningGate("qwen3", tok, tok.encode("hi"), True))
    assert advance_all([other], digit) == [True] and not other.gated   # no thinking
