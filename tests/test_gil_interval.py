"""The engine process's GIL switch interval (Tuning.gil_switch_interval_us): the step
thread's torch calls each give up the GIL, and the interval bounds how long one waits to
take it back from a busy HTTP loop or poller (docs/perf.md "The GIL and the step thread")."""

from __future__ import annotations

import json
import sys
import threading

import pytest
from zerod.engine.config import EngineConfig, EngineError
from zerod.engine.core.engine import Engine
from zerod.engine.core.request import SamplingParams
from zerod.engine.demo import make_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    make_checkpoint(d, "llama", seed=3)
    return d


@pytest.fixture
def process_interval():
    """The embedding process's own interval (not Python's default), given back after."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.002)
    yield 0.002
    sys.setswitchinterval(old)


def _engine(ckpt, monkeypatch, tuning: dict) -> Engine:
    monkeypatch.setenv("ZEROD_TUNING", json.dumps(tuning))
    return Engine(EngineConfig(model=str(ckpt), kv_pages=64, max_num_seqs=4, seed=0))


@pytest.mark.parametrize("tuning, seconds", [({}, 5e-3), ({"gil_switch_interval_us": 500}, 500e-6)])
def test_the_interval_holds_while_the_engine_runs_and_is_given_back(ckpt, monkeypatch, process_interval,
                                                                    tuning, seconds):
    before = sys.getswitchinterval()
    e = _engine(ckpt, monkeypatch, tuning)
    assert sys.getswitchinterval() == pytest.approx(seconds)   # the build ran under it too
    done = threading.Event()
    tokens: list[int] = []

    def on_out(o):
        tokens.extend(o.token_ids)
        if o.finished:
            done.set()

    e.start()
    try:
        assert sys.getswitchinterval() == pytest.approx(seconds)
        e.submit([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), on_out)
        assert done.wait(60) and len(tokens) == 4
    finally:
        e.shutdown(0)
    assert sys.getswitchinterval() == before == process_interval


@pytest.mark.parametrize("bad", [10, 0, 500.0, "500", True])
def test_a_bad_interval_is_refused_at_start(ckpt, monkeypatch, process_interval, bad):
    with pytest.raises(EngineError, match="gil_switch_interval_us must be an integer >= 50"):
        _engine(ckpt, monkeypatch, {"gil_switch_interval_us": bad})
    assert sys.getswitchinterval() == process_interval


def test_an_engine_refused_in_its_build_gives_the_interval_back(ckpt, monkeypatch, process_interval):
    monkeypatch.setenv("ZEROD_TUNING", json.dumps({"gil_switch_interval_us": 500}))
    with pytest.raises(EngineError, match="KV pages"):   # refused by the build, on the step thread
        Engine(EngineConfig(model=str(ckpt), kv_pages=2, max_model_len=4096, max_num_seqs=4, seed=0))
    assert sys.getswitchinterval() == process_interval
