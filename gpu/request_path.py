"""Where the time of one tiny streamed request goes, stage by stage, on an idle engine.

    python gpu/request_path.py [--model demo] [--device cpu] [--load-format auto]
                               [--dtype D] [--max-model-len N]
                               [-n 300] [--warmup 20] [--json OUT.json]

It drives engine internals, so it stands with the device tools, outside the product. The
engine and the HTTP server run in this process as `zerod serve` builds them (Engine(config),
the same aiohttp app); a client in a child process sends "Hello"-sized requests one at a
time (2 prompt token ids, max_tokens 1, stream true, one keep-alive connection, raw
sockets) and keeps its send and first-SSE-byte times. Both sides read CLOCK_MONOTONIC
(time.perf_counter), so the server's marks fall on the client's timeline.

The marks come from wrappers this script puts around engine and server methods before
it builds them: nothing in the product is instrumented, so serving pays nothing for it.
A mark is the first time its point is reached in a request. The table gives, for each
stage on the request's critical path, the median of (mark - previous mark) in µs.

On the CPU the model's forward runs inline in the step thread ("model forward" below); on
a GPU that row is the launch alone, the device's own time is the step's event time
("device step (events)"), spent while the poller waits for the step's event.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # zerod from the checkout

# The critical path, in order: (mark, what the time from the previous mark to it is).
STAGES = [
    ("received", "client send -> the server's socket has it"),
    ("handler", "HTTP: parse the request, route, middleware"),
    ("body", "read the body, JSON parse"),
    ("validated", "validate the request (schema, limits)"),
    ("submit", "model name, prompt ids, sampling params, plan"),
    ("queued", "engine.submit (checks, Request, inbox put)"),
    ("taken", "step thread wakes, takes the request"),
    ("launch", "scheduler admits, schedules"),
    ("staged", "stage the step's inputs"),
    ("forward_start", "launch up to the forward"),
    ("forward_end", "model forward (CPU: runs; GPU: graph launch)"),
    ("launched", "sampling, copy to the ring, step record"),
    ("polled", "poller wakes, takes the step record"),
    ("synced", "wait for the step's event (GPU: the device), read ring"),
    ("emit", "detokenize, stop checks, metrics"),
    ("on_output", "build the output, call on_output"),
    ("drain", "hop to the event loop (call_soon_threadsafe)"),
    ("write", "to the first chunk's write (the handler's wake-up)"),
    ("client", "format, write, deliver to the client"),
]


class Trace:
    """Marks of the request in flight: a new dict when a request's handler starts."""

    def __init__(self) -> None:
        self.requests: list[dict[str, float]] = []
        self.cur: dict[str, float] | None = None
        self.received = 0.0   # the last time the HTTP protocol got bytes

    def start(self) -> None:
        self.cur = {"received": self.received, "handler": time.perf_counter()}
        self.requests.append(self.cur)

    def on_bytes(self) -> None:
        self.received = time.perf_counter()

    def mark(self, name: str, value: float | None = None) -> None:
        d = self.cur
        if d is not None and name not in d:
            d[name] = time.perf_counter() if value is None else value


TRACE = Trace()


def _wrap(cls, name: str, before: str | None = None, after: str | None = None, when=None,
          is_async: bool = False) -> None:
    """cls.name marks `before` at entry and `after` on return (when(args) is true, if given)."""
    fn = getattr(cls, name)
    if is_async:
        async def wrapped(*a, **kw):
            if before:
                TRACE.mark(before)
            r = await fn(*a, **kw)
            if after:
                TRACE.mark(after)
            return r
    else:
        def wrapped(*a, **kw):
            on = when is None or when(a)
            if before and on:
                TRACE.mark(before)
            r = fn(*a, **kw)
            if after and on:
                TRACE.mark(after)
            return r
    wrapped.__wrapped__ = fn
    setattr(cls, name, wrapped)


def instrument() -> None:
    """Wrap the methods that bound each stage (before the server and engine are built)."""
    from zerod.engine.api import protocol as P
    from zerod.engine.api import server as S
    from zerod.engine.api.http_edge import EdgeProtocol
    from zerod.engine.core.engine import Engine
    from zerod.engine.core.output import OutputPoller
    from zerod.engine.runner.model_runner import ModelRunner
    from aiohttp import web

    comp = S.OpenAIServer.completions

    async def completions(self, request):
        TRACE.start()
        return await comp(self, request)

    S.OpenAIServer.completions = completions
    data_received = EdgeProtocol.data_received

    def received(self, data):
        TRACE.on_bytes()
        return data_received(self, data)

    EdgeProtocol.data_received = received
    parse_body = P.parse_body

    def body(raw):
        r = parse_body(raw)
        TRACE.mark("body")
        return r

    P.parse_body = body
    _wrap(P.RequestSchemas, "parse_completion", after="validated")
    _wrap(Engine, "submit", before="submit", after="queued")
    _wrap(Engine, "_handle", before="taken", when=lambda a: a[1][0] == "submit")
    _wrap(Engine, "_launch", before="launch", after="launch_end")
    _wrap(ModelRunner, "stage", after="staged")
    _wrap(ModelRunner, "prefill_logits", before="forward_start", after="forward_end")
    _wrap(ModelRunner, "launch", after="launched")
    _wrap(OutputPoller, "_step", before="polled")
    _wrap(OutputPoller, "_token", before="emit")
    _wrap(OutputPoller, "_token", before="synced")   # if the step-time callback comes later
    _wrap(OutputPoller, "_emit", before="on_output")
    _wrap(S.OutputRouter, "_drain", before="drain")
    _wrap(web.StreamResponse, "prepare", after="prepared", is_async=True)
    _wrap(web.StreamResponse, "write", before="write", is_async=True)
    _wrap(S._DirectSink, "__call__", before="write")   # the drain writes the chunk itself


def _on_step_time(engine) -> None:
    """The poller's step-time callback marks when the event was waited for and the ring
    read ("synced"), and keeps the step's time: from the launch's start to the device's
    end on a GPU (its two events), the launch's wall time on the CPU."""
    observe = engine.poller.on_step_time

    def on_step_time(p: int, d: int, s: float) -> None:
        TRACE.mark("synced")
        TRACE.mark("step_s", s)
        observe(p, d, s)

    engine.poller.on_step_time = on_step_time


# ----------------------------------------------------------------------------- client

def _read_response(sock: socket.socket, buf: bytes) -> tuple[float, bytes]:
    """Read one chunked SSE response; (time the first 'data:' arrived, bytes left over)."""
    t_data = 0.0
    while True:
        if not t_data and b"data:" in buf:
            t_data = time.perf_counter()
        if b"\r\n0\r\n\r\n" in buf:
            rest = buf.split(b"\r\n0\r\n\r\n", 1)[1]
            return t_data, rest
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        if not t_data and b"data:" in buf + chunk:
            t_data = time.perf_counter()
        buf += chunk


def client(port: int, n: int, model: str, vocab: int, seed: int) -> list[tuple[float, float]]:
    """n streamed 'Hello'-sized requests, one at a time: (send time, first data time)."""
    rng = random.Random(seed)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out, buf = [], b""
    lo = min(100, vocab // 2)
    for _ in range(n):
        body = json.dumps({"model": model, "prompt": [rng.randrange(lo, vocab) for _ in range(2)],
                           "max_tokens": 1, "stream": True, "ignore_eos": True,
                           "temperature": 0}).encode()
        req = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
        t0 = time.perf_counter()
        sock.sendall(req)
        t_data, buf = _read_response(sock, buf)
        out.append((t0, t_data))
    sock.close()
    return out


# ----------------------------------------------------------------------------- server

def run(a: argparse.Namespace) -> dict:
    instrument()
    from zerod.engine.api.server import ServerThread
    from zerod.engine.config import EngineConfig
    from zerod.engine.core.engine import Engine

    extra = {k: v for k, v in (("max_model_len", a.max_model_len), ("dtype", a.dtype)) if v is not None}
    engine = Engine(EngineConfig(model=a.model, device=a.device, load_format=a.load_format, **extra))
    _on_step_time(engine)
    engine.start()
    srv = ServerThread(engine).start()
    try:
        total = a.warmup + a.n
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--client", str(srv.port), str(total),
             engine.model_name, str(engine.vocab_size)],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"request_path: the client failed: {proc.stderr.strip()[-2000:]}")
        times = json.loads(proc.stdout)
    finally:
        srv.stop()
        engine.shutdown()
    reqs = TRACE.requests
    if len(reqs) != len(times):
        raise SystemExit(f"{len(times)} client requests but {len(reqs)} traced")
    rows = []
    for (t0, t_data), marks in list(zip(times, reqs))[a.warmup:]:
        rows.append({"send": t0, **marks, "client": t_data})
    return summarize(rows, engine.device.type)


def summarize(rows: list[dict], device: str) -> dict:
    us = 1e6
    stages = []
    prev = "send"
    for mark, what in STAGES:
        d = [(r[mark] - r[prev]) * us for r in rows if mark in r and prev in r]
        stages.append({"stage": what, "to": mark, "p50_us": statistics.median(d) if d else None})
        prev = mark
    ttft = [(r["client"] - r["send"]) * us for r in rows]
    step = [r["step_s"] * us for r in rows if "step_s" in r]
    fwd = [(r["forward_end"] - r["forward_start"]) * us for r in rows if "forward_end" in r]
    rest = [(r["client"] - r["send"] - (r["forward_end"] - r["forward_start"])) * us
            for r in rows if "forward_end" in r]
    outside = [(r["client"] - r["send"] - r["step_s"]) * us for r in rows if "step_s" in r]
    # the step's start event is recorded at the launch's start, on an idle device at once:
    # launch + step_s is when the step ended, so this is how late the poller saw it
    late = [(r["synced"] - r["launch"] - r["step_s"]) * us for r in rows if "step_s" in r]
    prep = [(r["prepared"] - r["queued"]) * us for r in rows if "prepared" in r and "queued" in r]
    return {"device": device, "requests": len(rows), "stages": stages,
            "ttft_p50_us": statistics.median(ttft),
            "ttft_without_forward_p50_us": statistics.median(rest) if rest else None,
            "ttft_p90_us": statistics.quantiles(ttft, n=10)[-1] if len(ttft) > 1 else ttft[0],
            "step_s_p50_us": statistics.median(step) if step else None,
            "outside_step_p50_us": statistics.median(outside) if outside else None,
            "poller_late_p50_us": statistics.median(late) if late else None,
            "forward_p50_us": statistics.median(fwd) if fwd else None,
            "prepare_after_queued_p50_us": statistics.median(prep) if prep else None}


def show(s: dict) -> str:
    lines = [f"{s['requests']} requests on {s['device']}; median µs per stage (from the previous mark)",
             f"{'stage':<58} {'p50 µs':>9}"]
    for st in s["stages"]:
        v = st["p50_us"]
        lines.append(f"{st['stage']:<58} {'-' if v is None else f'{v:9.0f}':>9}")
    lines.append(f"{'TTFT (client send -> first SSE data), p50':<58} {s['ttft_p50_us']:9.0f}")
    lines.append(f"{'TTFT p90':<58} {s['ttft_p90_us']:9.0f}")
    if s["forward_p50_us"] is not None:
        lines.append(f"{'model forward, p50 (CPU: runs inline)':<58} {s['forward_p50_us']:9.0f}")
        lines.append(f"{'TTFT less its own forward, p50':<58} {s['ttft_without_forward_p50_us']:9.0f}")
    if s["prepare_after_queued_p50_us"] is not None:
        lines.append(f"{'(side branch) headers sent, after the submit':<58} "
                     f"{s['prepare_after_queued_p50_us']:9.0f}")
    if s["step_s_p50_us"] is not None:
        lines.append(f"{'step: launch start -> device done (events; CPU: launch)':<58} "
                     f"{s['step_s_p50_us']:9.0f}")
        lines.append(f"{'TTFT outside the step (TTFT - the step above), p50':<58} "
                     f"{s['outside_step_p50_us']:9.0f}")
        lines.append(f"{'poller sees the step done after its end (event wake-up)':<58} "
                     f"{s['poller_late_p50_us']:9.0f}")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        port, n, model, vocab = sys.argv[2:6]
        print(json.dumps(client(int(port), int(n), model, int(vocab), seed=1)))
        return
    ap = argparse.ArgumentParser(prog="gpu/request_path.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="model directory, or demo (default)")
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N")
    ap.add_argument("--load-format", default="auto", help="auto or dummy (random weights)")
    ap.add_argument("--dtype", help="as zerod serve's --dtype (default: the model's)")
    ap.add_argument("--max-model-len", type=int, help="as zerod serve's --max-model-len")
    ap.add_argument("-n", type=int, default=300, help="measured requests (default 300)")
    ap.add_argument("--warmup", type=int, default=20, help="requests first, not counted")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args()
    if a.n < 1 or a.warmup < 0:
        ap.error("-n must be >= 1 and --warmup >= 0")
    import logging
    logging.basicConfig(level=logging.WARNING)
    from zerod.engine.config import EngineError
    try:
        s = run(a)
    except (EngineError, ValueError, OSError) as exc:
        sys.exit(f"{ap.prog}: error: {exc}")
    print(show(s))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
