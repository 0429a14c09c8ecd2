"""Record an engine's /metrics once a second, and replay a recording through the
daemon's real EngineMetricsWatcher and LatencyWatcher (default config) offline:
which LatencyRegression would fire, when, at which load — so a device run's
verdict can be re-read without the device.

    python3 gpu/latency_replay.py record URL OUT.jsonl     (until killed)
    python3 gpu/latency_replay.py replay OUT.jsonl [KEY=VALUE ...]   ([daemon] overrides;
        foreign_at=SECONDS: a process holding a CUDA context first seen on the GPU that
        many seconds into the recording, as the daemon's GPU watcher reports one)
    python3 gpu/latency_replay.py causes OUT.jsonl [STEP_S]
        a context-holding process first seen every STEP_S (10) seconds, one replay each: how
        often its appearance alone would be blamed for a LatencyRegression
    python3 gpu/latency_replay.py intervals OUT.jsonl      (each scrape interval's load and p50/p99)
    python3 gpu/latency_replay.py margins OUT.jsonl        (each statistic's largest ratio to its normal)
    python3 gpu/latency_replay.py stitch SRC.jsonl STALLS.json OUT.jsonl [PHASE ...]
        a longer recording made of SRC's phases (gpu/stalls_probe.py's report names them
        and their seconds), each repeated for STAGE_S (150) seconds, in the order given
        (default: mix10 mix25 mix10 mix25, the daemon's ten-minute mixed run)
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zerod.engine import metrics as names  # noqa: E402

# the series the latency watcher reads (histogram lines start with the family's name), and
# the engine's step times to read the run by
KEEP = (names.TIME_TO_FIRST_TOKEN_SECONDS, names.INTER_TOKEN_LATENCY_SECONDS,
        names.REQUESTS_RUNNING, names.REQUESTS_WAITING, names.PROMPT_TOKENS_TOTAL,
        names.PREFIX_CACHE_HITS_TOTAL, names.STEP_SECONDS)


def record(url: str, out: str) -> None:
    with open(out, "a") as f:
        while True:
            t = time.time()
            try:
                text = urllib.request.urlopen(url, timeout=2).read().decode()
                lines = [x for x in text.splitlines() if x.startswith(KEEP)]
                f.write(json.dumps({"t": t, "lines": lines}) + "\n")
                f.flush()
            except OSError:
                pass
            time.sleep(max(0.0, 1.0 - (time.time() - t)))


# a process the daemon's GPU watcher reports as holding a CUDA context (foreign_at=)
FOREIGN = {"pid": 4242, "name": "trainer", "cmdline": "python3 gpu/rogue_job.py 16 60", "unit": None,
           "container": None, "gpu": 0, "holds_context": True, "fix": "kill 4242"}


def replay(path: str, overrides: list[str], each=None) -> list[dict]:
    """The LatencyRegression alerts the recording raises; each(latency watcher, seconds into
    the recording) after every scrape, if given."""
    from zerod.alerts import AlertBook
    from zerod.daemon_config import DaemonConfig
    from zerod.watchers.engine_metrics import EngineMetricsWatcher
    from zerod.watchers.latency import LatencyWatcher

    over = {k: json.loads(v) for k, v in (o.split("=", 1) for o in overrides)}
    foreign_at = over.pop("foreign_at", None)
    cfg = DaemonConfig.from_dict({"metrics_port": 0, **over})
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    book = AlertBook(clock=clock)
    metrics = EngineMetricsWatcher(book, cfg, "http://engine", engine_pid=lambda: 1, clock=clock)
    t0 = None
    seen = lambda: [] if foreign_at is None or now[0] - t0 < foreign_at else [  # noqa: E731
        {**FOREIGN, "first_seen": t0 + foreign_at, "last_seen": now[0]}]
    latency = LatencyWatcher(book, cfg, metrics, recent_foreign=seen, clock=clock)
    fired: dict[str, dict] = {}
    for line in open(path):
        rec = json.loads(line)
        now[0] = rec["t"]
        t0 = rec["t"] if t0 is None else t0
        metrics.ingest("\n".join(rec["lines"]) + "\n", pid=1, now=rec["t"])
        f = latency.update(now=rec["t"])
        if each is not None:
            each(latency, rec["t"] - t0)
        for a in book.firing():
            if a.alertname == "LatencyRegression" and a.id not in fired:
                fired[a.id] = {"t_s": round(rec["t"] - t0, 1), "load_now": f["load_bucket"],
                               "basis": a.labels.get("basis"), "summary": a.summary, "description": a.description}
    return list(fired.values())


def margins(path: str) -> None:
    """How far below the factor the recording stays: each (metric, statistic)'s largest
    ratio to its normal over the recording, with the factor out of reach (no alert, so no
    interval is kept out of the normal) — the statistics the watcher judges and TTFT's mean."""
    best: dict[tuple[str, str], tuple[float, float, str]] = {}

    def each(latency, t: float) -> None:
        cfg = latency.cfg
        for metric in ("itl", "ttft"):
            for stat, recent in (("p99", None), ("mean", cfg.latency_shift_window_s)):
                comps = latency.baseline.compare(metric, cfg.latency_min_samples, cfg.latency_baseline_min_samples,
                                                 cfg.latency_baseline_min_s, stat=stat, recent_s=recent)
                if metric == "itl" and stat == "mean":
                    comps += latency.baseline.sustained(metric, cfg.latency_sustain_intervals or 3,
                                                        cfg.latency_min_samples, cfg.latency_baseline_min_samples,
                                                        cfg.latency_baseline_min_s)
                for c in comps:
                    if c.ratio > best.get((metric, c.stat), (0.0,))[0]:
                        best[(metric, c.stat)] = (c.ratio, t, c.bucket)

    replay(path, ["latency_regression_factor=1000"], each)
    for (metric, stat), (ratio, t, bucket) in sorted(best.items()):
        print(f"{metric:4s} {stat:4s}  largest ratio {ratio:5.2f}  at {t:5.0f} s, {bucket} concurrent requests")


def causes(path: str, step_s: float = 10.0) -> None:
    """A process holding a CUDA context first seen every step_s seconds of the recording,
    one replay each: the appearances its traffic alone would blame for a LatencyRegression
    (a harmless process that happens to appear then)."""
    span = sum(1 for _ in open(path))   # ~1 s a scrape
    blamed, tried = [], 0
    at = 60.0
    while at < span - 5:
        tried += 1
        fired = [a for a in replay(path, [f"foreign_at={at}"]) if a["t_s"] >= at and "trainer" in a["summary"]]
        if fired:
            blamed.append((at, fired[0]))
        at += step_s
    for at, a in blamed:
        print(f"process at {at:5.0f} s: blamed at {a['t_s']:5.0f} s ({a['basis']}): {a['summary']}")
    by = {b: sum(a["basis"] == b for _, a in blamed) for b in ("cause", "baseline")}
    print(f"appearances blamed: {len(blamed)} of {tried} (against the minute before it: {by['cause']}, "
          f"against the learned normal: {by['baseline']})")


def intervals(path: str) -> None:
    """One line per scrape interval: the concurrency at both ends, ITL and TTFT counts,
    p50 and p99 (ms) of the interval alone."""
    from zerod.watchers.engine_metrics import parse_metrics

    def ms(h, q):
        return "-" if h.count <= 0 else f"{h.quantile(q) * 1000:.1f}"

    prev, t0 = None, None
    for line in open(path):
        rec = json.loads(line)
        values, ttft, itl = parse_metrics("\n".join(rec["lines"]) + "\n")
        load = values.get(names.REQUESTS_RUNNING, 0) + values.get(names.REQUESTS_WAITING, 0)
        t0 = rec["t"] if t0 is None else t0
        if prev is not None:
            p_load, p_ttft, p_itl = prev
            d_itl, d_ttft = itl.minus(p_itl), ttft.minus(p_ttft)
            print(f"{rec['t'] - t0:6.0f} s  load {p_load:4.0f} -> {load:4.0f}  itl n={d_itl.count:6.0f} "
                  f"p50 {ms(d_itl, 0.5):>6s} p99 {ms(d_itl, 0.99):>6s}  ttft n={d_ttft.count:4.0f} "
                  f"p50 {ms(d_ttft, 0.5):>6s} p99 {ms(d_ttft, 0.99):>6s}")
        prev = (load, ttft, itl)


GAUGES = (names.REQUESTS_RUNNING, names.REQUESTS_WAITING)


def stitch(src: str, report: str, out: str, phases: list[str], stage_s: float = 150.0,
           trim_s: float = 3.0) -> int:
    """Write a recording of `phases` one after another, each `stage_s` long: the per-scrape
    increments of the phase's recorded window (the probe's report gives each phase's
    seconds, in the order they ran; trim_s off each end, where the probe's start and the
    last requests' drain blur it) repeated, the gauges as recorded. Returns the scrapes
    written. A model of steady traffic at each load, for `replay` and `margins`: it keeps
    the engine's latency as it was under that traffic, not how it drifts over time."""
    recs = [json.loads(x) for x in open(src)]
    keys = [x.rsplit(" ", 1)[0] for x in recs[0]["lines"]]
    values = [dict(x.rsplit(" ", 1) for x in r["lines"]) for r in recs]
    spans, at = {}, 0.0
    for name, phase in json.load(open(report)).items():
        spans[name] = (at + trim_s, at + phase["seconds"] - trim_s)
        at += phase["seconds"]
    t0 = recs[0]["t"]

    def steps(name: str) -> list[tuple[float, dict[str, float]]]:
        lo, hi = spans[name]
        idx = [i for i, r in enumerate(recs) if lo <= r["t"] - t0 <= hi]
        out = []
        for i, j in zip(idx, idx[1:]):
            a, b = values[i], values[j]
            out.append((recs[j]["t"] - recs[i]["t"],
                        {k: float(b.get(k, 0)) if k.startswith(GAUGES) else float(b.get(k, 0)) - float(a.get(k, 0))
                         for k in keys}))
        if not out:
            raise SystemExit(f"{src}: no scrapes inside phase {name!r} ({lo:.0f}-{hi:.0f} s)")
        return out

    cur, t, n = {k: 0.0 for k in keys}, 0.0, 0
    with open(out, "w") as f:
        def write():
            f.write(json.dumps({"t": t, "lines": [f"{k} {cur[k]:.17g}" for k in keys]}) + "\n")
        write()
        n += 1
        for name in phases:
            cycle, i, end = steps(name), 0, t + stage_s
            while t < end:
                dt, d = cycle[i % len(cycle)]
                i += 1
                t += dt
                for k in keys:
                    cur[k] = d[k] if k.startswith(GAUGES) else cur[k] + d[k]
                write()
                n += 1
    return n


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 3 and sys.argv[1] == "replay":
        fired = replay(sys.argv[2], sys.argv[3:])
        for a in fired:
            print(json.dumps(a))
        print(f"LatencyRegression in the replay: {len(fired) or 'none'}")
    elif len(sys.argv) in (3, 4) and sys.argv[1] == "causes":
        causes(sys.argv[2], *(float(x) for x in sys.argv[3:]))
    elif len(sys.argv) == 3 and sys.argv[1] == "intervals":
        intervals(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "margins":
        margins(sys.argv[2])
    elif len(sys.argv) >= 5 and sys.argv[1] == "stitch":
        import os

        n = stitch(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:] or ["mix10", "mix25", "mix10", "mix25"],
                   float(os.environ.get("STAGE_S", "150")))
        print(f"{sys.argv[4]}: {n} scrapes")
    else:
        sys.exit(__doc__)
