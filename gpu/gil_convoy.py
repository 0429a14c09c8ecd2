"""What the GIL does to the step thread's launch while another thread of the engine's
process is busy in Python, on the CPU: `python3 gpu/gil_convoy.py`.

Every torch call releases the GIL and takes it back when it returns. A thread that wants
it back while another thread runs Python waits until that thread gives it up: at its next
blocking call or, at the latest, when the switch interval (sys.setswitchinterval; Python's
default 5 ms) runs out. A step launch is tens of torch calls (a graph replay with its
input copies and sampling) or ~1,000 (an eager forward), so beside a busy HTTP loop (a
200-request burst's parsing) or output poller each call can cost up to an interval.

Here a "step" is N calls of a small in-place torch op on a CPU tensor (a launch's host
side: GIL released and retaken, a few microseconds of work), timed alone and beside a
thread running Python back to back (the loop's work during a burst), at several switch
intervals. Whether the other thread takes the GIL at a given release is a race, so most
steps pass untouched and some wait an interval at call after call: the table gives the
median, the 99th percentile and the worst of STEPS steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch

BODY = json.dumps({"model": "m", "prompt": list(range(24)), "max_tokens": 128, "stream": True,
                   "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}})


def step(x: torch.Tensor, calls: int) -> float:
    """ms for `calls` torch calls."""
    t = time.perf_counter()
    for _ in range(calls):
        x.add_(1)
    return (time.perf_counter() - t) * 1e3


def parse_forever(stop: threading.Event) -> None:
    """Back-to-back Python work, as the HTTP loop while a burst's requests arrive."""
    while not stop.is_set():
        d = json.loads(BODY)
        s = 0
        for v in d["prompt"]:
            s += v


def measure(calls: int, interval_us: int, steps: int) -> tuple[float, list[float]]:
    """(median ms alone, sorted ms of each step beside the busy thread) of a step of
    `calls` calls."""
    sys.setswitchinterval(interval_us / 1e6)
    x = torch.zeros(4096)
    alone = statistics.median(step(x, calls) for _ in range(steps))
    stop = threading.Event()
    busy = threading.Thread(target=parse_forever, args=(stop,), daemon=True)
    busy.start()
    time.sleep(0.02)
    beside = sorted(step(x, calls) for _ in range(steps))
    stop.set()
    busy.join()
    return alone, beside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals-us", default="5000,1000,500,200,100")
    ap.add_argument("--calls", default="30,300")
    ap.add_argument("--steps", type=int, default=400)
    a = ap.parse_args()
    torch.set_num_threads(1)
    default = sys.getswitchinterval()
    rows = []
    for calls in (int(c) for c in a.calls.split(",")):
        for us in (int(u) for u in a.intervals_us.split(",")):
            alone, beside = measure(calls, us, a.steps)
            rows.append((calls, us, alone, beside))
    sys.setswitchinterval(default)
    print(f"| torch calls a step | switch interval | step alone (median) | beside a busy Python thread: "
          f"median / p99 / worst of {a.steps} |")
    print("|---|---|---|---|")
    for calls, us, alone, beside in rows:
        p99 = beside[min(len(beside) - 1, int(0.99 * len(beside)))]
        print(f"| {calls} | {us} us | {alone:.2f} ms | {statistics.median(beside):.2f} / {p99:.1f} / "
              f"{beside[-1]:.1f} ms |")


if __name__ == "__main__":
    main()
