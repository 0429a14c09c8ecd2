"""The "no stall" scenarios against one running server, from READY on (an independent
streaming client: aiohttp, token ids as prompts, every token's arrival time kept).

    python3 gpu/stalls_probe.py PORT OUT.json [--phases hello,first16k,...]

Phases, in this order on a fresh server (each uses prompts of its own, so no phase hits
another's prefix cache):
  first16k   three 16,384-token prompts one after another: TTFT of each
  streams16k 32 streams decoding, then a 16,384-token prompt arrives: the streams' longest
             gap between tokens while it prefills, and its TTFT
  mix25      Poisson 25 req/s for 40 s, prompts 32-4,096, outputs 16-512 (log-uniform)
  mix10      the same at 10 req/s for 30 s
  prefix     16 shared 2,000-token prefixes + 48 unique tokens, 64 out, 16 req/s, 20 s; twice
  hello      30 "Hello"-sized prompts (2 tokens), max_tokens 1, one at a time: TTFT
  burst200   200 streams of 24 prompt and 128 output tokens sent at once, twice: TTFT and
             output tokens/s of each wave (zerod bench's streams-200)
After each phase the server's slow-step counter is scraped (absent on older code).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import time

import aiohttp

VOCAB = 128000


def pct(v, p):
    if not v:
        return None
    v = sorted(v)
    k = (len(v) - 1) * p / 100
    f = math.floor(k)
    return v[f] + (v[min(f + 1, len(v) - 1)] - v[f]) * (k - f)


class Client:
    def __init__(self, port: int, rng: random.Random):
        self.url = f"http://127.0.0.1:{port}"
        self.rng = rng
        self.session: aiohttp.ClientSession | None = None
        self.model = ""
        self.vocab = VOCAB

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(min(1000, self.vocab // 2), self.vocab) for _ in range(n)]

    async def stream(self, prompt: list[int], max_tokens: int) -> dict:
        """One streamed completion: arrival times of its tokens (perf_counter)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "temperature": 0}
        t0 = time.perf_counter()
        times = []
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            if r.status != 200:
                return {"error": r.status, "t0": t0, "times": []}
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    times.append(time.perf_counter())
        return {"t0": t0, "times": times}

    async def slow_steps(self) -> dict:
        async with self.session.get(self.url + "/metrics") as r:
            text = await r.text()
        out = {}
        for m in re.finditer(r'^zerod_engine_slow_steps_total\{reason="([a-z_]+)"\} ([0-9.e+]+)$', text, re.M):
            out[m.group(1)] = float(m.group(2))
        steps = re.search(r"^zerod_engine_step_seconds_count ([0-9.e+]+)$", text, re.M)
        out["steps"] = float(steps.group(1)) if steps else None
        return out


def summarize(results: list[dict]) -> dict:
    ok = [r for r in results if not r.get("error") and r["times"]]
    ttft = [(r["times"][0] - r["t0"]) * 1000 for r in ok]
    gaps = [(b - a) * 1000 for r in ok for a, b in zip(r["times"], r["times"][1:])]
    return {"n": len(results), "errors": len(results) - len(ok),
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "ttft_max": max(ttft, default=None),
            "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99), "itl_max": max(gaps, default=None),
            "gaps_over_100ms": sum(g > 100 for g in gaps)}


async def poisson(c: Client, rate: float, seconds: float, make) -> list[dict]:
    tasks, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        prompt, out = make()
        tasks.append(asyncio.create_task(c.stream(prompt, out)))
        await asyncio.sleep(c.rng.expovariate(rate))
    return await asyncio.gather(*tasks)


def loguniform(rng, lo, hi):
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


async def phase(c: Client, name: str) -> dict:
    rng = c.rng
    if name == "hello":
        res = [await c.stream(c.prompt(2), 1) for _ in range(30)]
        return summarize(res)
    if name == "first16k":
        res = [await c.stream(c.prompt(16384), 1) for _ in range(3)]
        return {"ttft_ms": [(r["times"][0] - r["t0"]) * 1000 if r["times"] else None for r in res]}
    if name == "streams16k":
        streams = [asyncio.create_task(c.stream(c.prompt(64), 700)) for _ in range(32)]
        await asyncio.sleep(3.0)
        big = await c.stream(c.prompt(16384), 1)
        t_big0, t_big1 = big["t0"], (big["times"][0] if big["times"] else big["t0"])
        res = await asyncio.gather(*streams)
        during = [(b - a) * 1000 for r in res for a, b in zip(r["times"], r["times"][1:])
                  if b >= t_big0 and a <= t_big1 + 0.5]
        return {"prompt_ttft_ms": (t_big1 - t_big0) * 1000, "streams_max_gap_ms": max(during, default=None),
                "streams_gaps_over_100ms": sum(g > 100 for g in during), "streams": summarize(res)}
    if name in ("mix25", "mix10"):
        rate, secs = (25.0, 40.0) if name == "mix25" else (10.0, 30.0)
        res = await poisson(c, rate, secs, lambda: (c.prompt(loguniform(rng, 32, 4096)), loguniform(rng, 16, 512)))
        return summarize(res)
    if name == "prefix":
        out = {}
        for run in ("first", "second"):
            prefixes = [c.prompt(2000) for _ in range(16)] if run == "first" else prefixes
            res = await poisson(c, 16.0, 20.0, lambda: (rng.choice(prefixes) + c.prompt(48), 64))
            out[run] = summarize(res)
        return out
    if name == "burst200":
        out = {}
        for wave in ("first", "second"):
            res = await asyncio.gather(*(c.stream(c.prompt(24), 128) for _ in range(200)))
            out[wave] = summarize(res)
            ends = [r["times"][-1] for r in res if r["times"]]
            tokens = sum(len(r["times"]) for r in res)
            out[wave]["output_tokens_per_s"] = tokens / (max(ends) - min(r["t0"] for r in res)) if ends else None
        return out
    raise SystemExit(f"unknown phase {name}")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("out")
    ap.add_argument("--phases", default="first16k,streams16k,mix25,mix10,prefix,hello,burst200")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=VOCAB, help="prompt token ids are drawn below this")
    a = ap.parse_args()
    c = Client(a.port, random.Random(a.seed))
    c.vocab = a.vocab
    report = {}
    # no cap on connections: aiohttp's default pool of 100 makes the 101st stream of the
    # 25 req/s mix wait in this client, and that wait would count as the server's TTFT
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as s:
        c.session = s
        async with s.get(c.url + "/v1/models") as r:
            c.model = (await r.json())["data"][0]["id"]
        for name in a.phases.split(","):
            t0 = time.perf_counter()
            report[name] = await phase(c, name)
            report[name]["seconds"] = time.perf_counter() - t0
            report[name]["slow_steps_after"] = await c.slow_steps()
            print(name, json.dumps(report[name])[:400], flush=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
