"""ZEROD_STEP_TRACE: one JSON line a step, its shape and its times, written by the poller;
what the lines add up to is what the requests asked for; a path that cannot be written
stops the start with one clear error."""

from __future__ import annotations

import json

import pytest

from zerod.engine.config import EngineConfig, EngineError
from zerod.engine.core.engine import Engine
from zerod.engine.core.request import SamplingParams
from zerod.engine.demo import generate, make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace")
    make_checkpoint(d, "llama", seed=4)
    return d


def test_every_step_is_a_line_and_the_lines_add_up(ckpt, tmp_path, monkeypatch):
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("ZEROD_STEP_TRACE", str(path))
    e = Engine(EngineConfig(model=str(ckpt), kv_pages=256, max_num_batched_tokens=32, min_prefill_chunk=32,
                            max_prefill_tokens_idle=32, enable_prefix_caching=False))
    e.start()
    prompts = [[(5 * k + i) % 200 + 3 for k in range(n)] for i, n in enumerate((3, 40, 17, 70))]
    try:
        out = generate(e, prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    finally:
        e.shutdown(0)
    header, *steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert header["trace"] == "zerod-steps" and header["page_size"] == 16
    assert (header["max_num_batched_tokens"], header["max_model_len"]) == (32, e.max_model_len)
    assert header["tuning"]["one_forward_mixed_steps"] is True
    assert steps and all(s["device_ms"] > 0 and s["launch_ms"] > 0 for s in steps)
    assert [s["at"] for s in steps] == sorted(s["at"] for s in steps)
    # every prompt token prefilled once, in chunks of at most 32; every later token one decode
    assert sum(s["prompt_tokens"] for s in steps) == sum(map(len, prompts))
    assert max(s["prompt_tokens"] for s in steps) <= 32
    assert sum(s["decodes"] for s in steps) == sum(len(r["token_ids"]) - 1 for r in out)
    # the 70-token prompt's chunks: 32 + 32 + 6 tokens, after 0, 32 and 64 of its own
    assert sum(s["pairs"] for s in steps) >= 32 * 33 // 2 + (32 * 32 + 32 * 33 // 2) + (6 * 64 + 6 * 7 // 2)
    # the rows each forward ran (no graphs on the CPU, so no padding): a step with chunks
    # and decodes is one forward of both, a decode step the decode forward alone
    for s in steps:
        if s["chunks"]:
            assert s["rows"] == [s["prompt_tokens"] + s["decodes"], 0], s
        else:
            assert s["rows"] == [0, s["decodes"]], s
    assert any(s["chunks"] and s["decodes"] for s in steps)


def test_a_trace_path_that_cannot_be_written_stops_the_start(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROD_STEP_TRACE", str(tmp_path / "no" / "such" / "dir" / "steps.jsonl"))
    with pytest.raises(EngineError, match="ZEROD_STEP_TRACE=.*cannot open it for writing"):
        Engine(EngineConfig(model=str(ckpt), kv_pages=64))


def test_a_trace_that_cannot_be_written_any_more_stops_alone(ckpt, tmp_path, monkeypatch, caplog):
    """A write that fails mid-run (a full disk) ends the trace with one warning; every
    request still gets all its tokens."""
    monkeypatch.setenv("ZEROD_STEP_TRACE", str(tmp_path / "steps.jsonl"))
    e = Engine(EngineConfig(model=str(ckpt), kv_pages=128))

    class Full:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    e._trace._f = Full()
    e.start()
    try:
        out = generate(e, [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    finally:
        e.shutdown(0)
    assert [len(r["token_ids"]) for r in out] == [5, 5]
    assert [r["finish_reason"] for r in out] == ["length", "length"]
    assert any("step trace: writing failed" in r.message for r in caplog.records)
