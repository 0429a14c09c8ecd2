"""gpu/schedule_sim.py: the engine's scheduler against a model of the H200's step times.
The model's figures are predictions; what is checked here is that it drives the real
scheduler to the end of a scenario, leaves the scheduler module as it found it, and
refuses a variant it does not know."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "gpu"))

import schedule_sim as sim  # noqa: E402
from zerod.engine.core import scheduler as scheduler_mod  # noqa: E402


def test_every_request_of_a_wave_gets_its_tokens_whatever_the_lag():
    """The step loop forms a batch `lag` steps before the device runs it (the steps in
    flight): later or sooner, every request gets its first token and all its gaps."""
    arrivals = sim.traffic("burst200", seed=0)
    for name in ("current", "batch-before-slot", "no-lag", "one-forward"):
        run = sim.simulate(arrivals, sim.variant(name))
        assert len(run["first"]) == len(arrivals) == 200, name
        # 128 tokens each: the first, then 127 gaps
        assert all(len(g) == 127 for g in run["gaps"].values()) and len(run["gaps"]) == 200, name
        got = sim.summary("burst200", run)
        assert 0 < got["ttft_p50"] <= got["ttft_p99"], name
    assert sim.variant("batch-before-slot").lag == 5 and sim.variant("current").lag is None
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


def _trace(truth, one_forward: bool, record_rows: bool) -> list[dict]:
    """A trace written from known costs, with the header and fields ZEROD_STEP_TRACE
    writes: two forwards a mixed step, rows padded as the runner pads them, or one
    forward, with the rows each step's forwards ran recorded."""
    import random

    tuning = sim.Tuning(one_forward_mixed_steps=one_forward)
    rng = random.Random(1)
    graphs = sim.Graphs(tuning, 2048, 17408, 256)
    lines = [{"trace": "zerod-steps", "model": "m", "page_size": 16, "max_num_batched_tokens": 2048,
              "max_num_seqs": 256, "max_model_len": 17408,
              "tuning": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(tuning).items()}}]
    for i in range(300):
        chunks = rng.choice([0, 0, 1, 2, 5])
        tokens = sum(rng.randint(16, 700) for _ in range(chunks))
        decodes = rng.choice([0, 1, 7, 40, 130]) if chunks else rng.choice([1, 7, 40, 130])
        context = decodes * rng.randint(50, 3000)
        pairs = tokens * rng.randint(0, 2000) + tokens * tokens // (2 * max(chunks, 1))
        if one_forward and chunks and decodes:     # the decodes are the prefill forward's last rows
            rows, dec = graphs.prompt_rows(tokens + decodes, chunks) + rng.choice([0, 16]), 0
            device = (truth.weights_s + truth.per_row_s * rows + truth.decode_attn_s
                      + truth.per_ctx_token_s * context + truth.per_pair_s * pairs)
        else:
            rows = graphs.prompt_rows(tokens, chunks) if chunks else 0
            dec = graphs.decode_rows(decodes) if decodes else 0
            device = truth.step(rows, pairs, dec, context)
        line = {"at": i * 0.02, "chunks": chunks, "prompt_tokens": tokens, "pairs": pairs,
                "decodes": decodes, "context": context, "launch_ms": 1.0, "device_ms": device * 1000}
        if record_rows:
            line["rows"] = [rows, dec]
        lines.append(line)
    return lines


@pytest.mark.parametrize("one_forward", [False, True], ids=["two-forwards-padded", "one-forward-recorded"])
def test_fit_recovers_the_step_costs_of_a_trace(tmp_path, one_forward):
    """The fit gives the costs a trace was written from back, and the tool says so in one
    line: an older trace of two forwards a step through the runner's padding, and a trace
    of one forward a step through the rows it records."""
    import json

    truth = sim.Cost(weights_s=4e-3, per_row_s=20e-6, decode_attn_s=0.3e-3, per_ctx_token_s=0.05e-6,
                     per_pair_s=1e-9)
    lines = _trace(truth, one_forward, record_rows=one_forward)
    path = tmp_path / "steps.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cost, err, n = sim.fit_cost(str(path))
    assert n == 300 and err < 0.01
    for f in ("weights_s", "per_row_s", "decode_attn_s", "per_ctx_token_s", "per_pair_s"):
        assert abs(getattr(cost, f) - getattr(truth, f)) <= 0.05 * getattr(truth, f), f
    r = subprocess.run([sys.executable, "gpu/schedule_sim.py", "--fit", str(path), "--scenarios", "mix10",
                        "--seeds", "1", "--variants", "current"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "step costs fitted to 300 steps" in r.stdout and "mix10" in r.stdout
    bad = tmp_path / "not.jsonl"
    bad.write_text('{"at": 1}\n')
    r = subprocess.run([sys.executable, "gpu/schedule_sim.py", "--fit", str(bad)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a ZEROD_STEP_TRACE file" in r.stderr and "Traceback" not in r.stderr
    if one_forward:   # one forward a step without the rows: the fit cannot pad them, and says so
        old = tmp_path / "old.jsonl"
        old.write_text("".join(json.dumps({k: v for k, v in x.items() if k != "rows"}) + "\n"
                               for x in lines))
        r = subprocess.run([sys.executable, "gpu/schedule_sim.py", "--fit", str(old)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "without its forwards' rows" in r.stderr and "Traceback" not in r.stderr
