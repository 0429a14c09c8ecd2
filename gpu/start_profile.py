"""Sums py-spy's collapsed stacks (`-f raw`) of a start: seconds per thread, then the
functions with the most time beneath them (inclusive) and on top (self), per thread.

    python3 gpu/start_profile.py restart.folded [--top 40] [--rate 100]
"""

from __future__ import annotations

import argparse
import collections
import re


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folded")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--rate", type=float, default=100.0)
    a = ap.parse_args()
    threads: collections.Counter = collections.Counter()
    names: dict[str, str] = {}
    incl: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    self_: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in open(a.folded):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not stack or not n.isdigit():
            continue
        head, *frames = stack.split(";")
        tid, _, name = head.partition(": ")   # "thread (123): name"; the name once it has one
        if name:
            names[tid] = name
        frames = [re.sub(r":\d+\)$", ")", f) for f in frames] or ["(idle)"]   # a function, not a line
        n = int(n)
        threads[tid] += n
        for f in set(frames):
            incl[tid][f] += n
        self_[tid][frames[-1]] += n
    s = lambda n: n / a.rate  # noqa: E731
    for thread, n in threads.most_common():
        print(f"\n== {thread} {names.get(thread, '')}: {s(n):.1f} s")
        print("  inclusive:")
        for f, m in incl[thread].most_common(a.top):
            print(f"    {s(m):7.2f} s  {f[:160]}")
        print("  self:")
        for f, m in self_[thread].most_common(15):
            print(f"    {s(m):7.2f} s  {f[:160]}")


if __name__ == "__main__":
    main()
