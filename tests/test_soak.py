"""A bounded soak of the real `zerod serve` (demo model, CPU): valid, invalid and
disconnecting clients at once; afterwards the server's RSS, fds, threads and KV pages are
back where they were, nothing answered 5xx, and a plain request still works.

CI runs it for 20 s; `ZEROD_SOAK_SECONDS=600 pytest tests/test_soak.py -s` runs it longer.
The figures it prints are recorded in docs/engine-server.md ("Soak").
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil
import pytest

pytestmark = pytest.mark.slow

SOAK_SECONDS = float(os.environ.get("ZEROD_SOAK_SECONDS", "20"))
CLIENTS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(port: int, method: str, path: str, body: bytes | None = None,
             headers: dict | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _health(port: int) -> dict:
    status, body = _request(port, "GET", "/health", timeout=10)
    return json.loads(body)


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    # stderr to a file: the access log writes a line per request, and a pipe nobody
    # reads during the soak would fill and block the server
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerod", "serve", "--model", "demo", "--device", "cpu",
         "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "16"],
        stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"zerod serve exited: {log.read().decode()[-2000:]}")
        try:
            if _health(port).get("status") == "ok":
                break
        except (OSError, ValueError):
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("zerod serve did not become healthy in 120 s")
    yield port, proc
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _valid(port: int, rng: random.Random) -> int:
    body = {"model": "demo", "prompt": "soak " * rng.randrange(1, 40),
            "max_tokens": rng.randrange(1, 24), "temperature": rng.choice([0, 0.7])}
    status, _ = _request(port, "POST", "/v1/completions", json.dumps(body).encode())
    return status


def _stream_to_end(port: int, rng: random.Random) -> int:
    body = {"model": "demo", "messages": [{"role": "user", "content": "hi " * rng.randrange(1, 20)}],
            "max_tokens": rng.randrange(1, 24), "stream": True}
    status, data = _request(port, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status != 200 or data.rstrip().endswith(b"data: [DONE]")
    return status


_INVALID = [
    b"{not json",
    json.dumps({"model": "demo", "prompt": "x", "top_k": 2 ** 63}).encode(),
    json.dumps({"model": "demo", "prompt": "x", "min_tokens": 2 ** 63, "max_tokens": 4}).encode(),
    json.dumps({"model": "demo", "prompt": "x", "max_tokens": 10 ** 9}).encode(),
    json.dumps({"model": "demo", "prompt": "x", "temperature": "hot"}).encode(),
    json.dumps({"model": "demo", "prompt": [10 ** 12]}).encode(),
    b"[" * 100_000 + b"]" * 100_000,
]


def _invalid(port: int, rng: random.Random) -> int:
    status, body = _request(port, "POST", "/v1/completions", rng.choice(_INVALID))
    assert 400 <= status < 500, (status, body[:300])
    assert "error" in json.loads(body)
    return status


def _disconnect_mid_stream(port: int, rng: random.Random) -> int:
    body = json.dumps({"model": "demo", "prompt": "bye " * 10, "max_tokens": 200,
                       "stream": True, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        s.recv(rng.choice([1, 64, 512]))
    return 0


def _half_open(port: int, rng: random.Random) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(rng.choice([b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                              b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"]))
    return 0


CLIENT_KINDS = [_valid, _stream_to_end, _invalid, _disconnect_mid_stream, _half_open]


def _resources(proc: subprocess.Popen) -> dict:
    p = psutil.Process(proc.pid)
    return {"rss_mb": p.memory_info().rss / 2 ** 20, "fds": p.num_fds(), "threads": p.num_threads()}


def _settle(port: int, limit: float = 30.0) -> dict:
    """Wait until nothing runs or waits and every KV page is free again."""
    deadline = time.monotonic() + limit
    while True:
        h = _health(port)
        idle = h.get("running") == 0 and h.get("waiting") == 0 and h.get("kv_pages_free") == h.get("kv_pages_total")
        if idle or time.monotonic() > deadline:
            return h
        time.sleep(0.2)


def test_soak_mixed_clients_leave_nothing_behind(server):
    port, proc = server
    # warm-up: every kind of client once, so lazily built state is in the baseline
    rng = random.Random(0)
    for kind in CLIENT_KINDS:
        kind(port, rng)
    _settle(port)
    time.sleep(1.0)
    before = _resources(proc)

    counts: dict[str, int] = {}
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + SOAK_SECONDS

    def client(seed: int) -> None:
        r = random.Random(seed)
        while time.monotonic() < stop_at:
            kind = r.choice(CLIENT_KINDS)
            try:
                status = kind(port, r)
                if status >= 500:
                    raise AssertionError(f"{kind.__name__} answered {status}")
            except (AssertionError, ValueError, http.client.HTTPException) as exc:
                with lock:
                    errors.append(f"{kind.__name__}: {exc}")
            except OSError:
                pass            # our own disconnects and half-open sockets
            with lock:
                counts[kind.__name__] = counts.get(kind.__name__, 0) + 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    # meanwhile /health must keep answering fast
    worst_health = 0.0
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        _health(port)
        worst_health = max(worst_health, time.monotonic() - t0)
        time.sleep(0.5)
    for t in threads:
        t.join()

    h = _settle(port)
    time.sleep(1.0)
    after = _resources(proc)
    print(f"\nsoak {SOAK_SECONDS:.0f}s, {CLIENTS} clients: {counts}")
    print(f"before {before}\nafter  {after}\nworst /health {worst_health * 1000:.0f} ms")

    assert not errors, errors[:5]
    assert proc.poll() is None
    assert h["status"] == "ok"
    assert h["kv_pages_free"] == h["kv_pages_total"]
    assert h["running"] == 0 and h["waiting"] == 0
    assert after["fds"] <= before["fds"] + 4
    assert after["threads"] <= before["threads"] + 2
    assert after["rss_mb"] <= before["rss_mb"] * 1.15 + 32
    assert worst_health < 2.0
    assert _valid(port, random.Random(1)) == 200
