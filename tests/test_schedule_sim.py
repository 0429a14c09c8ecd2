"""gpu/schedule_sim.py: the engine's scheduler against a model of the H200's step times.
The model's figures are predictions; what is checked here is that it drives the real
scheduler to the end of a scenario, leaves the scheduler module as it found it, and
refuses a variant it does not know."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "gpu"))

import schedule_sim as sim  # noqa: E402
from zerod.engine.core import scheduler as scheduler_mod  # noqa: E402


def test_every_request_of_a_wave_gets_its_tokens_and_one_forward_is_never_slower():
    arrivals = sim.traffic("burst200", seed=0)
    now = sim.simulate(arrivals, sim.variant("current"))
    fused = sim.simulate(arrivals, sim.variant("one-forward"))
    assert len(now["first"]) == len(arrivals) == 200
    # 128 tokens each: the first, then 127 gaps
    assert all(len(g) == 127 for g in now["gaps"].values()) and len(now["gaps"]) == 200
    a, b = sim.summary("burst200", now), sim.summary("burst200", fused)
    assert 0 < a["ttft_p50"] <= a["ttft_p99"]
    assert b["ttft_p99"] <= a["ttft_p99"] and b["itl_p50"] <= a["itl_p50"]
    assert scheduler_mod.time is time          # the simulated clock is gone again


def test_the_16k_prompt_beside_streams_is_chunked_within_the_itl_target():
    got = sim.summary("streams16k", sim.simulate(sim.traffic("streams16k", 0), sim.variant("current")))
    # its ~16K tokens cannot go in one 50 ms step beside the streams: several chunks
    assert got["prompt_ttft_ms"] > 300 and got["streams_max_gap_ms"] < 100


def test_an_unknown_variant_is_refused_in_one_line():
    r = subprocess.run([sys.executable, "gpu/schedule_sim.py", "--variants", "current+fast"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "unknown variant 'fast'" in r.stderr and "Traceback" not in r.stderr
