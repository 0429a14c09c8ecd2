"""What goes wrong for one request fails that request alone: a step that raises is redone
without it and the others get exactly the tokens they get alone; values the device
tables cannot hold are refused at submit; a CUDA error still fails every row and health."""

from __future__ import annotations

import random
import threading

import pytest

from zerod.engine.demo import generate, make_checkpoint
from zerod.engine.core.engine import Engine, EngineConfig, RequestRejected, SamplingParams


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_checkpoint(d, "llama", seed=5)
    e = Engine(EngineConfig(model=str(d), block_size=4, kv_pages=300, max_model_len=96,
                            max_num_batched_tokens=24, max_num_seqs=16))
    e.start()
    yield e
    e.shutdown(0)


def _prompt(n, seed):
    r = random.Random(seed)
    return [r.randrange(5, 380) for _ in range(n)]


PROMPTS = [_prompt(n, i) for i, n in enumerate((7, 19, 3, 30, 11, 5))]
PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.9, top_k=20, seed=7, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.7, seed=8, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=1.0, top_p=0.8, seed=9, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.0, min_tokens=4, ignore_eos=True)]
VICTIM = _prompt(9, 99)


def _alone(eng) -> list[list[int]]:
    return [generate(eng, [p], sp)[0]["token_ids"] for p, sp in zip(PROMPTS, PARAMS)]


def _together_with_victim(eng) -> tuple[list[dict], dict]:
    res = generate(eng, PROMPTS[:3] + [VICTIM] + PROMPTS[3:],
                   PARAMS[:3] + [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] + PARAMS[3:])
    return res[:3] + res[4:], res[3]


def _is_victim(r) -> bool:
    return r.prompt_ids == VICTIM


@pytest.mark.parametrize("where", ["prefill staging", "decode after its forward"])
def test_a_failing_row_fails_alone_and_the_others_get_their_own_tokens(eng, monkeypatch, where):
    alone = _alone(eng)
    runner = eng.runner
    if where == "prefill staging":
        # raises before anything of the step is launched
        orig = runner._stage_prefill

        def hooked(pk, chunks, pad, uses, *rest):
            if any(_is_victim(c.req) for c in chunks):
                raise OverflowError("injected: this request's inputs do not fit")
            return orig(pk, chunks, pad, uses, *rest)
        monkeypatch.setattr(runner, "_stage_prefill", hooked)
    else:
        # raises after the decode forward wrote K/V for every row and sampled: the redo must
        # not see the failed step's tokens as inputs
        orig = runner._sample

        def hooked(logits, slots, gen, reqs, *rest):
            tok = orig(logits, slots, gen, reqs, *rest)
            if any(_is_victim(r) and r.num_scheduled >= 3 for r in reqs):
                raise ValueError("injected: sampling failed for this request")
            return tok
        monkeypatch.setattr(runner, "_sample", hooked)
    others, victim = _together_with_victim(eng)
    assert victim["finish_reason"] == "error"
    assert "injected" in victim["outputs"][-1].error
    if where != "prefill staging":
        assert len(victim["token_ids"]) == 3       # it streamed until its row failed
    assert [o["finish_reason"] for o in others] == ["length"] * 6
    assert [o["token_ids"] for o in others] == alone
    monkeypatch.undo()
    st = eng.stats()
    assert st.healthy and st.running == 0 and st.kv_pages_free == st.kv_pages_total


def test_cuda_error_fails_every_row_of_the_step_and_health(tmp_path, monkeypatch):
    make_checkpoint(tmp_path, "llama", seed=6)
    e = Engine(EngineConfig(model=str(tmp_path), kv_pages=100, max_model_len=64))
    monkeypatch.setattr(e.runner, "launch", lambda ring_idx, x: (_ for _ in ()).throw(
        RuntimeError("CUDA error: an illegal memory access was encountered")))
    e.start()
    try:
        res = generate(e, [_prompt(5, 1), _prompt(6, 2)], SamplingParams(max_tokens=4, temperature=0))
        assert [r["finish_reason"] for r in res] == ["error", "error"]
        st = e.stats()
        assert not st.healthy and "CUDA error" in st.error
        with pytest.raises(RequestRejected) as ei:
            e.submit(_prompt(5, 3), SamplingParams(), lambda o: None)
        assert ei.value.status == 503
    finally:
        e.shutdown(0)


@pytest.mark.parametrize("field,value", [("top_k", 2**63), ("min_tokens", 2**63), ("top_k", -2),
                                         ("stop_token_ids", [2**63]), ("stop_token_ids", [-1]),
                                         ("temperature", float("inf")), ("temperature", float("nan")),
                                         ("top_p", 0.0), ("max_tokens", 0), ("seed", "7"),
                                         ("top_k", 2.5), ("min_tokens", True)])
def test_out_of_range_params_are_refused_naming_the_field(eng, field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
    sp = SamplingParams(max_tokens=4)
    setattr(sp, field, value)               # set after it was built: submit checks again
    with pytest.raises(RequestRejected) as ei:
        eng.submit(_prompt(4, 1), sp, lambda o: None)
    assert ei.value.status == 400 and field in ei.value.message


def test_overflowing_values_never_reach_a_step_and_concurrent_requests_are_unharmed(eng):
    alone = _alone(eng)
    results: dict = {}
    t = threading.Thread(target=lambda: results.update(good=generate(eng, PROMPTS, PARAMS)))
    t.start()
    refused = []
    for field in ("top_k", "min_tokens"):
        sp = SamplingParams(max_tokens=8)
        setattr(sp, field, 2**63)
        for _ in range(3):
            try:
                eng.submit(_prompt(6, 4), sp, lambda o: None)
            except RequestRejected as exc:
                refused.append((exc.status, field in exc.message))
    t.join(60)
    assert refused == [(400, True)] * 6
    assert [r["finish_reason"] for r in results["good"]] == ["length"] * 6
    assert [r["token_ids"] for r in results["good"]] == alone


def test_top_k_of_the_whole_vocabulary_is_off_and_stop_ids_must_be_in_it(eng):
    p = _prompt(8, 3)
    off = generate(eng, [p], SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True))[0]
    big = generate(eng, [p], SamplingParams(max_tokens=10, temperature=1.0, seed=3, top_k=2**62,
                                            ignore_eos=True))[0]
    assert big["token_ids"] == off["token_ids"]
    with pytest.raises(RequestRejected) as ei:
        eng.submit(p, SamplingParams(stop_token_ids=[eng.vocab_size]), lambda o: None)
    assert ei.value.status == 400 and "stop_token_ids" in ei.value.message


def test_min_tokens_above_max_tokens_and_tiny_temperatures():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(temperature=1e-9).greedy       # as vLLM: below 1e-5 is greedy
    assert SamplingParams(seed=2**70 + 5).seed == 5      # any seed folds into the int64 table
