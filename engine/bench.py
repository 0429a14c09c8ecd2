"""`zerod bench`: a streaming HTTP benchmark client for a running OpenAI-compatible server.

Like `vllm bench serve`: random token-id prompts of set input/output lengths sent to
/v1/completions with `ignore_eos` and `max_tokens` = output length, streamed; a fixed
concurrency and/or a Poisson request rate; warm-up requests excluded from the figures.
Reports request and output-token throughput, TTFT, ITL (gaps between streamed chunks),
TPOT ((e2e - TTFT) / (output tokens - 1)) and e2e latency with mean/p50/p95/p99, and the
server's CPU use over the measured window read from /proc/PID (whole process and per
thread name), and writes JSON (`--out`).

Named scenarios (`--scenario`, repeatable, or `all`):
  hello-ttft    prompt "Hello", max_tokens 1, one request at a time
  streams-200   200 concurrent streams, 24 prompt tokens, 128 output tokens
  long-context  decode after a 16K-token prompt vs after a 1K prompt: ITL percentiles
  decode-b1     batch-1 decode tokens/s (16 prompt tokens, 256 output tokens)
  prefill-16k   time to first token of a 16K-token prompt
Flags given explicitly override a scenario's values (e.g. smaller shapes on a CPU), except
what defines it: hello-ttft keeps its prompt and max_tokens 1, prefill-16k max_tokens 1.

Runs with only the standard library and aiohttp (no numpy, no psutil needed).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, astuple, dataclass, field
from typing import Any

import click

# --------------------------------------------------------------------------- statistics


def percentile(sorted_vals: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_vals:
        return float("nan")
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def summary_ms(vals_s: list[float]) -> dict[str, float | int | None]:
    """mean / p50 / p95 / p99 / min / max in milliseconds, and the count."""
    if not vals_s:
        return {"n": 0, "mean": None, "p50": None, "p95": None, "p99": None, "min": None,
                "max": None}
    v = sorted(x * 1000.0 for x in vals_s)
    return {"n": len(v), "mean": sum(v) / len(v), "p50": percentile(v, 50),
            "p95": percentile(v, 95), "p99": percentile(v, 99), "min": v[0], "max": v[-1]}


# --------------------------------------------------------------------------- server CPU


def _read_cpu(pid: int) -> tuple[float, dict[int, tuple[str, float]]] | None:
    """(process cpu seconds, {tid: (thread name, cpu seconds)}) from /proc, or None."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat_cpu(path: str) -> float:
        with open(path, "rb") as f:
            s = f.read()
        rest = s[s.rfind(b")") + 2:].split()  # fields after the command name
        return (int(rest[11]) + int(rest[12])) / tick  # utime, stime

    try:
        total = stat_cpu(f"/proc/{pid}/stat")
    except (OSError, ValueError, IndexError):
        return None
    threads: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            threads[int(tid)] = (name, stat_cpu(f"/proc/{pid}/task/{tid}/stat"))
        except (OSError, ValueError, IndexError):
            continue
    return total, threads


class CpuWindow:
    """CPU the server process used between start() and stop(), in cores."""

    def __init__(self, pid: int | None, thread_names: dict[int, str] | None = None) -> None:
        self.pid = pid
        self.thread_names = thread_names or {}  # tid -> name (the server's /health)
        self.t0 = 0.0
        self.c0: Any = None

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.c0 = _read_cpu(self.pid) if self.pid else None

    def stop(self) -> dict[str, Any] | None:
        if not self.pid or self.c0 is None:
            return None
        c1 = _read_cpu(self.pid)
        wall = time.perf_counter() - self.t0
        if c1 is None or wall <= 0:
            return None
        by_name: dict[str, float] = {}
        for tid, (name, cpu) in c1[1].items():
            name = self.thread_names.get(tid, name)
            before = self.c0[1].get(tid, (name, 0.0))[1]
            by_name[name] = by_name.get(name, 0.0) + max(0.0, cpu - before)
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
        return {"pid": self.pid, "wall_s": wall, "cpu_s": c1[0] - self.c0[0],
                "cores": (c1[0] - self.c0[0]) / wall,
                "threads_cores": {n: c / wall for n, c in top}}


# --------------------------------------------------------------------------- one request


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
                        if not obj.get("choices"):
                            continue
                    if b'"role":"assistant"' in ev:
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


# --------------------------------------------------------------------------- a load


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
        self.workers = 0  # client processes; 0 = auto_workers()

    def payload(self, load: Load) -> dict[str, Any]:
        if load.prompt_text is not None:
            prompt: Any = load.prompt_text
        else:
            # Avoid the lowest ids (BOS/EOS/pad in most vocabularies); unique per request.
            lo = min(10, self.vocab_size - 1)
            prompt = [self.rng.randrange(lo, self.vocab_size) for _ in range(load.input_len)]
        p = {"prompt": prompt, "max_tokens": load.output_len, "temperature": 0.0,
             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        if self.model:
            p["model"] = self.model
        return p

    async def run(self, label: str, load: Load) -> dict[str, Any]:
        import aiohttp

        url = self.base_url + "/v1/completions"
        limit = load.concurrency or 0
        conn = aiohttp.TCPConnector(limit=limit, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            if load.warmup:
                warm = [self.payload(load) for _ in range(load.warmup)]
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

            cpu = CpuWindow(self.server_pid, self.thread_names)
            cpu.start()
            prog.start()
            t0 = time.perf_counter()
            tasks = []
            for p in payloads:
                tasks.append(asyncio.ensure_future(go(p)))
                if math.isfinite(load.request_rate):
                    await asyncio.sleep(self.rng.expovariate(load.request_rate))
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
                args=(i, self.base_url + "/v1/completions", self.headers, share, c, rate,
                      self.rng.randrange(1 << 30), start, q, done, failed, tokens)))
        loop = asyncio.get_running_loop()
        for p in procs:
            p.start()
        try:
            for _ in procs:  # every worker has its event loop and session up
                msg = await loop.run_in_executor(None, q.get, True, 120)
                assert msg[0] == "ready", msg
            prog.source = lambda: (done.value, failed.value, tokens.value)
            cpu = CpuWindow(self.server_pid, self.thread_names)
            cpu.start()
            prog.start()
            t0 = time.perf_counter()
            start.set()
            results: list[Result] = []
            for _ in procs:
                msg = await loop.run_in_executor(None, q.get, True, 3600)
                results.extend(Result(*r) for r in msg[2])
            duration = time.perf_counter() - t0
            prog.stop()
            cpu_info = cpu.stop()
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        return results, duration, cpu_info


def auto_workers(load: Load) -> int:
    """Client processes: one per 64 concurrent streams (a Python client process handles
    roughly 10k streamed chunks/s before it starts to delay what it measures)."""
    if not load.concurrency:
        return 1 if load.num_prompts <= 64 else min(8, os.cpu_count() or 1)
    return max(1, min(8, (os.cpu_count() or 1) - 1, -(-load.concurrency // 64)))


def _worker(i, url, headers, payloads, concurrency, rate, seed, start, q, done, failed,
            tokens) -> None:
    asyncio.run(_worker_main(i, url, headers, payloads, concurrency, rate, seed, start, q,
                             done, failed, tokens))


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
            warm = dict(payloads[0], max_tokens=1)
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
        for p in payloads:
            tasks.append(asyncio.ensure_future(go(p)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
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
        "tpot_ms": summary_ms(tpot),
        "e2el_ms": summary_ms([r.latency for r in ok]),
        "decode_tokens_per_s": ({"mean": sum(decode_tps) / len(decode_tps),
                                 "p50": percentile(sorted(decode_tps), 50)}
                                if decode_tps else None),
        "engine_cpu": cpu,
    }


# --------------------------------------------------------------------------- scenarios

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
}
ORDER = ["hello-ttft", "streams-200", "decode-b1", "prefill-16k", "long-context"]


# Shape flags a scenario keeps regardless of --input-len / --output-len (its definition).
_FIXED = {"hello-ttft": ("input_len", "output_len"), "prefill-16k": ("output_len",)}


def _load_for(name: str, overrides: dict[str, Any]) -> Load:
    base = dict(SCENARIOS.get(name, {}))
    fixed = _FIXED.get(name, ())
    base.update({k: v for k, v in overrides.items() if v is not None and k not in fixed})
    return Load(**base)


async def run_scenario(client: Client, name: str, overrides: dict[str, Any],
                       short_input_len: int) -> dict[str, Any]:
    if name != "long-context":
        return await client.run(name, _load_for(name, overrides))
    long_load = _load_for(name, overrides)
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


# --------------------------------------------------------------------------- output


def _f(v: Any, fmt: str = "{:,.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(results: dict[str, dict]) -> str:
    rows = [("scenario", "ok/n", "req/s", "out tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms",
             "TPOT p50 ms", "cores")]

    def row(label: str, r: dict) -> tuple:
        cpu = r.get("engine_cpu") or {}
        return (label, f"{r['completed']}/{r['num_requests']}", _f(r["request_throughput"],
                "{:,.2f}"), _f(r["output_throughput"]),
                f"{_f(r['ttft_ms']['p50'])}/{_f(r['ttft_ms']['p99'])}",
                f"{_f(r['itl_ms']['p50'], '{:.2f}')}/{_f(r['itl_ms']['p99'], '{:.2f}')}",
                _f(r["tpot_ms"]["p50"], "{:.2f}"), _f(cpu.get("cores"), "{:.2f}"))

    for name, r in results.items():
        if "phases" in r:
            for ph, pr in r["phases"].items():
                rows.append(row(f"{name}:{ph}", pr))
        else:
            rows.append(row(name, r))
    widths = [max(len(str(x[i])) for x in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(rw, widths)) for rw in rows]
    extra = []
    for name, r in results.items():
        if "phases" in r:
            q = r["itl_p99_over_p50"]
            extra.append(f"{name}: ITL p99/p50 short {_f(q['short'], '{:.3f}')}, long "
                         f"{_f(q['long'], '{:.3f}')}, long-short "
                         f"{_f(r['long_minus_short'], '{:+.3f}')}")
        elif r.get("decode_tokens_per_s") and name == "decode-b1":
            extra.append(f"{name}: decode {r['decode_tokens_per_s']['mean']:,.1f} tokens/s "
                         "per request")
    return "\n".join(lines + extra)


# --------------------------------------------------------------------------- command


async def _server_info(base_url: str, api_key: str | None) -> tuple[dict, list[str]]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        try:
            async with s.get(base_url + "/health") as r:
                try:
                    health = await r.json(content_type=None)
                except ValueError:
                    health = {}
                health["_status"] = r.status
            async with s.get(base_url + "/v1/models", headers=headers) as r:
                models = await r.json(content_type=None) if r.status == 200 else {}
        except aiohttp.ClientError as exc:
            raise click.ClickException(f"cannot reach the server at {base_url}: {exc}")
    names = [m.get("id") for m in (models.get("data") or []) if isinstance(m, dict)]
    return health, names


def _is_local(base_url: str) -> bool:
    from urllib.parse import urlparse

    host = urlparse(base_url).hostname or ""
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"],
                                          "max_content_width": 100})
@click.option("--base-url", default=None, help="Server URL (default http://HOST:PORT).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--model", default=None, help="Model name to send (default: the server's first).")
@click.option("--api-key", envvar="ZEROD_API_KEY", default=None)
@click.option("--scenario", "scenarios", multiple=True,
              type=click.Choice(list(SCENARIOS) + ["all", "random"]),
              help="Named scenario (repeatable); 'all' runs every one; default: 'random' "
                   "with the shapes below.")
@click.option("--input-len", "--random-input-len", "input_len", type=click.IntRange(min=1),
              default=None, help="Prompt tokens (random ids). [random: 128]")
@click.option("--output-len", "--random-output-len", "output_len",
              type=click.IntRange(min=1), default=None,
              help="Output tokens per request (ignore_eos). [random: 128]")
@click.option("--short-input-len", type=click.IntRange(min=1), default=1024,
              show_default=True, help="long-context: the short prompt compared against.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None,
              help="Measured requests. [random: 64]")
@click.option("--max-concurrency", "concurrency", type=click.IntRange(min=0), default=None,
              help="Requests in flight at most (0 = no limit). [random: 16]")
@click.option("--request-rate", type=float, default=None,
              help="Poisson arrivals per second (default inf: all at once, bounded by "
                   "--max-concurrency).")
@click.option("--warmup", "--num-warmups", "warmup", type=click.IntRange(min=0), default=None,
              help="Warm-up requests before measuring (excluded). [random: 2]")
@click.option("--vocab-size", type=click.IntRange(min=2), default=None,
              help="Random prompt ids are drawn below this (default: the server's /health "
                   "vocab_size).")
@click.option("--server-pid", type=int, default=None,
              help="Server process to read CPU use from (default: /health's pid when the "
                   "server is on this host).")
@click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="Client processes sharing the load (0 = one per 64 concurrent streams, "
                   "so the client does not bound what it measures).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the results as JSON here.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def bench(base_url, host, port, model, api_key, scenarios, input_len, output_len,
          short_input_len, num_prompts, concurrency, request_rate, warmup, vocab_size,
          server_pid, workers, seed, out, progress):
    """Drive a running zerod (or any OpenAI-compatible) server and report TTFT, ITL, TPOT
    and throughput."""
    base_url = (base_url or f"http://{host}:{port}").rstrip("/")
    names = list(scenarios) or ["random"]
    if "all" in names:
        names = ORDER
    overrides = {"input_len": input_len, "output_len": output_len, "num_prompts": num_prompts,
                 "concurrency": concurrency, "warmup": warmup,
                 "request_rate": request_rate if request_rate is not None else None}
    if request_rate is not None and request_rate <= 0:
        raise click.BadParameter("must be > 0", param_hint="--request-rate")
    results = asyncio.run(_main(base_url, model, api_key, names, overrides, short_input_len,
                                vocab_size, server_pid, seed, progress, out, workers))
    failed = sum(r.get("failed", 0) for r in results.values())
    sys.exit(1 if failed else 0)


async def _main(base_url, model, api_key, names, overrides, short_input_len, vocab_size,
                server_pid, seed, progress, out, workers=0) -> dict[str, dict]:
    health, models = await _server_info(base_url, api_key)
    if health.get("_status") != 200:
        raise click.ClickException(f"the server is not healthy: /health answered "
                                   f"{health.get('_status')} {health}")
    model = model or (models[0] if models else None)
    vocab = vocab_size or health.get("vocab_size") or 1000
    pid = server_pid
    if pid is None and _is_local(base_url) and isinstance(health.get("pid"), int):
        pid = health["pid"]
    if pid is not None and not os.path.exists(f"/proc/{pid}"):
        click.echo(f"bench: no process {pid} here: engine CPU is not measured", err=True)
        pid = None
    client = Client(base_url, model, api_key, vocab, seed, progress, pid)
    client.workers = workers
    if pid is not None and pid == health.get("pid") and isinstance(health.get("threads"), dict):
        client.thread_names = {int(tid): name for name, tid in health["threads"].items()
                               if isinstance(tid, int)}
    results: dict[str, dict] = {}
    for name in names:
        results[name] = await run_scenario(client, name, overrides, short_input_len)
        if out:
            _write(out, base_url, model, health, results)
    click.echo(table(results))
    return results


def _write(path: str, base_url: str, model: str | None, health: dict,
           results: dict[str, dict]) -> None:
    doc = {"zerod_bench": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "base_url": base_url, "model": model,
           "server": {k: v for k, v in health.items() if not k.startswith("_")},
           "scenarios": results}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    bench(prog_name="python -m zerod.engine.bench")
