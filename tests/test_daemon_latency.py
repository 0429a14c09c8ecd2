"""LatencyRegression against the learned normal, on simulated engine traffic.

The traffic goes through the engine's own Prometheus histograms
(zerod.engine.metrics: the real bucket bounds), rendered as the engine serves
them, scraped by the real EngineMetricsWatcher and judged by the real
LatencyWatcher, one simulated second at a time. The latency model follows
what the H200 showed (docs/perf.md): ITL ~5.3 ms p50 at light load, growing
with the batch; a rogue CUDA job beside the engine doubled ITL p50 (5.3 ->
12.6 ms) and TTFT p50 (58 -> 137 ms)."""

from __future__ import annotations

import gzip
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import generate_latest

from zerod.alerts import AlertBook
from zerod.daemon_config import DaemonConfig
from zerod.engine.metrics import EngineMetrics
from zerod.watchers.engine_metrics import EngineMetricsWatcher
from zerod.watchers.latency import LatencyWatcher
from zerod.watchers.latency_baseline import LatencyBaseline, load_bucket

ROGUE = {"pid": 9131, "name": "python3", "cmdline": "python3 rogue_matmul.py --hold 16GiB", "unit": None,
         "container": None, "gpu": 0, "holds_context": True, "fix": "kill 9131"}


class SimEngine:
    """An engine's latency at `streams` concurrent streams; `slowdown` multiplies it."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = np.random.default_rng(seed)
        self.streams = 8
        self.slowdown = 1.0
        self.metrics = EngineMetrics(self.gauges)
        self.generated = 0

    def gauges(self) -> dict:
        return {"requests_running": self.streams, "requests_waiting": 0, "kv_pages_free": 1000,
                "kv_pages_total": 8192, "allocator_retries": 0, "allocator_ooms": 0, "stream_errors": 0,
                "prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_pages": 0}

    def second(self) -> None:
        """One second of traffic (ITL observations scaled down: 4 per stream)."""
        n = self.streams
        itl_median = (0.0045 + 0.00005 * n) * self.slowdown
        itl = itl_median * self.rng.lognormal(0.0, 0.12, size=4 * n)
        # a prefill chunk now and then lengthens one step for every stream
        itl[self.rng.random(itl.size) < 0.02] *= 1.8
        for x in itl:
            self.metrics.itl.observe(float(x))
        ttft_median = (0.050 + 0.0004 * n) * self.slowdown
        for x in ttft_median * self.rng.lognormal(0.0, 0.25, size=max(1, n // 4)):
            self.metrics.ttft.observe(float(x))
        self.generated += 4 * n
        self.metrics.generation_tokens.inc(4 * n)

    def scrape(self) -> str:
        return generate_latest(self.metrics.registry).decode()


class Clock:
    def __init__(self, t: float = 50_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def daemon_side(**over):
    cfg = DaemonConfig.from_dict({"metrics_port": 0, **over})
    clock = Clock()
    book = AlertBook(clock=clock)
    metrics = EngineMetricsWatcher(book, cfg, "http://engine", engine_pid=lambda: 1, clock=clock)
    recent: list[dict] = []
    latency = LatencyWatcher(book, cfg, metrics, recent_foreign=lambda: recent, clock=clock)
    return cfg, clock, book, metrics, latency, recent


def run(sim, clock, metrics, latency, seconds, streams=None, each=None):
    for i in range(seconds):
        if streams is not None:
            sim.streams = streams(i)
        sim.second()
        metrics.ingest(sim.scrape(), pid=1)
        latency.update()
        if each is not None:
            each(i)
        clock.t += 1


def regressions(book):
    return [a for a in book.firing() if a.alertname == "LatencyRegression"]


def test_load_buckets_are_narrow_enough_to_compare():
    assert [load_bucket(n) for n in (0, 1, 2, 5, 8, 64, 95, 96, 200, 5000)] == [
        "0", "1", "2", "4-5", "8-11", "64-95", "64-95", "96-127", "192-255", "1024+"]


def test_no_regression_while_load_ramps_8_to_200_streams_and_back():
    """Ten minutes: 8 -> 200 streams in five, back to 8 in five. ITL rises ~2.5x
    and TTFT ~2.3x with the load; each bucket is judged against its own normal."""
    sim = SimEngine()
    cfg, clock, book, metrics, latency, _ = daemon_side()
    run(sim, clock, metrics, latency, 180, streams=lambda i: 8)  # the normal at light load first
    judged = []

    def ramp(i):
        frac = i / 300 if i < 300 else (600 - i) / 300
        return round(8 + 192 * frac)

    def check(i):
        assert not regressions(book), (i, sim.streams, [a.summary for a in regressions(book)])
        judged.extend(c.bucket for c in latency.baseline.compare("itl", cfg.latency_min_samples,
                                                                 cfg.latency_baseline_min_samples))

    run(sim, clock, metrics, latency, 600, streams=ramp, each=check)
    # not vacuous: on the way down every bucket had a normal from the way up
    assert {"8-11", "32-47", "64-95", "128-191", "192-255"} <= set(judged)
    assert latency.figures["itl_normal_p99_s"] is not None
    assert latency.figures["load_bucket"] == "8-11"


class StagedLoad(SimEngine):
    """The H200 ramp's shape (`gpu/daemon.sh ramp`, docs/perf.md "Latency regression"): closed-loop clients of N
    streams per stage; a stage's clients are killed and the next stage's N arrive at
    once. A scrape between stages sees no request; the burst's first tokens queue
    behind N prefills (TTFT up to ~N x 3 ms) and stall every running stream's steps
    for that second."""

    def __init__(self) -> None:
        super().__init__()
        self.burst = False

    def second(self) -> None:
        super().second()
        if self.burst:
            n = self.streams
            for x in 0.05 + 0.003 * n * self.rng.random(n):
                self.metrics.ttft.observe(float(x))
            for x in (0.02 + 0.0001 * n) * self.rng.lognormal(0.0, 0.2, size=4 * n):
                self.metrics.itl.observe(float(x))


def test_no_regression_when_stages_of_8_to_200_streams_start_in_bursts():
    """The H200 ramp raised LatencyRegression: a stage's burst of arrivals was filed
    under the mean of the scrapes around it (0 and N: half the new load), so the
    burst's queued first tokens were judged against a lighter load's normal."""
    sim = StagedLoad()
    cfg, clock, book, metrics, latency, _ = daemon_side()
    stages = (8, 32, 64, 128, 200, 128, 64, 32, 8)
    stage_s = 67
    judged = set()

    def streams(i):
        k, into = divmod(i, stage_s)
        sim.burst = into == 1
        return 0 if into == 0 else stages[k]

    def check(i):
        assert not regressions(book), (i, sim.streams, [a.summary for a in regressions(book)])
        judged.update(c.bucket for c in latency.baseline.compare(
            "ttft", cfg.latency_min_samples, cfg.latency_baseline_min_samples))

    run(sim, clock, metrics, latency, stage_s * len(stages), streams=streams, each=check)
    # not vacuous: on the way down the buckets had a normal from the way up
    assert {"32-47", "64-95", "128-191"} <= judged


def test_a_recorded_run_replays_through_the_real_watchers(tmp_path, capsys):
    """gpu/latency_replay.py: a device run's engine scrapes, judged again offline."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu"))
    from latency_replay import KEEP, replay

    sim = SimEngine()
    rec = tmp_path / "scrapes.jsonl"
    with rec.open("w") as f:
        for i in range(400):
            sim.slowdown = 2.3 if i >= 300 else 1.0  # a rogue job from t = 300 s
            sim.second()
            lines = [x for x in sim.scrape().splitlines() if x.startswith(KEEP)]
            f.write(json.dumps({"t": 1000.0 + i, "lines": lines}) + "\n")
    fired = replay(str(rec), [])
    assert [a["t_s"] for a in fired if "inter-token" in a["summary"]] == [pytest.approx(310, abs=10)]
    assert fired[0]["load_now"] == "8-11" and "no likely cause found" in fired[0]["summary"]
    assert replay(str(rec), ["latency_regression_factor=3"]) == []  # 2.3x is under a 3x factor
    # margins: each statistic's largest ratio to its normal, nothing kept out of the normal
    from latency_replay import margins

    margins(str(rec))
    out = capsys.readouterr().out
    ratio = {tuple(line.split()[:2]): float(line.split()[4]) for line in out.splitlines()}
    assert 2.0 < ratio[("itl", "mean")] < 2.6 and ratio[("itl", "p99")] > 1.5   # the job: 2.3x


def test_a_stitched_run_repeats_each_recorded_phase_at_its_load(tmp_path):
    """gpu/latency_replay.py stitch: a device run's short phases made into the daemon's
    long one. Each stage repeats its phase's increments at its load; steady traffic stays
    quiet, and a phase recorded under a rogue job still fires where it is stitched in."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu"))
    from latency_replay import KEEP, replay, stitch

    sim = SimEngine()
    rec, report = tmp_path / "scrapes.jsonl", tmp_path / "stalls.json"
    phases = {"low": (8, 1.0), "high": (64, 1.0), "rogue": (64, 2.3)}
    with rec.open("w") as f:
        for i in range(3 * 40):
            sim.streams, sim.slowdown = list(phases.values())[i // 40]
            sim.second()
            lines = [x for x in sim.scrape().splitlines() if x.startswith(KEEP)]
            f.write(json.dumps({"t": 1000.0 + i, "lines": lines}) + "\n")
    report.write_text(json.dumps({name: {"seconds": 40.0} for name in phases}))

    out = tmp_path / "ten.jsonl"
    assert stitch(str(rec), str(report), str(out), ["low", "high", "low", "high"], stage_s=100) == 401
    scrapes = [json.loads(x) for x in out.read_text().splitlines()]
    running = [float(next(x for x in s["lines"] if x.startswith("zerod_engine_requests_running")).split()[-1])
               for s in scrapes[1:]]
    assert running[:100] == [8.0] * 100 and running[100:200] == [64.0] * 100 and running[300:] == [64.0] * 100
    count = [float(next(x for x in s["lines"] if x.startswith("zerod_engine_inter_token_latency_seconds_count"))
                   .split()[-1]) for s in scrapes]
    assert all(b > a for a, b in zip(count, count[1:]))
    assert replay(str(out), []) == []

    stitch(str(rec), str(report), str(out), ["low", "high", "rogue"], stage_s=100)
    fired = replay(str(out), [])
    assert fired and 200 < fired[0]["t_s"] < 230 and fired[0]["load_now"] == "64-95"


def test_a_rogue_job_is_named_within_20_s_and_not_learned_as_normal():
    sim = SimEngine()
    cfg, clock, book, metrics, latency, recent = daemon_side()
    run(sim, clock, metrics, latency, 600, streams=lambda i: 64)
    assert not regressions(book)
    normal = latency.figures["itl_normal_p99_s"]
    assert normal and 0.007 < normal < 0.015
    start = clock.t
    recent.append({**ROGUE, "first_seen": start, "last_seen": start})
    sim.slowdown = 2.3  # ITL p50 5.3 -> 12.6 ms on the H200
    fired_at = []
    run(sim, clock, metrics, latency, 20,
        each=lambda i: fired_at.append(clock.t) if regressions(book) and not fired_at else None)
    assert fired_at and fired_at[0] - start <= 20
    a = book.get("LatencyRegression", "itl")
    assert a.summary.startswith(("p99 inter-token latency over 1.5x its normal ",
                                 "mean inter-token latency over 1.5x its normal ",
                                 "sustained mean inter-token latency over 1.5x its normal "))
    assert a.summary.endswith(" ms at 64-95 concurrent requests; likely cause: python3 (pid 9131) on GPU 0")
    assert "rogue_matmul.py" in a.description
    assert f"{a.starts_at - start:.0f} s before the regression began" in a.description
    assert a.labels["basis"] == "baseline" and a.labels["cause_pid"] == "9131" and a.fix == "kill 9131"
    # two more minutes of the rogue job: still firing, and the normal did not move
    run(sim, clock, metrics, latency, 120)
    assert book.get("LatencyRegression", "itl") is not None
    assert latency.figures["itl_normal_p99_s"] == pytest.approx(normal, rel=0.05)
    # the job ends: latency back to normal, the alert resolves once the window is clean
    sim.slowdown = 1.0
    run(sim, clock, metrics, latency, 65)
    assert not regressions(book)


class StallTail(SimEngine):
    """The H200's shape at 32 streams (the ramp's scrapes, gpu/results/daemon.md):
    95 % of ITL observations in the 5-10 ms histogram bucket (a step of ~5.5 ms), and a
    tail set by the steps that launch a new request's prefill on the CPU (15-40 ms, 0.7 %;
    the H200 had 0.8-0.9 % over 10 ms).
    A rogue job slows the GPU's steps 2.3x (5,600 -> 2,400 tokens/s there) but hardly
    those CPU-bound launches, so the tail barely moves."""

    def second(self) -> None:
        n = self.streams
        itl = 0.0055 * self.slowdown * self.rng.lognormal(0.0, 0.08, size=4 * n)
        stalls = self.rng.random(itl.size) < 0.007
        itl[stalls] = self.rng.uniform(0.015, 0.040, size=int(stalls.sum()))
        for x in itl:
            self.metrics.itl.observe(float(x))
        self.generated += 4 * n
        self.metrics.generation_tokens.inc(4 * n)


def test_a_rogue_job_is_named_within_20_s_when_the_tail_is_the_engines_own_launches():
    """The H200 rogue-job run judged by the p99 alone (docs/perf.md "Latency regression"): the minute's ITL p99 went from
    10.0 ms (the 5-10 ms bucket's edge) to 14.9 ms under the rogue job, 1.49x for a 2.3x
    slowdown, and no LatencyRegression came within 45 s. The mean of the last seconds
    is exact and moved 2.3x."""
    sim = StallTail()
    cfg, clock, book, metrics, latency, recent = daemon_side()
    run(sim, clock, metrics, latency, 300, streams=lambda i: 32,
        each=lambda i: not regressions(book) or pytest.fail(f"a regression at {i} s of steady load"))
    start = clock.t
    recent.append({**ROGUE, "first_seen": start, "last_seen": start})
    sim.slowdown = 2.3
    fired_at, p99_ratio = [], []

    def first_alert(i):
        if regressions(book) and not fired_at:
            fired_at.append(clock.t)
            p99 = latency.baseline.compare("itl", cfg.latency_min_samples, cfg.latency_baseline_min_samples)
            p99_ratio.append(max(c.ratio for c in p99))

    run(sim, clock, metrics, latency, 20, each=first_alert)
    # three scrapes: the sustained mean (the 10 s mean sparing its two worst: 5 s; the p99 alone: 13 s)
    assert fired_at and fired_at[0] - start <= 4
    a = book.get("LatencyRegression", "itl")
    assert a.summary.startswith("sustained mean inter-token latency over 1.5x its normal ")
    assert "likely cause: python3 (pid 9131) on GPU 0" in a.summary
    assert "in each of the last 3 scrapes (the lowest of them), 2." in a.description   # 2.2-2.3x
    assert a.labels["slo"] == "itl_sustained"  # the statistic that fired
    # the tail alone would not have told by then: the minute's p99 was under the factor
    assert p99_ratio[0] < cfg.latency_regression_factor


def test_the_shift_window_is_the_windows_last_seconds():
    from zerod.daemon_config import DaemonConfigError

    assert DaemonConfig.from_dict({"latency_shift_s": 60}).latency_shift_s == 60
    with pytest.raises(DaemonConfigError) as e:
        DaemonConfig.from_dict({"latency_shift_s": 90})
    assert "latency_shift_s" in str(e.value) and "must be <= latency_window_s (60)" in str(e.value)


def test_without_a_foreign_process_the_alert_names_throttling_or_says_none_found():
    sim = SimEngine()
    cfg, clock, book, metrics, latency, _ = daemon_side()
    run(sim, clock, metrics, latency, 400, streams=lambda i: 16)
    sim.slowdown = 2.3
    run(sim, clock, metrics, latency, 20)
    a = book.get("LatencyRegression", "itl")
    assert a.summary.endswith("no likely cause found")
    assert "no new process on the GPU, no throttling, Xid" in a.description
    book.fire("GpuThrottled", "0", severity="warning", summary="GPU 0 clocks held down: hw_thermal_slowdown",
              labels={"gpu": 0}, fix="check airflow")
    run(sim, clock, metrics, latency, 2)
    a = book.get("LatencyRegression", "itl")
    assert "likely cause: GpuThrottled (GPU 0 clocks held down: hw_thermal_slowdown)" in a.summary
    assert a.labels["cause"] == "GpuThrottled" and a.fix == "check airflow"


class PromptSim(SimEngine):
    """SimEngine whose requests have 128-token prompts, `cached` of them in the prefix
    cache; `arrivals` times as many first tokens a second at the same load."""

    def __init__(self) -> None:
        super().__init__()
        self.cached = 0.875
        self.arrivals = 1.0
        self.hits = 0

    def gauges(self) -> dict:
        return {**super().gauges(), "prefix_cache_queries": 0, "prefix_cache_hits": self.hits}

    def second(self) -> None:
        super().second()
        first = round(max(1, self.streams // 4) * self.arrivals)   # SimEngine's first tokens a second
        self.metrics.prompt_tokens.inc(128 * first)
        self.hits += int(128 * self.cached) * first


def test_a_latency_rise_that_fewer_prefix_hits_explain_raises_no_alert_and_says_why(caplog):
    """The H200 ramp: a stage's first requests replayed the prompts of the stage before
    (112 of 128 tokens cached), the rest were new; TTFT and ITL p99 doubled at the same
    load. Nothing on the host changed: no alert, and the watcher says the prompts did it."""
    sim = PromptSim()
    cfg, clock, book, metrics, latency, _ = daemon_side()
    run(sim, clock, metrics, latency, 300, streams=lambda i: 64)
    assert not regressions(book) and latency.figures["ttft_traffic"] is None
    sim.cached, sim.slowdown = 0.0, 2.0
    with caplog.at_level("INFO", logger="zerod.watchers.latency"):
        run(sim, clock, metrics, latency, 80)   # the window all new prompts
    assert not regressions(book)
    why = latency.figures["ttft_traffic"]
    assert why is not None and "128 prompt tokens computed per request over the window" in why
    assert "prefix-cache hits 0% of prompt tokens, normally 88%" in why
    assert "time to first token above its normal, explained by the prompts" in caplog.text
    # the prompts as before: latency back at its normal, nothing to explain
    sim.cached, sim.slowdown = 0.875, 1.0
    run(sim, clock, metrics, latency, 120)
    assert latency.figures["ttft_traffic"] is None and latency.figures["itl_traffic"] is None


def test_a_latency_rise_that_more_prompts_a_second_explain_raises_no_alert():
    """Near its capacity the engine's steps carry more prompt tokens when more requests
    arrive at the same load, and every decode waits for them: the H200's mixed 25 req/s
    traffic took the ITL mean 1.8x over its normal while computing 1.26-1.38x its prompt
    tokens a second. The traffic, not the host."""
    sim = PromptSim()
    cfg, clock, book, metrics, latency, _ = daemon_side()
    run(sim, clock, metrics, latency, 300, streams=lambda i: 64)
    sim.arrivals, sim.slowdown = 1.3, 1.8
    run(sim, clock, metrics, latency, 30)
    assert not regressions(book)
    why = latency.figures["itl_traffic"]
    assert why is not None and "prompt tokens computed a second over the last 10 s, 1.3" in why


def test_a_rogue_job_during_a_prompt_surge_is_still_named():
    """More prompts a second explain nothing when a new process holds the GPU."""
    sim = PromptSim()
    cfg, clock, book, metrics, latency, recent = daemon_side()
    run(sim, clock, metrics, latency, 300, streams=lambda i: 64)
    recent.append({**ROGUE, "first_seen": clock.t, "last_seen": clock.t})
    sim.arrivals, sim.slowdown = 1.3, 2.3
    run(sim, clock, metrics, latency, 20)
    a = book.get("LatencyRegression", "itl")
    assert a is not None and a.summary.endswith("likely cause: python3 (pid 9131) on GPU 0")
    assert latency.figures["itl_traffic"] is None


class PoissonPromptSim(PromptSim):
    """PromptSim with open-loop traffic: a Poisson number of first tokens a second, each
    prompt 32-4,096 tokens (log-uniform), none cached, so the prompt tokens a second swing
    from one second to the next as the mixed scenario's do."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = np.random.default_rng(seed)
        self.cached = 0.0

    def second(self) -> None:
        SimEngine.second(self)
        first = self.rng.poisson(max(1, self.streams // 4))
        self.metrics.prompt_tokens.inc(float(np.exp(self.rng.uniform(np.log(32), np.log(4096), first)).sum()))


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_a_rogue_job_under_swinging_prompt_traffic_is_named_within_20_s(seed):
    """A slower host computes no more prompt tokens than the arrivals bring: the seconds
    whose arrivals happen to run over the normal's rate do not hide it for long."""
    sim = PoissonPromptSim(seed)
    cfg, clock, book, metrics, latency, _ = daemon_side()
    run(sim, clock, metrics, latency, 300, streams=lambda i: 64)
    assert not regressions(book)
    sim.slowdown = 2.0
    fired = []
    run(sim, clock, metrics, latency, 20, each=lambda i: fired.append(i) if regressions(book) and not fired else None)
    assert fired, latency.figures["itl_traffic"]


def test_a_rogue_job_with_the_same_prompts_is_not_blamed_on_them():
    sim = PromptSim()
    cfg, clock, book, metrics, latency, recent = daemon_side()
    run(sim, clock, metrics, latency, 300, streams=lambda i: 64)
    sim.slowdown = 2.0
    run(sim, clock, metrics, latency, 30)
    a = book.get("LatencyRegression", "itl")
    assert a is not None and a.summary.endswith("no likely cause found") and "cause" not in a.labels


def test_factor_zero_turns_the_baseline_off_and_slo_still_works():
    sim = SimEngine()
    cfg, clock, book, metrics, latency, _ = daemon_side(latency_regression_factor=0, slo_ttft_p99_s=0.15)
    run(sim, clock, metrics, latency, 300, streams=lambda i: 16)
    sim.slowdown = 2.0
    run(sim, clock, metrics, latency, 60)
    assert book.get("LatencyRegression", "itl") is None  # doubled, but no baseline and no ITL SLO
    a = book.get("LatencyRegression", "ttft")
    assert a is not None and a.summary == "p99 time to first token over its SLO of 150.0 ms; no likely cause found" and a.labels["basis"] == "slo"


def test_the_window_joins_the_normal_only_after_it_leaves():
    from zerod.watchers.engine_metrics import Histogram

    b = LatencyBaseline(window_s=10, baseline_s=3600)
    h = Histogram({0.01: 100.0, float("inf"): 100.0}, 100, 0.5)
    for t in range(10):
        b.add(1000.0 + t, 64, {"itl": h, "ttft": Histogram()})
    assert b.normal("itl", "64-95").count == 0 and sum(h.count for h in b.current("itl")["64-95"]) == 1000
    b.taint("itl")
    b.add(1010.0, 64, {"itl": h, "ttft": Histogram()})
    assert b.normal("itl", "64-95").count == 0  # tainted: a regression is not learned
    for t in range(11, 25):
        b.add(1000.0 + t, 64, {"itl": h, "ttft": Histogram()})
    # t=1..14 left the window; t=1..9 were tainted, t=10..14 (5 x 100) were not
    assert b.normal("itl", "64-95").count == 500
    # an hour later the old slots are gone
    b.add(1000.0 + 3600 + 200, 64, {"itl": h, "ttft": Histogram()})
    assert "64-95" not in b.slots["itl"]


@pytest.mark.parametrize("value, problem", [(0.5, "must be 0 (off) or > 1"), (-1, "must be >= 0")])
def test_factor_is_checked(value, problem):
    from zerod.daemon_config import DaemonConfigError

    with pytest.raises(DaemonConfigError) as e:
        DaemonConfig.from_dict({"latency_regression_factor": value})
    assert problem in str(e.value)


REPO = Path(__file__).resolve().parent.parent
# recorded on the H200 (gpu/results/daemon.md): the rogue-job run, the 10-minute ramp and ten
# minutes of mixed traffic
RECORDED = Path(__file__).resolve().parent / "fixtures" / "h200_latency"
# recorded on an H100 (gpu/results/daemon.md): ten minutes of mixed traffic, and a rogue job
# beside mixed 10 and 25 req/s
H100 = Path(__file__).resolve().parent / "fixtures" / "h100_latency"


def _replay(path: Path) -> list[dict]:
    sys.path.insert(0, str(REPO / "gpu"))
    from latency_replay import replay

    return replay(str(path), [])


def test_the_h200_rogue_job_is_named_within_10_s_of_starting(tmp_path):
    """The engine's scrapes at 32 streams, the rogue job (16 GiB, bf16 matmuls) started at
    07:59:06 (its timeline); its CUDA start-up takes ~5 s before the steps slow. The
    default config, replayed."""
    stamps = dict(reversed(line.split(" ", 2)[1:]) for line in (RECORDED / "rogue-timeline.txt").read_text().splitlines()
                  if line.startswith("== "))
    hms = lambda s: sum(int(x) * k for x, k in zip(s.split(":"), (3600, 60, 1)))  # noqa: E731
    job_s = hms(stamps["rogue job starts"]) - hms(stamps["load: 32 streams"])  # the recording starts with the load
    (tmp_path / "scrapes.jsonl").write_bytes(gzip.decompress((RECORDED / "rogue-scrapes.jsonl.gz").read_bytes()))
    itl = [a for a in _replay(tmp_path / "scrapes.jsonl") if "inter-token" in a["summary"]]
    assert itl, "no LatencyRegression"
    assert 0 < itl[0]["t_s"] - job_s <= 10, (job_s, itl[0])
    assert itl[0]["summary"].startswith("sustained mean inter-token latency over 1.5x its normal")


@pytest.mark.parametrize("card", ["h200", "h100"])
def test_no_regression_over_10_minutes_of_mixed_traffic(tmp_path, card):
    """Mixed traffic at 10, 25, 10 and 25 req/s, 150 s each (Poisson; prompts 32-4,096,
    outputs 16-512): at 25 req/s the H200 runs near its capacity, and bursts of arrivals
    took the ITL mean 1.8x over its normal (the live daemon raised one alert, for 1 s, at
    that, before it judged prompt work). The engine was computing more prompt tokens a
    second than its normal: the traffic. On an H100 the live daemon that judges it raised
    none. The default config, replayed."""
    recorded = RECORDED if card == "h200" else H100
    lines = (recorded / "mixed-timeline.txt").read_text().splitlines()
    assert sum("stage: mixed traffic" in x for x in lines) == 4
    (tmp_path / "scrapes.jsonl").write_bytes(gzip.decompress((recorded / "mixed-scrapes.jsonl.gz").read_bytes()))
    assert sum(1 for _ in open(tmp_path / "scrapes.jsonl")) > 600  # the whole run
    assert _replay(tmp_path / "scrapes.jsonl") == []


def test_no_regression_on_the_h200_s_10_minute_ramp(tmp_path):
    """8 -> 200 -> 8 streams in nine stages, each stage's clients arriving at once; the
    default config, replayed."""
    (tmp_path / "scrapes.jsonl").write_bytes(gzip.decompress((RECORDED / "ramp-scrapes.jsonl.gz").read_bytes()))
    assert sum(1 for _ in open(tmp_path / "scrapes.jsonl")) > 600  # the whole ramp
    assert _replay(tmp_path / "scrapes.jsonl") == []


class OpenLoopSim(SimEngine):
    """Requests arrive at a fixed rate whatever the engine does (open loop): a slower
    engine holds each request longer, so as many more run at once (Little's law) and
    the load moves to buckets the engine may never have run at."""

    def __init__(self, base_streams: int = 16) -> None:
        super().__init__()
        self.base = base_streams

    def second(self) -> None:
        # the queue grows toward base x slowdown over a few seconds
        target = round(self.base * self.slowdown)
        self.streams += max(-4, min(4, target - self.streams))
        super().second()


def test_a_rogue_job_that_queues_open_loop_traffic_into_a_new_load_is_named():
    """At 16 requests (its normal), the rogue job doubles every step: the queue takes the
    load to 32-47, where the engine never ran. The minute before the job judges it."""
    sim = OpenLoopSim()
    cfg, clock, book, metrics, latency, recent = daemon_side()
    run(sim, clock, metrics, latency, 300, streams=lambda i: 16)
    recent.append({**ROGUE, "first_seen": clock.t, "last_seen": clock.t})
    sim.slowdown = 2.0
    fired = []
    run(sim, clock, metrics, latency, 20, each=lambda i: fired.append(i) if regressions(book) and not fired else None)
    assert fired and fired[0] <= 10
    a = book.get("LatencyRegression", "itl")
    assert a.summary.startswith("sustained mean inter-token latency over 1.5x its ")
    assert a.summary.endswith("of the minute before; likely cause: python3 (pid 9131) on GPU 0")
    assert a.labels["basis"] == "cause" and a.labels["slo"] == "itl_sustained" and a.labels["load"] == "32-47"
    assert "whatever the load then" in a.description and "rogue_matmul.py" in a.description
    # the job ends, the queue drains: the alert resolves, and nothing of it became normal
    sim.slowdown = 1.0
    run(sim, clock, metrics, latency, 30)
    assert not regressions(book)
    assert latency.baseline.normal("itl", "32-47").count == 0


def test_throttling_that_queues_open_loop_traffic_into_a_new_load_is_named():
    """A host alert is a likely cause as a new process is: clocks held down slow every
    step, the queue takes the load where the engine never ran."""
    sim = OpenLoopSim()
    cfg, clock, book, metrics, latency, _ = daemon_side()
    run(sim, clock, metrics, latency, 300, streams=lambda i: 16)
    book.fire("GpuThrottled", "0", severity="warning", summary="GPU 0 clocks held down: hw_thermal_slowdown",
              labels={"gpu": 0}, fix="check airflow")
    sim.slowdown = 2.0
    run(sim, clock, metrics, latency, 15)
    a = book.get("LatencyRegression", "itl")
    assert a is not None and a.labels["basis"] == "cause" and a.labels["cause"] == "GpuThrottled"
    assert a.summary.endswith("of the minute before; likely cause: GpuThrottled (GPU 0 clocks held down: hw_thermal_slowdown)")
    assert a.fix == "check airflow"


def test_a_harmless_process_beside_steady_open_loop_traffic_is_not_blamed():
    sim = OpenLoopSim()
    cfg, clock, book, metrics, latency, recent = daemon_side()
    run(sim, clock, metrics, latency, 300, streams=lambda i: 16)
    recent.append({**ROGUE, "first_seen": clock.t, "last_seen": clock.t})
    run(sim, clock, metrics, latency, 120)
    assert not regressions(book)


def test_an_nvml_reader_just_before_a_prompt_surge_does_not_hide_the_prompts():
    """An operator's nvidia-smi holds no CUDA context and takes no SM time: the prompts
    still explain a latency rise that follows it."""
    sim = PromptSim()
    cfg, clock, book, metrics, latency, recent = daemon_side()
    run(sim, clock, metrics, latency, 300, streams=lambda i: 64)
    recent.append({**ROGUE, "name": "nvidia-smi", "holds_context": False, "first_seen": clock.t, "last_seen": clock.t})
    sim.arrivals, sim.slowdown = 1.3, 1.8
    run(sim, clock, metrics, latency, 30)
    assert not regressions(book)
    assert latency.figures["itl_traffic"] is not None



@pytest.mark.parametrize("rate", [10, 25])
def test_the_h100_rogue_job_beside_mixed_traffic_is_named_within_10_s(tmp_path, rate):
    """The default daemon on an H100, mixed traffic at 10 or 25 req/s (Poisson; prompts
    32-4,096, outputs 16-512) for 95 s, then the rogue job (16 GiB, bf16 matmuls): ITL
    went 9 -> 40-58 ms (10 req/s) and 16 -> 45-54 ms (25 req/s), and the queue took the
    load from 12-23 to 48-95 and from 48-95 to 128-900 concurrent requests, loads the
    engine had never run at. The live daemon named the job (ForeignGpuProcess, at the
    time its log gives) but raised no LatencyRegression. Replayed with the job seen then."""
    stamps = dict(reversed(line.split(" ", 2)[1:]) for line in (H100 / f"mix{rate}-rogue-timeline.txt").read_text().splitlines()
                  if line.startswith("== "))
    sec = lambda s: sum(float(x) * k for x, k in zip(s.split(":"), (3600, 60, 1)))  # noqa: E731
    start = sec(stamps[f"load: mix{rate}"])   # the recording starts with the load
    job_s = sec(stamps["rogue job starts"]) - start
    seen_s = sec(next(t for what, t in stamps.items() if what.startswith("ForeignGpuProcess firing"))) - start
    assert 0 < seen_s - job_s < 5
    rec = tmp_path / "scrapes.jsonl"
    rec.write_bytes(gzip.decompress((H100 / f"mix{rate}-rogue-scrapes.jsonl.gz").read_bytes()))
    sys.path.insert(0, str(REPO / "gpu"))
    from latency_replay import replay

    assert replay(str(rec), []) == []   # the learned normal alone: no load it knows
    itl = [a for a in replay(str(rec), [f"foreign_at={seen_s}"]) if "inter-token" in a["summary"]]
    assert itl and 0 < itl[0]["t_s"] - job_s <= 10, (job_s, itl)
    assert itl[0]["basis"] == "cause" and "likely cause: trainer" in itl[0]["summary"]


def test_a_harmless_process_appearing_during_the_h200_s_mixed_traffic_is_not_blamed_against_the_minute_before(tmp_path):
    """A process holding a CUDA context that slows nothing, first seen every 30 s of the
    H200's ten minutes of mixed traffic (10, 25, 10, 25 req/s): the minute before it
    never names it (the traffic's own swings at a load with no normal yet either follow a
    change of prompt work, or stay under the factor)."""
    rec = tmp_path / "scrapes.jsonl"
    rec.write_bytes(gzip.decompress((RECORDED / "mixed-scrapes.jsonl.gz").read_bytes()))
    sys.path.insert(0, str(REPO / "gpu"))
    from latency_replay import replay

    blamed = [(at, a["t_s"]) for at in range(60, 600, 30)
              for a in replay(str(rec), [f"foreign_at={at}"]) if a["basis"] == "cause"]
    assert blamed == []
