"""Steps in flight (`Tuning.steps_in_flight`): the ring slots bound the steps launched and
not yet read back; a step takes its slot before its batch. Requests arriving while steps
run are served, with one slot as with several, and a bad value is refused at start."""

from __future__ import annotations

import json
import threading

import pytest

from zerod.engine.config import EngineConfig, EngineError
from zerod.engine.core.engine import Engine
from zerod.engine.core.request import SamplingParams
from zerod.engine.demo import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_checkpoint(d, "llama", seed=5)
    return d


def _engine(ckpt, monkeypatch, tuning: dict | None = None, **cfg) -> Engine:
    monkeypatch.setenv("ZEROD_TUNING", json.dumps(tuning or {}))
    return Engine(EngineConfig(model=str(ckpt), kv_pages=128, max_num_seqs=8, seed=0, **cfg))


def _serve(e: Engine) -> dict[int, list[int]]:
    """One long request decoding, then three more submitted while it runs: every token."""
    outs: dict[int, list[int]] = {}
    done = threading.Semaphore(0)
    started = threading.Event()

    def collect(i):
        def cb(o):
            outs.setdefault(i, []).extend(o.token_ids)
            if i == 0 and len(outs[0]) >= 3:
                started.set()
            if o.finished:
                done.release()
        return cb

    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    e.start()
    try:
        e.submit([11, 12, 13, 14], greedy, collect(0))
        assert started.wait(60)
        for i in (1, 2, 3):
            e.submit([20 + i] * (3 + 5 * i), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                     collect(i))
        for _ in range(4):
            assert done.acquire(timeout=60)
    finally:
        e.shutdown(0)
    return outs


def test_one_slot_or_several_serve_the_same_tokens(ckpt, monkeypatch):
    default = _engine(ckpt, monkeypatch)
    assert default.runner.ring.depth == 2          # Tuning.steps_in_flight
    two = _serve(default)
    one_engine = _engine(ckpt, monkeypatch, {"steps_in_flight": 1})
    assert one_engine.runner.ring.depth == 1
    one = _serve(one_engine)
    assert one == two
    assert [len(one[i]) for i in range(4)] == [40, 6, 6, 6]


def test_the_ring_is_at_most_the_configured_depth(ckpt, monkeypatch):
    e = _engine(ckpt, monkeypatch, {"steps_in_flight": 8}, ring_depth=3)
    try:
        assert e.runner.ring.depth == 3
    finally:
        e.shutdown(0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_a_bad_count_is_refused_at_start(ckpt, monkeypatch, bad):
    with pytest.raises(EngineError, match="steps_in_flight must be an integer >= 1"):
        _engine(ckpt, monkeypatch, {"steps_in_flight": bad})
