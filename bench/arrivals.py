"""When requests are sent: the gaps between arrivals, as vLLM's benchmark draws them.

A rate of inf sends all at once. Otherwise each gap is drawn from a gamma distribution
of shape `burstiness` and mean 1 / rate: burstiness 1 is a Poisson process, below 1
burstier, above 1 more even.
"""

from __future__ import annotations

import math
import random


def next_gap(rng: random.Random, rate: float, burstiness: float = 1.0) -> float:
    """Seconds to wait before the next request (0 when the rate is infinite)."""
    if not math.isfinite(rate):
        return 0.0
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
