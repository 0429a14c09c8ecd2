"""Structured outputs (xgrammar) on the real engine: the demo model has random weights, so
every valid output below is the token mask's doing. Driven by the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from zerod.engine.sampling.grammar_mask import apply_bitmask
from zerod.engine.api.protocol import Limits, RequestSchemas
from zerod.engine.api.server import ServerThread

MSGS = [{"role": "user", "content": "hi"}]
# a schema whose outputs end early (bounded strings, enums, small integers)
PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "ok", "age", "color", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}}}


@pytest.fixture(scope="module")
def live():
    from zerod.engine.core.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model="demo", device="cpu", max_model_len=512, kv_pages=1024,
                              max_num_seqs=64, seed=0))
    eng.start()
    srv = ServerThread(eng).start()
    yield eng, srv
    srv.stop()
    eng.shutdown(0)


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_json_schema_outputs_are_all_valid(live):
    _, srv = live
    c = _client(srv)
    for seed in range(12):
        r = c.chat.completions.create(
            model="demo", messages=MSGS, max_tokens=300, temperature=1.0, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        ch = r.choices[0]
        assert ch.finish_reason == "stop", ch
        jsonschema.validate(json.loads(ch.message.content), PERSON)


def test_json_object_is_an_object(live):
    _, srv = live
    r = _client(srv).chat.completions.create(model="demo", messages=MSGS, max_tokens=200,
                                             response_format={"type": "json_object"}, seed=3)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("field", ["structured_outputs", "guided"])
def test_regex_choice_grammar_on_completions(live, field):
    _, srv = live
    c = _client(srv)

    def run(kind, value, seed):
        extra = {"structured_outputs": {kind: value}} if field == "structured_outputs" \
            else {f"guided_{kind}": value}
        r = c.completions.create(model="demo", prompt="The", max_tokens=300, seed=seed,
                                 extra_body=extra)
        assert r.choices[0].finish_reason == "stop", r
        return r.choices[0].text

    for seed in range(4):
        assert re.fullmatch(r"[a-c]{2}-\d{1,3}", run("regex", r"[a-c]{2}-\d{1,3}", seed))
        assert run("choice", ["yes", "no", "maybe (later)"], seed) in \
            ("yes", "no", "maybe (later)")
        assert re.fullmatch(r"(ab){1,3}!", run("grammar", 'root ::= ("ab"){1,3} "!"', seed))
        out = run("json", PERSON, seed)
        jsonschema.validate(json.loads(out), PERSON)


def test_streamed_json_schema_is_valid(live):
    _, srv = live
    stream = _client(srv).chat.completions.create(
        model="demo", messages=MSGS, max_tokens=300, stream=True, seed=11,
        extra_body={"guided_json": json.dumps(PERSON)})
    text, reasons = "", []
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads(text), PERSON)



def test_every_choice_and_prompt_follows_the_grammar(live):
    """One grammar, six engine requests (2 prompts x n=3, siblings sharing the prompt's
    pages): each walks the grammar on its own; logprobs come with the masked tokens."""
    _, srv = live
    r = _client(srv).completions.create(model="demo", prompt=["The", "A long prompt"], n=3,
                                        max_tokens=300, seed=4, logprobs=2,
                                        extra_body={"guided_regex": r"[a-c]{2}-\d{1,3}"})
    assert [ch.index for ch in r.choices] == list(range(6))
    for ch in r.choices:
        assert ch.finish_reason == "stop" and re.fullmatch(r"[a-c]{2}-\d{1,3}", ch.text), ch
        assert "".join(ch.logprobs.tokens).startswith(ch.text)   # then the stop token's
    assert len({ch.text for ch in r.choices}) > 1   # independent samples, not one copied


def test_streamed_json_schema_with_n(live):
    _, srv = live
    texts, reasons = {}, {}
    for chunk in _client(srv).chat.completions.create(
            model="demo", messages=MSGS, max_tokens=300, stream=True, seed=12, n=2,
            logprobs=True, response_format={"type": "json_schema", "json_schema": {
                "name": "person", "schema": PERSON}}):
        ch = chunk.choices[0]
        texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
        if ch.finish_reason:
            reasons[ch.index] = ch.finish_reason
    assert reasons == {0: "stop", 1: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)

async def test_masked_and_free_streams_together(live):
    """Masked and free rows share every step; every masked output is still valid."""
    _, srv = live
    c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)

    async def masked(i):
        r = await c.chat.completions.create(
            model="demo", messages=MSGS, max_tokens=300, seed=100 + i,
            extra_body={"structured_outputs": {"json": PERSON}})
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)

    async def free(i):
        r = await c.completions.create(model="demo", prompt="Hello", max_tokens=30,
                                       seed=i, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 30

    await asyncio.gather(*(masked(i) for i in range(16)), *(free(i) for i in range(16)))
    await c.close()


def test_grammar_errors_are_400s_naming_the_field(live):
    _, srv = live
    c = _client(srv)
    cases = [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a+", "guided_choice": ["x"]}, "guided_choice"),
        ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens"),
        ({"structured_outputs": {"json": PERSON, "whitespace": "x"}},
         "structured_outputs.whitespace"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            c.completions.create(model="demo", prompt="a", max_tokens=5, extra_body=extra)
        assert ei.value.body["param"] == param, (extra, ei.value.body)
    with pytest.raises(openai.BadRequestError) as ei:
        c.chat.completions.create(model="demo", messages=MSGS, max_tokens=5,
                                  response_format={"type": "json_schema",
                                                   "json_schema": {"name": "x"}})
    assert ei.value.body["param"] == "response_format.json_schema"
    # still serving
    r = c.completions.create(model="demo", prompt="a", max_tokens=3)
    assert r.choices[0].finish_reason == "length"


def test_every_spelling_parses_to_one_grammar():
    s = RequestSchemas(Limits(256, 1000))
    for body, kind in (
            ({"response_format": {"type": "json_object"}}, "json"),
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
             "json"),
            ({"structured_outputs": {"json_object": True}}, "json"),
            ({"structured_outputs": {"choice": ["a"]}}, "choice"),
            ({"guided_regex": "x"}, "regex"), ({"guided_grammar": "root ::= \"a\""}, "grammar")):
        req = s.parse_chat({"messages": MSGS, **body})
        assert req.grammar.kind == kind, body
    assert s.parse_chat({"messages": MSGS, "response_format": {"type": "text"}}).grammar is None
    spec = s.parse_chat({"messages": MSGS, "guided_json": PERSON}).grammar
    assert json.loads(spec.value) == PERSON and spec.param == "guided_json"


def test_apply_bitmask_keeps_only_allowed_tokens():
    logits = torch.zeros(3, 70)
    masks = torch.zeros(2, 3, dtype=torch.int32)
    masks[0, 0] = 1 << 5             # row 0: token 5 only
    masks[1, 2] = 1 << 1             # row 2: token 65 only
    out = apply_bitmask(logits, torch.tensor([0, 2]), masks)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [5]
    assert torch.isfinite(out[1]).all()          # row 1 has no grammar
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [65]


def test_apply_bitmask_refuses_ids_past_the_mask():
    """A mask narrower than the logits (the tokenizer's ids only) refuses the model's
    padding ids past it."""
    logits = torch.zeros(2, 100)
    masks = torch.full((1, 2), -1, dtype=torch.int32)   # ids 0..63 allowed
    out = apply_bitmask(logits, torch.tensor([1]), masks)
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == list(range(64))
    assert torch.isfinite(out[0]).all()


@pytest.mark.gpu
def test_apply_bitmask_on_the_device_matches_the_cpu():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 1000, generator=g)
    masks = torch.randint(-2**31, 2**31 - 1, (5, 30), dtype=torch.int32, generator=g)
    rows = torch.tensor([0, 2, 3, 6, 7])
    want = apply_bitmask(logits, rows, masks)
    got = apply_bitmask(logits.cuda(), rows.cuda(), masks.cuda()).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got, want)


def _masks_of(comp, compiled, steps: int, seed: int = 0) -> list[set[int]]:
    """The allowed ids of one matcher over `steps` tokens picked at random from its mask."""
    import random

    from zerod.engine.sampling.structured import fill_masks

    rnd, st, seen = random.Random(seed), comp.new_state(compiled), []
    bm = torch.zeros(1, st.words, dtype=torch.int32)
    for _ in range(steps):
        if st.terminated:
            break
        fill_masks([st], bm, [0])
        ok = {v for v in range(32 * st.words) if (int(bm[0, v // 32]) >> (v % 32)) & 1}
        seen.append(ok)
        assert st.matcher.accept_token(rnd.choice(sorted(ok)))
    return seen


def test_json_masks_cover_the_tokenizer_only_and_no_control_character(live):
    """The masks span the tokenizer's ids (not the model's padding, which xgrammar would
    walk one by one for every row), and a JSON grammar never allows a token holding a raw
    control character (JSON forbids them; xgrammar's maxLength string rule admits them)."""
    from zerod.engine.sampling.structured import GrammarCompiler, GrammarSpec

    eng, _ = live
    tok = eng.tokenizer
    comp = GrammarCompiler(tok, 128256)    # the 8B shape's vocabulary over the demo tokenizer
    assert comp.mask_words == -(-tok.vocab_size // 32)
    ctrl = {i for i in range(tok.vocab_size)
            if any(ord(c) < 0x20 for c in tok.decode([i], skip_special_tokens=False))}
    assert ctrl, "the demo tokenizer has newline tokens"
    compiled = comp.compile(GrammarSpec("json", json.dumps(PERSON)))
    seen = _masks_of(comp, compiled, 60)
    assert len(seen) > 5 and all(m and max(m) < tok.vocab_size and not m & ctrl for m in seen)
    # a regex may match a newline: its vocabulary keeps those tokens
    nl = comp.compile(GrammarSpec("regex", "(\\n|a)+"))
    assert _masks_of(comp, nl, 1)[0] & ctrl


def test_masked_rows_decode_in_every_step():
    """A masked row is in every step beside the free rows (its mask is computed while the
    step's forward runs, not after a trip through the poller)."""
    from zerod.engine.config import EngineConfig
    from zerod.engine.spec.hf_config import parse_model_config
    from zerod.engine.core.kv_pool import KVPool
    from zerod.engine.core.request import Request, SamplingParams
    from zerod.engine.core.scheduler import Scheduler

    mc = parse_model_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 8,
                             "num_attention_heads": 1, "num_hidden_layers": 1,
                             "intermediate_size": 8, "vocab_size": 32})
    s = Scheduler(EngineConfig(block_size=4),
                  KVPool(mc, 16, 4, torch.float32, torch.device("cpu")))
    masked, free = (Request(f"r{i}", [5, 6], SamplingParams(max_tokens=8), lambda o: None, 8, i)
                    for i in range(2))
    masked.grammar = object()
    for r in (masked, free):
        assert s.claim_wait_place()
        s.add(r)
    b = s.schedule()
    assert [c.req for c in b.chunks] == [masked, free] and b.masked
    for _ in range(3):
        s.update(b)
        b = s.schedule()
        assert b.decodes == [masked, free] and all(h.masked for h in b.halves())
    s.remove(masked)
    s.remove(free)
    assert s.features.counts["grammar"] == 0 and not s.schedule().masked


def test_mask_staging_advances_each_matcher_once_per_token(live):
    """The step thread's catching up (grammar_mask.MaskStaging): fill() takes the last
    masked step's ids (once), skips requests that ended, and reports a refused token."""
    from zerod.engine.sampling.grammar_mask import MaskStaging
    from zerod.engine.core.request import Request, SamplingParams
    from zerod.engine.sampling.structured import GrammarSpec

    eng, _ = live
    comp = eng.grammar_compiler
    g = comp.compile(GrammarSpec("choice", json.dumps(["ab", "ba"])))
    tok = eng.tokenizer
    reqs = [Request(f"m{i}", [5], SamplingParams(), lambda o: None, 8, i) for i in range(3)]
    for r in reqs:
        r.grammar = comp.new_state(g)
    ms = MaskStaging(2, 8, torch.device("cpu"))
    rows, masked = ms.plan([reqs], lambda idx: torch.tensor(idx))
    assert masked == reqs and rows[0].rows.tolist() == [0, 1, 2]
    ms.fill(0, masked)

    def allowed(j):
        m = ms.dev[j]
        return {v for v in range(32 * m.numel()) if (int(m[v // 32]) >> (v % 32)) & 1}
    a, b = tok.encode("a", add_special_tokens=False)[0], tok.encode("b", add_special_tokens=False)[0]
    assert {a, b} <= allowed(0)
    ids = torch.tensor([a, b, a])
    reqs[2].released = True                       # ended meanwhile: skipped
    ms.launched(ids, list(enumerate(reqs)))
    rows, masked = ms.plan([reqs[:2]], lambda idx: torch.tensor(idx))
    ms.fill(1, masked)                            # catches up: r0 took "a", r1 took "b"
    assert b in allowed(0) and a not in allowed(0)
    assert a in allowed(1) and b not in allowed(1)
    ms.fill(1, masked)                            # nothing pending: no second advance
    assert b in allowed(0) and a not in allowed(0)
    ms.launched(torch.tensor([a, a]), [(0, reqs[0]), (1, reqs[1])])   # r0 refuses "a"
    ms.fill(0, [])
    assert ms.broken == [reqs[0]]


def test_masked_output_batched_equals_alone(live):
    """A seeded masked request gives the same output alone and beside 24 other streams
    (masked and free): its mask never depends on the step it lands in."""
    _, srv = live
    kw = dict(model="demo", messages=MSGS, max_tokens=300, seed=77, temperature=1.0,
              extra_body={"structured_outputs": {"json": PERSON}})
    alone = _client(srv).chat.completions.create(**kw).choices[0].message.content

    async def batched():
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        others = [c.chat.completions.create(model="demo", messages=MSGS, max_tokens=300,
                                            seed=i, extra_body={"guided_json": PERSON})
                  for i in range(12)]
        others += [c.completions.create(model="demo", prompt="Hi", max_tokens=40, seed=i,
                                        extra_body={"ignore_eos": True}) for i in range(12)]
        res = await asyncio.gather(c.chat.completions.create(**kw), *others)
        await c.close()
        for r in res[1:13]:
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        return res[0].choices[0].message.content

    assert asyncio.run(batched()) == alone
    jsonschema.validate(json.loads(alone), PERSON)
