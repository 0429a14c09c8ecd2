"""Where a thread's time goes, from py-spy's raw (collapsed) stacks:

    python3 gpu/pyspy_summary.py STACKS.txt FRAME [TOP]

Only the samples whose stack passes through a frame whose function is FRAME (the step
thread's `_launch`, say) count. Prints their number, then the TOP (20) frames below FRAME
by inclusive share (a frame counted once per sample) and the TOP leaf frames (where the
CPU was: Python, a CUDA driver call, a spin in a synchronize)."""

from __future__ import annotations

import collections
import sys


def frames(line: str) -> tuple[list[str], int]:
    stack, _, count = line.rstrip("\n").rpartition(" ")
    return stack.split(";"), int(count)


def _named(f: str, frame: str) -> bool:
    """py-spy names a frame "Class.function (file:line)"; FRAME may leave the class out."""
    name = f.split(" (")[0].strip()
    return name == frame or name.endswith("." + frame)


def summary(path: str, frame: str, top: int = 20) -> str:
    total = hits = 0
    below: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    for line in open(path, errors="replace"):
        if not line.strip():
            continue
        stack, n = frames(line)
        total += n
        at = next((i for i, f in enumerate(stack) if _named(f, frame)), None)
        if at is None:
            continue
        hits += n
        for f in set(stack[at + 1:]):
            below[f] += n
        leaves[stack[-1]] += n
    out = [f"{hits} of {total} samples pass through {frame}"]
    if hits:
        out.append(f"\nframes below {frame}, inclusive share of those samples:")
        out += [f"  {n / hits:6.1%}  {f[:150]}" for f, n in below.most_common(top)]
        out.append("\nleaf frames (where the CPU was):")
        out += [f"  {n / hits:6.1%}  {f[:150]}" for f, n in leaves.most_common(top)]
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    print(summary(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20))
