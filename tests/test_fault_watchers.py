"""EngineStalled's and the canary's rules on fakes (the end-to-end runs with the demo
engine are tests/test_daemon_faults.py): when a stall is one, when it is over, when a
changed answer is a fault and when it is a near-tie that batching tipped once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from zerod.alerts import AlertBook
from zerod.daemon_config import DaemonConfig, DaemonConfigError
from zerod.engine import metrics as names
from zerod.fleet import EngineSpec
from zerod.watchers.canary import Answer, CanaryWatcher, near_tie
from zerod.watchers.engine_metrics import Histogram, Sample
from zerod.watchers.engine_stall import EngineStallWatcher, step_thread_stack


class FakeSupervisor:
    def __init__(self) -> None:
        self.pid = 100
        self.url = "http://127.0.0.1:1"
        self.health_path = "/health"
        self.kind = "vllm"
        self.spec = EngineSpec("default", (), {})
        self.fig = SimpleNamespace(state="healthy")
        self.restarts: list[str] = []

    async def restart(self, why: str) -> None:
        self.restarts.append(why)


def _stall(**cfg):
    book = AlertBook()
    metrics = SimpleNamespace(spec=EngineSpec("default", (), {}), last=None)
    sup = FakeSupervisor()
    w = EngineStallWatcher(book, DaemonConfig.from_dict({"stall_after_s": 10, **cfg}), metrics, sup,
                           gpus=lambda: [{"index": 0, "utilization_ratio": 1.0, "sm_clock_mhz": 1980,
                                          "power_watts": 120.0, "memory_used_bytes": 2**34}])

    async def evidence(pid):
        return {"gpus": w.gpus(), "health": {"steps": 7}, "stacks_error": "no stack dump: test"}
    w.evidence = evidence

    def scrape(t: float, running: float, tokens: float | None):
        values = {names.REQUESTS_RUNNING: running}
        if tokens is not None:
            values[names.GENERATION_TOKENS_TOTAL] = tokens
        metrics.last = Sample(t, values, Histogram(), Histogram())
        asyncio.run(w.apoll())
    return book, sup, w, scrape


def test_a_stall_is_requests_running_and_tokens_flat_for_stall_after_s():
    book, sup, w, scrape = _stall()
    for t in range(0, 10):
        scrape(float(t), 4, 100.0 + t)   # tokens move
    for t in range(10, 19):
        scrape(float(t), 4, 109.0)       # flat for 9 s: not yet
    assert book.get("EngineStalled") is None and not sup.restarts
    scrape(19.0, 4, 109.0)
    a = book.get("EngineStalled")
    assert a is not None and a.severity == "critical" and "4 request(s) running, no token for 10 s" in a.summary
    assert "GPU 0: 100% busy, SM 1980 MHz, 120 W, 16.0 GiB used" in a.description
    assert "last step: #7" in a.description and "no stack dump: test" in a.description
    assert sup.restarts and "EngineStalled" in sup.restarts[0]
    scrape(25.0, 4, 109.0)
    assert len(sup.restarts) == 1  # once per stall
    scrape(26.0, 4, 120.0)            # tokens again
    assert book.get("EngineStalled") is None


def test_idle_engines_and_engines_without_the_counter_are_never_stalled():
    book, sup, w, scrape = _stall(stall_restart=False)
    for t in range(0, 30):
        scrape(float(t), 0, 50.0)  # nothing running: flat tokens are idle, not stuck
    for t in range(30, 60):
        scrape(float(t), 4, None)  # no generated-token series: no verdict
    assert book.get("EngineStalled") is None
    for t in range(60, 75):
        scrape(float(t), 4, 50.0)
    assert book.get("EngineStalled") is not None and not sup.restarts  # stall_restart = false
    assert "left running" in book.get("EngineStalled").description
    sup.pid = 101   # a new process: its counters start again
    scrape(76.0, 0, 0.0)
    assert book.get("EngineStalled") is None


def test_the_step_thread_is_picked_out_of_a_faulthandler_dump():
    dump = ('Thread 0x01 (most recent call first):\n  File "x.py", line 1 in serve_forever\n\n'
            'Thread 0x02 (most recent call first):\n  File "faults.py", line 69 in after_step\n'
            '  File "engine.py", line 441 in _loop_body\n')
    assert step_thread_stack(dump).startswith("Thread 0x02") and "serve_forever" not in step_thread_stack(dump)
    assert step_thread_stack("Thread 0x01:\n  File x in y\n") is None


def _canary(answers: list[list[str]]):
    book = AlertBook()
    sup = FakeSupervisor()
    sup.spec = EngineSpec("a", (2,), {}, tagged=True)
    clock = [0.0]
    w = CanaryWatcher(book, DaemonConfig.from_dict({"canary_interval_s": 60}), sup,
                      gpus=lambda: [2], prompts=("p1", "p2"), clock=lambda: clock[0])
    asked = []

    async def ask():
        asked.append(clock[0])
        return [a if isinstance(a, Answer) else Answer(a) for a in answers.pop(0)]
    w.ask = ask

    def tick(t: float) -> None:
        clock[0] = t

        async def go():
            await w.apoll()
            if w._task is not None:
                await w._task
        asyncio.run(go())
    return book, sup, w, tick, asked


def test_the_canary_records_at_start_and_fires_on_an_answer_changed_twice():
    ref, bad = ["x1", "y1"], ["x1", "WRONG"]
    book, sup, w, tick, asked = _canary([ref, ref, bad, bad])
    tick(0.0)
    assert [a.text for a in w.reference] == ref and w.reference_pid == 100
    tick(30.0)
    assert asked == [0.0]  # not due yet
    tick(60.0)
    assert w.rounds == 1 and book.get("CanaryMismatch", "a") is None
    tick(120.0)
    a = book.get("CanaryMismatch", "a")
    assert a is not None and a.severity == "critical" and "1 of 2 fixed greedy prompts" in a.summary
    assert "GPU 2" in a.summary and a.labels == {"engine": "a", "gpu": "2", "pid": "100"}
    assert 'prompt "p2": at start "y1", now "WRONG"' in a.description and "beyond a near-tie" in a.description
    assert "zerod diag --level full --gpus 2" in a.fix


def test_answers_that_decode_alike_are_compared_by_their_token_ids():
    """Past a tokenizer's vocabulary every id decodes to "": the texts agree, the ids do not."""
    ref = [Answer("", ["token_id:5", "token_id:9"]), Answer("y1", ["token_id:1"])]
    bad = [Answer("", ["token_id:6", "token_id:10"]), Answer("y1", ["token_id:1"])]
    book, sup, w, tick, asked = _canary([ref, bad, bad])
    tick(0.0)
    tick(60.0)
    a = book.get("CanaryMismatch", "a")
    assert a is not None and "1 of 2 fixed greedy prompts" in a.summary
    assert 'at start ["token_id:5", "token_id:9"], now ["token_id:6", "token_id:10"]' in a.description


def test_a_near_tie_tipped_once_is_not_a_mismatch_and_a_new_process_records_anew():
    ref = ["x1", "y1"]
    book, sup, w, tick, asked = _canary([ref, ["x1", "y2"], ref, ["q", "r"]])
    tick(0.0)
    tick(60.0)  # differs, then agrees when asked at once
    assert book.get("CanaryMismatch", "a") is None and len(asked) == 3
    sup.pid = 200  # restarted: a new record, not a comparison with the old process's
    tick(61.0)
    assert [a.text for a in w.reference] == ["q", "r"] and w.reference_pid == 200
    assert book.get("CanaryMismatch", "a") is None


@pytest.mark.parametrize("key,value,problem", [
    ("latency_sustain_intervals", 1, "must be 0 (off) or >= 2"),
    ("stall_after_s", -1, ">= 0"),
    ("canary_interval_s", -5, ">= 0"),
    ("state_dir", "", "must be a path"),
])
def test_the_new_settings_refuse_typos(key, value, problem):
    with pytest.raises(DaemonConfigError) as e:
        DaemonConfig.from_dict({key: value})
    assert key in str(e.value) and problem in str(e.value)


def test_a_near_tie_in_the_engine_s_own_logprobs_is_not_a_fault():
    ref = Answer("ab", ["a", "b"], [{"a": -0.1}, {"b": -0.50, "c": -0.60}])
    tipped = Answer("ac", ["a", "c"], [{"a": -0.1}, {"c": -0.55, "b": -0.58}])   # 0.03 nats apart
    wrong = Answer("xy", ["x", "y"], [{"x": -0.01, "a": -6.0}, {"y": -0.2}])     # "a" 6 nats below
    assert near_tie(ref, tipped) and not near_tie(ref, wrong)
    assert not near_tie(ref, Answer("ab?"))  # no logprobs: no excuse
    book, sup, w, tick, asked = _canary([[ref, Answer("z")], [tipped, Answer("z")], [tipped, Answer("z")]])
    tick(0.0)
    tick(60.0)
    assert len(asked) == 2 and book.get("CanaryMismatch", "a") is None  # a tie: not even asked again
