"""The load generator: streamed requests to /v1/completions (or /v1/chat/completions,
`--backend openai-chat`) at a set concurrency or rate (gamma arrivals: Poisson, or
burstier / more even with --burstiness), over one event loop or several worker
processes, and their report."""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import random
import re
import sys
import time
from dataclasses import asdict, astuple, dataclass, field
from typing import Any

import click

from zerod.bench.arrivals import next_gap
from zerod.bench.datasets import Sample
from zerod.bench.server_cpu import CpuWindow
from zerod.bench.stats import percentile, summary_ms


# the first chat chunk: the role and empty (or no) content, any JSON spacing
_ROLE_ONLY = re.compile(rb'"delta":\s*\{\s*"role":\s*"assistant"\s*(,\s*"content":\s*(""|null)\s*)?\}')



STALL_GAP_MS = 100.0   # a gap between two tokens of a stream this long is a stall a user sees

@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0
    cached_tokens: int = 0      # usage.prompt_tokens_details.cached_tokens


class Progress:
    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label = label
        self.total = total
        self.enabled = enabled
        self.done = 0
        self.failed = 0
        self.tokens = 0
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._task: asyncio.Task | None = None

    source: Any = None  # () -> (done, failed, tokens) when workers count for us

    def line(self) -> str:
        if self.source is not None:
            self.done, self.failed, self.tokens = self.source()
        el = time.perf_counter() - self.t0
        return (f"[{self.label}] {self.done}/{self.total} done, {self.failed} failed, "
                f"{self.tokens / el if el > 0 else 0:,.0f} tok/s, {el:.1f}s")

    async def _loop(self) -> None:
        period = 0.5 if self.tty else 5.0
        while True:
            await asyncio.sleep(period)
            self._emit()

    def _emit(self, end: str | None = None) -> None:
        if self.tty:
            sys.stderr.write("\r" + self.line() + "\033[K" + (end or ""))
        else:
            sys.stderr.write(self.line() + "\n")
        sys.stderr.flush()

    def start(self) -> None:
        self.t0 = time.perf_counter()
        if self.enabled:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def stop(self) -> None:
        if self._task:
            self._task.cancel()
            self._emit("\n")


async def one_request(session, url: str, payload: dict, headers: dict,
                      progress: Progress | None) -> Result:
    """One streamed request. Reads whole network buffers (not lines): events that arrive
    in one read share its timestamp, as they would with a line reader, at a fraction of
    the client CPU per token (200 streams at 20k tokens/s must not be bound by the client).
    """
    res = Result()
    t0 = time.perf_counter()
    last = t0
    first = True
    itl = res.itl
    buf = b""
    done = False
    try:
        async with session.post(url, json=payload, headers=headers) as r:
            if r.status != 200:
                body = await r.text()
                res.error = f"HTTP {r.status}: {body[:300]}"
                return res
            async for data in r.content.iter_any():
                now = time.perf_counter()
                buf += data
                if b"\n\n" not in data and b"\n\n" not in buf[-len(data) - 1:]:
                    continue
                events = buf.split(b"\n\n")
                buf = events.pop()  # an incomplete event waits for the next read
                for ev in events:
                    if not ev.startswith(b"data: "):
                        continue
                    if ev == b"data: [DONE]":
                        done = True
                        break
                    # Per-event work kept to a timestamp: JSON only for usage / errors.
                    if b'"usage":{' in ev or b'"error"' in ev:
                        obj = json.loads(ev[6:])
                        if "error" in obj:
                            res.error = json.dumps(obj["error"])[:300]
                            return res
                        u = obj.get("usage")
                        if u:
                            res.prompt_tokens = u.get("prompt_tokens", 0)
                            res.output_tokens = u.get("completion_tokens", 0)
                            res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                        if not obj.get("choices"):
                            continue
                    if b'"role"' in ev and _ROLE_ONLY.search(ev):
                        continue  # the chat role chunk carries no token
                    if first:
                        res.ttft = now - t0
                        first = False
                    else:
                        itl.append(now - last)
                    last = now
                    res.chunks += 1
                    if progress is not None:
                        progress.tokens += 1
                if done:
                    break
        res.latency = last - t0
        res.ok = not first and done
        if first:
            res.error = "the stream ended without a token"
        elif not done:
            res.error = "the stream ended without [DONE]"
        if res.output_tokens == 0:
            res.output_tokens = res.chunks
    except Exception as exc:  # a failed request is counted, never fatal
        res.error = f"{type(exc).__name__}: {exc}"
    return res


@dataclass
class Load:
    """One measured run: shapes, how requests arrive, how many."""

    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 64
    concurrency: int = 16  # 0 = unlimited
    request_rate: float = math.inf
    warmup: int = 2
    prompt_text: str | None = None  # instead of random ids
    # mixed traffic: lengths drawn log-uniform in [min, max] per request (instead of the above)
    input_len_range: tuple[int, int] | None = None
    output_len_range: tuple[int, int] | None = None
    # shared prefixes: each prompt is one of num_prefixes random prefixes + suffix_len
    # unique tokens (instead of input_len); the warm-up sends each prefix once
    prefix_len: int = 0
    num_prefixes: int = 0
    suffix_len: int = 0
    # goodput SLOs in ms, vLLM's keys: ttft, tpot (alias itl: the request's mean gap), e2el
    goodput: dict[str, float] | None = None
    burstiness: float = 1.0  # the gamma shape of the arrival gaps (1: Poisson)


BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions",
            "openai-chat": "/v1/chat/completions"}
# Chat takes text, not token ids: a random prompt is these words (each one token in the
# common BPE vocabularies; the server's usage counts the real prompt tokens).
WORDS = ("the of and to in is that it was for on are with as his they be at one have this "
         "from or had by word but what some we can out other were all there when up use "
         "your how said an each she which do their time if will way about many then them "
         "write would like so these her long make thing see him two has look more day "
         "could go come did number sound no most people my over know water than call first "
         "who may down side been now find any new work part take get place made live where "
         "after back little only round man year came show every good me give our under").split()


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


class Client:
    def __init__(self, base_url: str, model: str | None, api_key: str | None,
                 vocab_size: int, seed: int, progress: bool, server_pid: int | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self.progress = progress
        self.server_pid = server_pid
        self.thread_names: dict[int, str] = {}
        self.engine_pid: int | None = None   # the engine's own process (--engine-process)
        self.workers = 0  # client processes; 0 = auto_workers()
        self.extra_body: dict[str, Any] = {}  # merged into every request (--extra-body)
        self.lora_modules: list[str] = []     # each request's model drawn from these (--lora-modules)
        self.backend = "openai"               # BACKENDS: which endpoint, which body
        self.dataset: list[Sample] | None = None  # prompts from a file, taken in turn
        self._next_sample = 0
        self._prefixes: dict[tuple[int, int], list[list[int]]] = {}

    def _ids(self, n: int) -> list[int]:
        # Avoid the lowest ids (BOS/EOS/pad in most vocabularies); unique per request.
        lo = min(10, self.vocab_size - 1)
        return [self.rng.randrange(lo, self.vocab_size) for _ in range(n)]

    def payload(self, load: Load, prefix_index: int | None = None) -> dict[str, Any]:
        rng = self.rng
        output_len = load.output_len
        if load.output_len_range:
            output_len = log_uniform(rng, *load.output_len_range)
        if load.prompt_text is not None:
            prompt: Any = load.prompt_text
        elif load.num_prefixes:
            key = (load.num_prefixes, load.prefix_len)
            if key not in self._prefixes:
                self._prefixes[key] = [self._ids(load.prefix_len) for _ in range(load.num_prefixes)]
            i = rng.randrange(load.num_prefixes) if prefix_index is None else prefix_index
            prompt = self._prefixes[key][i % load.num_prefixes] + self._ids(load.suffix_len)
        elif load.input_len_range:
            prompt = self._ids(log_uniform(rng, *load.input_len_range))
        else:
            prompt = self._ids(load.input_len)
        if self.dataset and load.prompt_text is None:
            sample = self.dataset[self._next_sample % len(self.dataset)]
            self._next_sample += 1
            prompt, output_len = sample.prompt, sample.output_len
        p = {"max_tokens": output_len, "temperature": 0.0,
             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if self.backend == "openai-chat":
            text = prompt if isinstance(prompt, str) else " ".join(
                WORDS[t % len(WORDS)] for t in prompt)
            p["messages"] = [{"role": "user", "content": text}]
            p["max_completion_tokens"] = p.pop("max_tokens")
        else:
            p["prompt"] = prompt
        if self.lora_modules:
            p["model"] = rng.choice(self.lora_modules)
        elif self.model:
            p["model"] = self.model
        p.update(self.extra_body)
        return p

    async def run(self, label: str, load: Load) -> dict[str, Any]:
        import aiohttp

        url = self.base_url + BACKENDS[self.backend]
        limit = load.concurrency or 0
        conn = aiohttp.TCPConnector(limit=limit, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            if load.warmup:
                warm = [self.payload(load, prefix_index=i if load.num_prefixes else None)
                        for i in range(max(load.warmup, load.num_prefixes))]
                wres = await asyncio.gather(*(one_request(session, url, p, self.headers, None)
                                              for p in warm))
                bad = [r.error for r in wres if not r.ok]
                if len(bad) == len(wres):
                    raise click.ClickException(f"[{label}] every warm-up request failed: "
                                               f"{bad[0]}")
            payloads = [self.payload(load) for _ in range(load.num_prompts)]
            prog = Progress(label, load.num_prompts, self.progress)
            workers = self.workers or auto_workers(load)
            workers = max(1, min(workers, load.num_prompts))
            if workers > 1:
                results, duration, cpu_info = await self._run_procs(label, load, payloads,
                                                                    workers, prog)
                out = report(label, load, results, duration, cpu_info)
                out["config"]["workers"] = workers
                return out
            sem = asyncio.Semaphore(load.concurrency) if load.concurrency else None

            async def go(p: dict) -> Result:
                if sem is None:
                    r = await one_request(session, url, p, self.headers, prog)
                else:
                    async with sem:
                        r = await one_request(session, url, p, self.headers, prog)
                prog.done += 1
                prog.failed += not r.ok
                return r

            cpu = CpuWindow(self.server_pid, self.thread_names, self.engine_pid)
            cpu.start()
            prog.start()
            t0 = time.perf_counter()
            tasks = []
            for p in payloads:
                tasks.append(asyncio.ensure_future(go(p)))
                if math.isfinite(load.request_rate):
                    await asyncio.sleep(next_gap(self.rng, load.request_rate, load.burstiness))
            results = await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
            prog.stop()
            cpu_info = cpu.stop()
        out = report(label, load, results, duration, cpu_info)
        out["config"]["workers"] = 1
        return out

    async def _run_procs(self, label: str, load: Load, payloads: list[dict], workers: int,
                         prog: Progress) -> tuple[list[Result], float, dict | None]:
        """The measured requests split over `workers` processes (one event loop each)."""
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        start = ctx.Event()
        q = ctx.Queue()
        done = ctx.Value("q", 0)
        failed = ctx.Value("q", 0)
        tokens = ctx.Value("q", 0)
        conc = load.concurrency
        procs = []
        for i in range(workers):
            share = payloads[i::workers]
            c = (conc // workers + (i < conc % workers)) if conc else 0
            if conc:
                c = max(1, c)
            rate = load.request_rate / workers
            procs.append(ctx.Process(
                target=_worker, name=f"zerod-bench-{i}", daemon=True,
                args=(i, self.base_url + BACKENDS[self.backend], self.headers, share, c,
                      (rate, load.burstiness), self.rng.randrange(1 << 30), start, q, done,
                      failed, tokens)))
        for p in procs:
            p.start()
        try:
            for _ in procs:  # every worker has its event loop and session up
                msg = await _get(q, 120)
                assert msg[0] == "ready", msg
            prog.source = lambda: (done.value, failed.value, tokens.value)
            cpu = CpuWindow(self.server_pid, self.thread_names, self.engine_pid)
            cpu.start()
            prog.start()
            t0 = time.perf_counter()
            start.set()
            results: list[Result] = []
            for _ in procs:
                msg = await _get(q, 3600)
                results.extend(Result(*r) for r in msg[2])
            duration = time.perf_counter() - t0
            prog.stop()
            cpu_info = cpu.stop()
        except BaseException:
            for p in procs:   # interrupted or failed: nothing more to wait for from the workers
                p.kill()
            raise
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        return results, duration, cpu_info


async def _get(q, timeout: float):
    """q.get off the event loop, in short waits: an interrupt (Ctrl-C, a timeout's SIGINT)
    ends the run at once instead of leaving an executor thread blocked for `timeout`."""
    loop = asyncio.get_running_loop()
    end = time.monotonic() + timeout
    while True:
        try:
            return await loop.run_in_executor(None, q.get, True, 0.5)
        except queue.Empty:
            if time.monotonic() > end:
                raise


def auto_workers(load: Load) -> int:
    """Client processes: one per 64 concurrent streams (a Python client process handles
    roughly 10k streamed chunks/s before it starts to delay what it measures)."""
    if not load.concurrency:
        return 1 if load.num_prompts <= 64 else min(8, os.cpu_count() or 1)
    return max(1, min(8, (os.cpu_count() or 1) - 1, -(-load.concurrency // 64)))


def _worker(i, url, headers, payloads, concurrency, rate, seed, start, q, done, failed,
            tokens) -> None:
    try:
        asyncio.run(_worker_main(i, url, headers, payloads, concurrency, rate, seed, start, q,
                                 done, failed, tokens))
    except KeyboardInterrupt:
        pass   # Ctrl-C (or a timeout's SIGINT) reaches the whole process group: the parent reports it


async def _worker_main(i, url, headers, payloads, concurrency, rate, seed, start, q, done,
                       failed, tokens) -> None:
    import aiohttp

    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        # Open this worker's connections before the clock starts (max_tokens 1 requests),
        # as the in-process warm-up does for the single-process client.
        if payloads:
            n = concurrency or min(64, len(payloads))
            warm = dict(payloads[0], **{"max_completion_tokens" if "messages" in payloads[0]
                                        else "max_tokens": 1})
            await asyncio.gather(*(one_request(session, url, warm, headers, None)
                                   for _ in range(n)))
        q.put(("ready", i))
        await loop.run_in_executor(None, start.wait)
        sem = asyncio.Semaphore(concurrency) if concurrency else None

        async def go(p: dict) -> Result:
            if sem is None:
                r = await one_request(session, url, p, headers, None)
            else:
                async with sem:
                    r = await one_request(session, url, p, headers, None)
            with done.get_lock():
                done.value += 1
            if not r.ok:
                with failed.get_lock():
                    failed.value += 1
            with tokens.get_lock():
                tokens.value += r.chunks
            return r

        tasks = []
        rate, burstiness = rate
        for p in payloads:
            tasks.append(asyncio.ensure_future(go(p)))
            if math.isfinite(rate):
                await asyncio.sleep(next_gap(rng, rate, burstiness))
        results = await asyncio.gather(*tasks)
    q.put(("done", i, [astuple(r) for r in results]))


def report(label: str, load: Load, results: list[Result], duration: float,
           cpu: dict | None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    decode_tps = [(r.output_tokens - 1) / (r.latency - r.ttft) for r in ok
                  if r.output_tokens > 1 and r.latency > r.ttft]
    itl = [x for r in ok for x in r.itl]
    errors = [r.error for r in results if not r.ok][:5]
    prompt_total = sum(r.prompt_tokens for r in ok)
    good = [r for r in ok if meets_slos(r, load.goodput)] if load.goodput else None
    return {
        "scenario": label,
        "config": {k: (None if isinstance(v, float) and math.isinf(v) else v)
                   for k, v in asdict(load).items()},
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
        "ttft_ms": summary_ms([r.ttft for r in ok]),
        "itl_ms": summary_ms(itl),
        # stalls: the gaps between two tokens of one stream over STALL_GAP_MS (itl_ms' max is the longest)
        "itl_gaps_over_100ms": sum(g > STALL_GAP_MS for g in (x * 1000.0 for x in itl)),
        "tpot_ms": summary_ms(tpot),
        "e2el_ms": summary_ms([r.latency for r in ok]),
        "decode_tokens_per_s": ({"mean": sum(decode_tps) / len(decode_tps),
                                 "p50": percentile(sorted(decode_tps), 50)}
                                if decode_tps else None),
        "engine_cpu": cpu,
        "prefix_cache_hit_rate": (sum(r.cached_tokens for r in ok) / prompt_total
                                  if prompt_total else None),
        # per request, for `--save-result` (vLLM's result file lists them); not in --out
        "_raw": {"input_lens": [r.prompt_tokens for r in ok],
                 "output_lens": [r.output_tokens for r in ok],
                 "ttfts": [r.ttft for r in ok], "itls": [r.itl for r in ok],
                 "e2els": [r.latency for r in ok], "errors": [r.error for r in results if not r.ok],
                 "good": None if good is None else len(good)},
        "goodput": ({"slos_ms": load.goodput, "good": len(good),
                     "share": len(good) / len(results) if results else None,
                     "request_throughput": len(good) / duration if duration > 0 else None}
                    if good is not None else None),
    }


def meets_slos(r: Result, slos: dict[str, float]) -> bool:
    """vLLM's goodput rule: a request is good when it meets every SLO given (ms)."""
    tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    got = {"ttft": r.ttft, "tpot": tpot, "itl": tpot, "e2el": r.latency}
    return all(got[k] * 1000.0 <= v for k, v in slos.items())
