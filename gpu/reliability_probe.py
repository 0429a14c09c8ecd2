"""Issue 36's hostile requests against `zerod serve` on the GPU, with /health timed throughout.

    python3 gpu/reliability_probe.py [--shape 8b|tiny] [--device cuda|cpu] [--out DIR]

Starts `zerod serve` on a dummy-weight model (gpu/server_make_model.py), polls /health every
10 ms from a thread of its own, and in turn sends: the issue's request (2,000 prompt ids,
prompt_logprobs 20, n 64: must be a 400 naming MAX_PROMPT_LOGPROB_ENTRIES at once); four
at once of the largest prompt-logprobs request the bound allows (3,000 ids x 21 entries);
and non-streamed n=32 answers with 20 top logprobs over 512 tokens. Each phase reports its
status codes, its time and the slowest /health answer (the issue's bound: 100 ms), and
the engine's RSS. Results: OUT/reliability.json and a table on stdout; exit 1 when a
/health answer took more than 100 ms or a status was not the expected one.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEALTH_BUDGET_S = 0.1


def _post(url: str, body: dict, timeout: float = 600) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class HealthClock(threading.Thread):
    """GET /health every 10 ms; the slowest answer since the last `take()`."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.worst, self.stop = url + "/health", 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                urllib.request.urlopen(self.url, timeout=30).read()
            except OSError:
                pass
            self.worst = max(self.worst, time.perf_counter() - t0)
            time.sleep(0.01)

    def take(self) -> float:
        w, self.worst = self.worst, 0.0
        return w


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/zerod-reliability"))
    a = ap.parse_args()
    model = f"/tmp/zerod-dummy-{a.shape}"
    subprocess.run([sys.executable, str(ROOT / "gpu/server_make_model.py"), model, "--shape", a.shape],
                   check=True, stdout=subprocess.DEVNULL)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    srv = subprocess.Popen([sys.executable, "-m", "zerod", "serve", "--model", model, "--load-format",
                            "dummy", "--dtype", dtype, "--device", a.device, "--max-model-len", "4096",
                            "--port", str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    rows, ok = [], True
    try:
        health = {}
        for _ in range(600):
            try:
                health = json.loads(urllib.request.urlopen(url + "/health", timeout=2).read())
                break
            except OSError:
                time.sleep(1)
        vocab = int(health.get("vocab_size", 1024))
        clock = HealthClock(url)
        clock.start()
        ids = lambda n: [(7 * i) % (vocab - 200) + 100 for i in range(n)]  # noqa: E731
        phases = [
            ("issue request: 2000 ids, prompt_logprobs 20, n 64", 1, 400,
             {"prompt": ids(2000), "prompt_logprobs": 20, "n": 64, "max_tokens": 1}),
            ("4 x 3000 ids, prompt_logprobs 20 (the bound)", 4, 200,
             {"prompt": ids(3000), "prompt_logprobs": 20, "max_tokens": 1}),
            ("2 x n 32, logprobs 20, 512 tokens", 2, 200,
             {"prompt": ids(64), "n": 32, "logprobs": 20, "max_tokens": 512, "ignore_eos": True}),
        ]
        clock.take()
        for name, copies, want, body in phases:
            t0 = time.perf_counter()
            with ThreadPoolExecutor(copies) as pool:
                got = list(pool.map(lambda _: _post(url + "/v1/completions", body), range(copies)))
            took = time.perf_counter() - t0
            worst = clock.take()
            codes = [c for c, _ in got]
            size = max(len(b) for _, b in got)
            good = all(c == want for c in codes) and worst <= HEALTH_BUDGET_S
            ok &= good
            rows.append({"phase": name, "codes": codes, "expected": want, "seconds": round(took, 3),
                         "answer_bytes": size, "health_worst_ms": round(worst * 1000, 1),
                         "engine_rss_mib": round(_rss_mib(srv.pid)), "ok": good})
        clock.stop.set()
    finally:
        srv.terminate()
        srv.wait(60)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "reliability.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{'phase':52} {'codes':>10} {'s':>7} {'bytes':>11} {'/health worst ms':>17} {'RSS MiB':>8}")
    for r in rows:
        print(f"{r['phase']:52} {','.join(map(str, sorted(set(r['codes'])))):>10} {r['seconds']:7.2f} "
              f"{r['answer_bytes']:11d} {r['health_worst_ms']:17.1f} {r['engine_rss_mib']:8d}"
              f"{'' if r['ok'] else '  FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
