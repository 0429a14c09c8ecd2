"""Completions' `echo` with `logprobs` and vLLM's `prompt_logprobs`: the prompt tokens'
logprobs, computed in the prefill step, equal a teacher-forced log_softmax of the same model
in transformers (fp32, CPU). The engine prefills in chunks of 16 tokens over pages of 4, so
long prompts cross chunk boundaries (a chunk's last row predicts the next chunk's first)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from families_support import hf_checkpoint, hf_model
from zerod.engine.api.protocol import MAX_PROMPT_LOGPROB_ENTRIES
from zerod.engine.api.server import ServerThread

PROMPTS = [[0, 37, 81, 5, 120, 77, 9, 200, 13, 64, 33, 150, 151, 7, 90, 45, 61, 88, 99, 140,
            12, 18, 230, 5, 6, 71, 72, 44, 19],          # 29 tokens: two chunks of 16
           [0, 250, 31],
           [0, 11]]
K = 3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from zerod.engine.core.engine import Engine, EngineConfig

    d = hf_checkpoint(tmp_path_factory.mktemp("llama"), "LlamaConfig", "LlamaForCausalLM",
                      hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256)
    eng = Engine(EngineConfig(model=str(d), block_size=4, kv_pages=400, max_model_len=128,
                              max_num_batched_tokens=16, max_prefill_tokens_idle=16, seed=0))
    eng.start()
    srv = ServerThread(eng).start()
    yield eng, srv, hf_model(d)
    srv.stop()
    eng.shutdown(0)


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def _teacher_forced(m, prompt: list[int]) -> torch.Tensor:
    """log_softmax [len - 1, V]: row i is the distribution of prompt token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(m(torch.tensor([prompt])).logits[0, :-1].float(), -1)


def _check_prompt_part(lp, prompt: list[int], ref: torch.Tensor, tok_str) -> None:
    n = len(prompt)
    assert lp.tokens[:n] == [tok_str(t) for t in prompt]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = ref.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:n]), want, atol=2e-4, rtol=0)
    for i in range(1, n):
        top_v, top_i = ref[i - 1].topk(K)
        d = lp.top_logprobs[i]
        strs = [tok_str(t) for t in top_i.tolist() + [prompt[i]]]
        for t, v in zip(top_i.tolist(), top_v.tolist()):
            if strs.count(tok_str(t)) == 1:   # keys are token texts: byte pieces may collide
                assert abs(d[tok_str(t)] - v) < 2e-4
    # offsets count the token strings from 0, across prompt and output
    assert lp.text_offset[0] == 0
    for i in range(1, len(lp.tokens)):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])


def test_echo_logprobs_equal_teacher_forced_transformers(served):
    eng, srv, m = served
    tok_str = lambda t: eng.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    r = _client(srv).completions.create(model=eng.model_name, prompt=PROMPTS, max_tokens=3,
                                        temperature=0, echo=True, logprobs=K,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for prompt, ch in zip(PROMPTS, r.choices):
        lp = ch.logprobs
        assert len(lp.tokens) == len(prompt) + 3
        _check_prompt_part(lp, prompt, _teacher_forced(m, prompt), tok_str)
        echo = eng.tokenizer.decode(prompt, skip_special_tokens=False)
        assert ch.text.startswith(echo)
        # the output part: greedy picks the top token of each step
        out = lp.top_logprobs[len(prompt):]
        assert all(max(d.values()) == v for d, v in zip(out, lp.token_logprobs[len(prompt):]))


def test_streamed_echo_logprobs_first_chunk_is_the_prompt(served):
    eng, srv, m = served
    tok_str = lambda t: eng.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    prompt = PROMPTS[0]
    whole = _client(srv).completions.create(model=eng.model_name, prompt=prompt, max_tokens=4,
                                            temperature=0, echo=True, logprobs=K,
                                            extra_body={"ignore_eos": True})
    chunks = list(_client(srv).completions.create(
        model=eng.model_name, prompt=prompt, max_tokens=4, temperature=0, echo=True,
        logprobs=K, stream=True, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0]
    assert first.text == eng.tokenizer.decode(prompt, skip_special_tokens=False)
    assert len(first.logprobs.tokens) == len(prompt)
    _check_prompt_part(first.logprobs, prompt, _teacher_forced(m, prompt), tok_str)
    streamed = [v for ch in chunks for c in ch.choices if c.logprobs
                for v in c.logprobs.token_logprobs]
    assert [None if v is None else round(v, 4) for v in streamed] == \
        [None if v is None else round(v, 4) for v in whole.choices[0].logprobs.token_logprobs]
    offsets = [o for ch in chunks for c in ch.choices if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    assert "".join(c.text for ch in chunks for c in ch.choices) == whole.choices[0].text


def test_tokens_as_token_ids_name_every_token_by_its_id(served):
    """vLLM's return_tokens_as_token_ids: "token_id:N" everywhere a logprob names a token, so
    ids that decode to the same text (or to none) stay apart; streamed and whole agree."""
    eng, srv, m = served
    prompt = PROMPTS[0]
    ref = _teacher_forced(m, prompt)
    body = dict(model=eng.model_name, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=K,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    whole = _client(srv).completions.create(**body)
    lp = whole.choices[0].logprobs
    assert lp.tokens[:len(prompt)] == [f"token_id:{t}" for t in prompt]
    assert all(t.startswith("token_id:") for t in lp.tokens)
    for i in range(1, len(prompt)):   # the keys are the teacher-forced top-K ids, exactly
        assert set(lp.top_logprobs[i]) >= {f"token_id:{t}" for t in ref[i - 1].topk(K).indices.tolist()}
    streamed = [t for ch in _client(srv).completions.create(**body, stream=True)
                for c in ch.choices if c.logprobs for t in c.logprobs.tokens]
    assert streamed == lp.tokens
    chat = _client(srv).chat.completions.create(
        model=eng.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert all(c.token.startswith("token_id:") and all(t.token.startswith("token_id:") for t in c.top_logprobs)
               for c in chat.choices[0].logprobs.content)
    status, err = _post(srv, "/v1/completions", {"prompt": prompt, "return_tokens_as_token_ids": "yes"})
    assert status == 400 and err["error"]["param"] == "return_tokens_as_token_ids"


def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_vllm_prompt_logprobs_field_raw_http_with_ranks(served):
    eng, srv, m = served
    prompt = PROMPTS[0]
    ref = _teacher_forced(m, prompt)
    status, body = _post(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                  "prompt_logprobs": 2})
    assert status == 200, body
    pl = body["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(prompt)
    for i, d in enumerate(pl[1:], 1):
        tok = prompt[i]
        got = d[str(tok)]
        assert abs(got["logprob"] - ref[i - 1, tok].item()) < 2e-4
        assert got["rank"] == int((ref[i - 1] > ref[i - 1, tok]).sum()) + 1
        top_v, top_i = ref[i - 1].topk(2)
        assert [d[str(t)]["rank"] for t in top_i.tolist()] == [1, 2]
        for t, v in zip(top_i.tolist(), top_v.tolist()):
            assert abs(d[str(t)]["logprob"] - v) < 2e-4
    assert "logprobs" not in body["choices"][0] or body["choices"][0]["logprobs"] is None
    # chat: at the top of the answer, as vLLM
    status, body = _post(srv, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0})
    assert status == 200 and body["prompt_logprobs"][0] is None
    assert all(len(d) == 1 for d in body["prompt_logprobs"][1:])


def test_prompt_logprobs_bypass_the_prefix_cache(served):
    """A cached prefix has no hidden states: asking requests take no hit, and their values
    equal those of a first, uncached run."""
    eng, srv, _ = served
    prompt = PROMPTS[0]
    c = _client(srv)
    c.completions.create(model=eng.model_name, prompt=prompt, max_tokens=1)  # cache it
    warm = c.completions.create(model=eng.model_name, prompt=prompt, max_tokens=1)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    a = c.completions.create(model=eng.model_name, prompt=prompt, max_tokens=1, echo=True,
                             logprobs=0)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    assert len(a.choices[0].logprobs.token_logprobs) == len(prompt) + 1


def test_prompt_logprob_bounds_are_400s(served):
    eng, srv, _ = served
    status, body = _post(srv, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 1,
                                                  "prompt_logprobs": 1, "stream": True})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"
    status, body = _post(srv, "/v1/completions", {"prompt": "x", "prompt_logprobs": 21})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs"
    from zerod.engine.api.protocol import CompletionRequest, check_prompt_logprobs, APIError
    req = CompletionRequest(kind="completion", model=None, logprobs=20, prompt_logprobs=20,
                            echo=True)
    check_prompt_logprobs(req, MAX_PROMPT_LOGPROB_ENTRIES // 21)
    with pytest.raises(APIError) as e:
        check_prompt_logprobs(req, MAX_PROMPT_LOGPROB_ENTRIES // 21 + 1)
    assert e.value.param == "logprobs" and "MAX_PROMPT_LOGPROB_ENTRIES" in e.value.message
