"""The warm-up covers what serving reaches: after READY, a workload of mixed prompt
lengths, LoRA adapters, sampling features and every structured-output kind builds no
kernel and imports no module (engine/core/first_use.py counts both). It runs in a fresh
interpreter, so modules other tests imported cannot hide a lazy import. On the CPU the
kernels are torch's (nothing to build) and the lazy imports are the real risk; the GPU
variant counts Triton's builds too."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lora_support import ADAPTERS, base_checkpoint, make_adapter

REPO = Path(__file__).resolve().parent.parent

WORKLOAD = textwrap.dedent("""
    import json, sys, threading
    from pathlib import Path
    from zerod.engine.core.engine import Engine, EngineConfig
    from zerod.engine.core.first_use import FIRST_USES
    from zerod.engine.core.request import SamplingParams
    from zerod.engine.api.server import ServerThread
    import urllib.request

    base, adapter, device = sys.argv[1], sys.argv[2], sys.argv[3]
    eng = Engine(EngineConfig(model=base, device=device, max_model_len=1024, max_num_batched_tokens=64,
                              max_prefill_tokens_idle=128, kv_pages=None if device != "cpu" else 1024,
                              max_num_seqs=16, enable_lora=True, max_loras=2, max_lora_rank=16,
                              lora_modules=(("a1", adapter, None),)))
    eng.start()
    srv = ServerThread(eng).start()
    built_at_ready = FIRST_USES.kernels_built

    def post(path, body):
        req = urllib.request.Request(srv.url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()

    words = "the quick brown fox jumps over a lazy dog and then some more words follow".split()
    jobs = []
    for i, n in enumerate((1, 3, 9, 17, 30, 45, 60)):
        prompt = " ".join(words[(i + j) % len(words)] for j in range(n))
        for model in ("base" , "a1"):
            jobs.append(("/v1/completions", {"model": eng.model_name if model == "base" else "a1",
                         "prompt": prompt, "max_tokens": 8, "temperature": 0.7, "top_p": 0.9,
                         "top_k": 5, "seed": i, "logprobs": 2, "presence_penalty": 0.5,
                         "ignore_eos": True}))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    jobs += [("/v1/chat/completions", {"model": eng.model_name, "max_tokens": 12,
              "messages": [{"role": "user", "content": "give json"}],
              "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
             ("/v1/completions", {"model": eng.model_name, "prompt": "pick", "max_tokens": 4,
              "structured_outputs": {"regex": "[a-c]+"}}),
             ("/v1/completions", {"model": eng.model_name, "prompt": "pick", "max_tokens": 4,
              "structured_outputs": {"choice": ["yes", "no"]}}),
             ("/v1/completions", {"model": eng.model_name, "prompt": "hello", "max_tokens": 4,
              "prompt_logprobs": 1}), ("/v1/completions", {"model": "a1", "prompt": "hello", "max_tokens": 4, "stream": True})]
    statuses, errors = [], []

    def run(job):
        try:
            statuses.append(post(*job)[0])
        except Exception as exc:
            errors.append(f"{job[0]} {exc} {getattr(exc, 'read', lambda: b'')()[:300]!r}")

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads: t.start()
    for t in threads: t.join()
    print(json.dumps({"statuses": statuses, "errors": errors,
                      "kernels_built": FIRST_USES.kernels_built - built_at_ready,
                      "last_kernel": FIRST_USES.last_kernel,
                      "imported": FIRST_USES.imported_since_ready()}))
    srv.stop(); eng.shutdown(0)
""")


def _run(tmp_path: Path, device: str) -> dict:
    base = base_checkpoint(tmp_path / "base")
    adapter = tmp_path / "a1"
    make_adapter(base, adapter, seed=3, **ADAPTERS["all8"])
    p = subprocess.run([sys.executable, "-c", WORKLOAD, str(base), str(adapter), device],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _check(res: dict, n_jobs: int = 19) -> None:
    assert not res["errors"], res["errors"]
    assert res["statuses"] == [200] * n_jobs
    assert res["imported"] == [], f"modules imported after READY: {res['imported']}"
    assert res["kernels_built"] == 0, f"kernels built after READY: {res['kernels_built']} ({res['last_kernel']})"


def test_nothing_is_imported_or_built_after_ready_on_the_cpu(tmp_path):
    _check(_run(tmp_path, "cpu"))


@pytest.mark.gpu
def test_nothing_is_imported_or_built_after_ready_on_the_gpu(tmp_path):
    _check(_run(tmp_path, "cuda"))


def test_the_warmup_ladder_crosses_every_power_of_two_and_every_sdpa_bucket():
    from zerod.engine.model.decoder import sdpa_length
    from zerod.engine.runner.warmup import sdpa_buckets, token_ladder

    ladder = token_ladder(2048)
    assert ladder[:3] == [1, 2, 3] and ladder[-1] == 2048
    for p in (16, 32, 64, 128, 256, 512, 1024, 2048):   # both sides of each tile threshold
        assert p in ladder and (p == 2048 or p + 1 in ladder)
    buckets = sdpa_buckets(1024, 16384)
    assert {sdpa_length(n) for n in range(1025, 16385)} == set(buckets)
    assert len(buckets) <= 33


def test_every_range_of_a_tuned_table_gets_a_warm_count():
    """A tuned table's config serves the counts up to its measured one (the skinny GEMMs',
    the MoE tiles'): the warm-up adds the top of each range the ladder does not reach, so
    no count a step can have selects a config nobody compiled."""
    from zerod.engine.runner.warmup import token_ladder, unreached

    ladder = token_ladder(2048)
    tops = {1, 8, 16, 64, 96, 112, 128, 200, 224, 256, 2048}
    extra = unreached(ladder, tops)
    assert extra == [112, 224]
    warm = set(ladder) | set(extra)
    prev = 0
    for t in sorted(tops):
        assert any(prev < n <= t for n in warm), t
        prev = t
    assert unreached(ladder, set()) == []


def test_tuning_comes_from_zerod_tuning_and_refuses_unknown_fields():
    from zerod.engine.tuning import Tuning

    assert Tuning.from_env({}) == Tuning()
    t = Tuning.from_env({"ZEROD_TUNING": '{"sdpa_flash_max_len": 0, "prefill_graph_tokens": [16, 32]}'})
    assert t.sdpa_flash_max_len == 0 and t.prefill_graph_tokens == (16, 32)
    with pytest.raises(ValueError, match="unknown field.*sdpa_flash_max"):
        Tuning.from_env({"ZEROD_TUNING": '{"sdpa_flash_max": 0}'})
    with pytest.raises(ValueError, match="not JSON"):
        Tuning.from_env({"ZEROD_TUNING": "{oops"})
    # a number field takes an integer as the number it is
    assert Tuning.from_env({"ZEROD_TUNING": '{"long_prompt_slack": 0}'}).long_prompt_slack == 0.0


@pytest.mark.parametrize("given, field", [('{"prefill_graph_tokens": [16, 1.5]}', "prefill_graph_tokens"),
                                          ('{"prefill_graph_tokens": "16"}', "prefill_graph_tokens"),
                                          ('{"one_forward_mixed_steps": "yes"}', "one_forward_mixed_steps"),
                                          ('{"prefill_graph_seqs": 0}', "prefill_graph_seqs"),
                                          ('{"sdpa_flash_max_len": true}', "sdpa_flash_max_len"),
                                          ('{"long_prompt_slack": -0.5}', "long_prompt_slack"),
                                          ('{"long_prompt_slack": NaN}', "long_prompt_slack"),
                                          ('{"long_prompt_slack": false}', "long_prompt_slack"),
                                          ('{"decode_graphs_by_cost": 1.5}', "decode_graphs_by_cost")])
def test_a_tuning_value_of_the_wrong_type_is_refused_not_coerced(given, field):
    from zerod.engine.tuning import Tuning

    with pytest.raises(ValueError, match=f"ZEROD_TUNING: {field} must be"):
        Tuning.from_env({"ZEROD_TUNING": given})


def test_the_device_side_is_built_on_the_thread_that_runs_the_steps(tmp_path, monkeypatch):
    """cuDNN keeps attention plans and cuBLAS its handles per thread: a warm-up on any other
    thread than the step thread would leave the first request to build them again."""
    import threading

    from zerod.engine.core.engine import Engine, EngineConfig
    from zerod.engine.core.request import SamplingParams
    from zerod.engine.runner.model_runner import ModelRunner

    seen: dict[str, set[int]] = {"build": set(), "step": set()}
    for name, kind in (("capture_graphs", "build"), ("prefill_logits", "step"), ("decode_logits", "step")):
        real = getattr(ModelRunner, name)

        def spy(self, *a, _real=real, _kind=kind, **k):
            seen[_kind].add(threading.get_ident())
            return _real(self, *a, **k)
        monkeypatch.setattr(ModelRunner, name, spy)
    eng = Engine(EngineConfig(model=str(base_checkpoint(tmp_path / "base")), device="cpu", kv_pages=256,
                              max_model_len=256))
    eng.start()
    done = threading.Event()
    eng.submit([1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True),
               lambda out: out.finished and done.set())
    assert done.wait(60)
    eng.shutdown(0)
    assert len(seen["build"]) == 1 and seen["step"] == seen["build"] != {threading.get_ident()}


def test_an_engine_never_started_lets_its_step_thread_go(tmp_path):
    from zerod.engine.core.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model=str(base_checkpoint(tmp_path / "base")), device="cpu", kv_pages=64,
                              max_model_len=128))
    eng.shutdown(0)
    assert not eng._loop.is_alive()
