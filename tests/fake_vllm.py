"""A vLLM-shaped server for the daemon's tests: `GET /health` answers 200 with an
empty body (as vLLM's does: no pid), `GET /metrics` serves `vllm:*` series with
vLLM's labels and real histogram buckets, fed by simulated traffic: 32 running
requests, 200 inter-token latencies every 0.1 s around 6 ms. SIGUSR1 makes the
engine three times slower (a rogue job beside it); SIGUSR2 stops its tokens while
/health still answers (vLLM's stuck engine, its issue #39863).

    python tests/fake_vllm.py PORT
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LABELS = {"model_name": "meta-llama/Llama-3.1-8B-Instruct", "engine": "0"}
# vLLM's own bucket bounds for these two histograms
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


def main(port: int) -> None:
    reg = CollectorRegistry()
    names = list(LABELS)
    running = Gauge("vllm:num_requests_running", "Running requests.", names, registry=reg).labels(**LABELS)
    waiting = Gauge("vllm:num_requests_waiting", "Waiting requests.", names, registry=reg).labels(**LABELS)
    itl = Histogram("vllm:inter_token_latency_seconds", "ITL.", names, buckets=ITL_BUCKETS,
                    registry=reg).labels(**LABELS)
    ttft = Histogram("vllm:time_to_first_token_seconds", "TTFT.", names, buckets=TTFT_BUCKETS,
                     registry=reg).labels(**LABELS)
    gen = Counter("vllm:generation_tokens", "Generated tokens.", names, registry=reg).labels(**LABELS)
    running.set(32)
    waiting.set(1)
    slow = [1.0]
    stalled = [False]

    async def traffic(_app):
        async def loop():
            rng = random.Random(1)
            while True:
                for _ in range(200):
                    itl.observe(0.006 * slow[0] * rng.lognormvariate(0, 0.1))
                for _ in range(5):
                    ttft.observe(0.05 * slow[0] * rng.lognormvariate(0, 0.2))
                gen.inc(200)
                await asyncio.sleep(0.1)
                while stalled[0]:
                    await asyncio.sleep(0.1)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    async def health(_req):
        return web.Response(status=200)

    async def metrics(_req):
        return web.Response(body=generate_latest(reg), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.cleanup_ctx.append(traffic)
    signal.signal(signal.SIGUSR1, lambda *_: slow.__setitem__(0, 3.0))
    signal.signal(signal.SIGUSR2, lambda *_: stalled.__setitem__(0, True))
    web.run_app(app, host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":
    main(int(sys.argv[1]))
