"""The named scenarios of `zerod bench` and how each one runs."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from zerod.bench.client import Client, Load

SCENARIOS: dict[str, dict[str, Any]] = {
    "hello-ttft": dict(prompt_text="Hello", input_len=0, output_len=1, num_prompts=100,
                       concurrency=1, warmup=5),
    "streams-200": dict(input_len=24, output_len=128, num_prompts=200, concurrency=200,
                        warmup=200),
    "decode-b1": dict(input_len=16, output_len=256, num_prompts=5, concurrency=1, warmup=1),
    "prefill-16k": dict(input_len=16384, output_len=1, num_prompts=5, concurrency=1,
                        warmup=1),
    # long phase; the short phase uses --short-input-len (1024)
    "long-context": dict(input_len=16384, output_len=256, num_prompts=3, concurrency=1,
                         warmup=1),
    # mixed chat/agent traffic: Poisson 25 req/s for 24 s, lengths log-uniform
    "mix": dict(request_rate=25.0, num_prompts=600, concurrency=0, warmup=2,
                input_len_range=(32, 4096), output_len_range=(16, 512)),
    # 16 system prompts of 2,000 tokens, each request one of them + 48 unique tokens
    "prefix": dict(request_rate=16.0, num_prompts=384, concurrency=0, prefix_len=2000,
                   num_prefixes=16, suffix_len=48, output_len=64),
}
ORDER = ["hello-ttft", "streams-200", "decode-b1", "prefill-16k", "long-context"]
# docs/perf.md's throughput table in one command: 200 concurrent 24-in / 128-out streams
# in two bursts (the first meets cold connections and an idle server, the second a warm
# one), the same 200 as closed-loop users, then batch-1 decode and a 16K prompt; each
# phase is the named scenario's shape
COMPOSITE = {"throughput-table": (("burst-1", "streams-200"), ("burst-2", "streams-200"),
                                  ("closed-loop", "streams-200"),
                                  ("decode-b1", "decode-b1"), ("prefill-16k", "prefill-16k"))}
CLOSED_LOOP_ROUNDS = 3    # each closed-loop user sends this many requests, one after another


# Shape flags a scenario keeps regardless of --input-len / --output-len (its definition).
_FIXED = {"hello-ttft": ("input_len", "output_len"), "prefill-16k": ("output_len",)}


def load_for(name: str, overrides: dict[str, Any]) -> Load:
    base = dict(SCENARIOS.get(name, {}))
    fixed = _FIXED.get(name, ())
    base.update({k: v for k, v in overrides.items() if v is not None and k not in fixed})
    return Load(**base)


async def run_scenario(client: Client, name: str, overrides: dict[str, Any],
                       short_input_len: int) -> dict[str, Any]:
    if name in COMPOSITE:
        phases = {}
        for phase, shape in COMPOSITE[name]:
            load = load_for(shape, overrides)
            if phase.startswith("burst"):
                load.warmup = 0   # a burst is all the requests at once, nothing before
            elif phase == "closed-loop":
                # as many users as a burst has requests, each sending its next request as
                # its last one ends: the steady state that a burst's start and end hide
                users = min(load.concurrency or load.num_prompts, load.num_prompts)
                load.concurrency, load.num_prompts, load.warmup = users, users * CLOSED_LOOP_ROUNDS, 0
            phases[phase] = await client.run(f"{name}:{phase}", load)
        return {"scenario": name, "phases": phases,
                "completed": sum(p["completed"] for p in phases.values()),
                "failed": sum(p["failed"] for p in phases.values())}
    if name != "long-context":
        return await client.run(name, load_for(name, overrides))
    long_load = load_for(name, overrides)
    short_load = Load(**{**asdict(long_load), "input_len": short_input_len})
    short = await client.run(f"{name}:short", short_load)
    long = await client.run(f"{name}:long", long_load)

    def ratio(r: dict) -> float | None:
        i = r["itl_ms"]
        return i["p99"] / i["p50"] if i["n"] and i["p50"] else None

    rs, rl = ratio(short), ratio(long)
    return {"scenario": name, "phases": {"short": short, "long": long},
            "itl_p99_over_p50": {"short": rs, "long": rl},
            "long_minus_short": (rl - rs) if rs is not None and rl is not None else None,
            "completed": short["completed"] + long["completed"],
            "failed": short["failed"] + long["failed"]}
