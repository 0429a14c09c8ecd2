"""Multi-LoRA over HTTP: the openai client picks an adapter by `model`; /v1/models lists
adapters under their base; load / unload at runtime (only with --allow-runtime-lora)
under load lose no request; what cannot be served is refused naming it; the CLI takes
vLLM's --lora-modules forms."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
import urllib.error
import urllib.request

import pytest

from families_support import hf_greedy, prompts
from lora_support import base_and_adapters, make_adapter
from conftest import start_engine
from zerod.engine.config import EngineConfig
from zerod.engine.api.server import ServerThread

openai = pytest.importorskip("openai")
NEW = 8


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def live(tmp_path_factory, request):
    d = tmp_path_factory.mktemp("lora-srv")
    base, paths, models = base_and_adapters(d)
    ps = prompts(300)[:4]
    want = {name: hf_greedy(m, ps, NEW) for name, m in models.items()}
    eng = start_engine(request.param, EngineConfig(
        model=str(base), served_model_name="base", block_size=4, kv_pages=800, enable_lora=True,
        max_loras=2, max_lora_rank=16, lora_modules=(("all8", str(paths["all8"]), None),
                                                     ("qv4", str(paths["qv4"]), "base"))))
    srv = ServerThread(eng, allow_runtime_lora=True).start()
    yield srv, eng, d, base, paths, ps, want
    srv.stop()
    eng.shutdown(0)


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def complete(c, model: str, prompt: list[int], n: int = NEW) -> tuple[str, int]:
    """The greedy completion's text and its token count."""
    r = c.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                             extra_body={"ignore_eos": True})
    return r.choices[0].text, r.usage.completion_tokens


def text(eng, ids: list[int]) -> tuple[str, int]:
    return eng.tokenizer.decode(ids), len(ids)


def test_openai_client_picks_the_adapter_by_model(live):
    srv, eng, d, base, paths, ps, want = live
    c = client(srv)
    for model, key in (("base", None), ("all8", "all8"), ("qv4", "qv4")):
        assert complete(c, model, ps[0]) == text(eng, want[key][0]), model
    chat = c.chat.completions.create(model="qv4", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=3)
    assert chat.model == "qv4" and chat.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError) as e:
        complete(c, "nope", ps[0])
    assert e.value.body["code"] == "model_not_found"


def test_models_lists_adapters_under_their_base(live):
    srv = live[0]
    data = {m.id: m for m in client(srv).models.list().data}
    assert set(data) == {"base", "all8", "qv4"}
    assert data["base"].parent is None
    assert data["all8"].parent == "base" and data["qv4"].parent == "base"
    assert data["all8"].root.endswith("all8")
    # the answer is what the server's own /openapi.json says it is (adapters have a parent)
    import jsonschema
    with urllib.request.urlopen(srv.url + "/openapi.json", timeout=10) as r:
        schema = json.load(r)["components"]["schemas"]["ModelList"]
    with urllib.request.urlopen(srv.url + "/v1/models", timeout=10) as r:
        jsonschema.validate(json.load(r), schema)


def test_refusals_name_what_is_unsupported(live):
    srv, eng, d, base, paths, ps, want = live
    url = srv.url + "/v1/load_lora_adapter"
    make_adapter(base, d / "dora", 5, r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    make_adapter(base, d / "big", 6, r=32, lora_alpha=8, target_modules=["q_proj"])
    make_adapter(base, d / "emb", 7, r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"])
    for name, needle in (("dora", "DoRA"), ("big", "rank 32 is above --max-lora-rank 16"),
                         ("emb", "embed")):
        status, body = post(url, {"lora_name": name, "lora_path": str(d / name)})
        assert status == 400 and needle in json.loads(body)["error"]["message"], body
    status, body = post(url, {"lora_name": "x", "lora_path": str(d / "missing")})
    assert status == 400 and "is not a directory" in body
    status, body = post(url, {"lora_name": "all8", "lora_path": str(paths["all8"])})
    assert status == 400 and "already been loaded" in body
    status, body = post(url, {"lora_name": 3})
    assert status == 400 and "lora_name" in body
    status, body = post(url, {"lora_name": "x", "lora_path": str(d), "load_inplace": True})
    assert status == 400 and json.loads(body)["error"]["param"] == "load_inplace", body
    with urllib.request.urlopen(srv.url + "/openapi.json", timeout=10) as r:
        paths = json.load(r)["paths"]
    assert paths["/v1/load_lora_adapter"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]["required"] == ["lora_name", "lora_path"]
    assert "/v1/unload_lora_adapter" in paths
    status, body = post(srv.url + "/v1/unload_lora_adapter", {"lora_name": "never"})
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"


def test_runtime_endpoints_need_the_flag(live):
    eng = live[1]
    other = ServerThread(eng).start()
    try:
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"}),
                           ("/v1/unload_lora_adapter", {"lora_name": "all8"})):
            status, text = post(other.url + path, body)
            assert status == 404 and "--allow-runtime-lora" in json.loads(text)["error"]["message"]
        with urllib.request.urlopen(other.url + "/openapi.json", timeout=10) as r:
            assert "/v1/load_lora_adapter" not in json.load(r)["paths"]
        assert any(a.name == "all8" for a in eng.lora_adapters())
    finally:
        other.stop()


def test_load_and_unload_under_load_lose_no_request(live):
    """Streams on all8, qv4 and the base run while mlp16 is loaded, used and unloaded, and
    qv4 is unloaded with its requests in flight: every accepted request ends with all its
    tokens, the right ones; only requests sent after an unload get 404."""
    srv, eng, d, base, paths, ps, want = live
    c = client(srv)
    long_n = 48

    def run(model, i):
        return model, i, complete(c, model, ps[i], long_n)

    with cf.ThreadPoolExecutor(32) as pool:
        futs = [pool.submit(run, m, i) for m in ("all8", "qv4", "base") for i in range(4) for _ in range(2)]
        deadline = time.monotonic() + 30
        while _in_engine(srv) < len(futs) and time.monotonic() < deadline:
            time.sleep(0.005)   # every request accepted before anything changes
        assert post(srv.url + "/v1/load_lora_adapter",
                    {"lora_name": "mlp16", "lora_path": str(paths["mlp16"])})[0] == 200
        futs += [pool.submit(run, "mlp16", i) for i in range(4)]
        assert post(srv.url + "/v1/unload_lora_adapter", {"lora_name": "qv4"})[0] == 200
        results = [f.result(timeout=120) for f in futs]
    assert all(n == long_n for _, _, (_, n) in results)
    with pytest.raises(openai.NotFoundError):
        complete(c, "qv4", ps[0])
    # qv4 back under its name; each output then equals the same request run alone
    assert post(srv.url + "/v1/load_lora_adapter",
                {"lora_name": "qv4", "lora_path": str(paths["qv4"])})[0] == 200
    for model, i, got in results:
        assert got == complete(c, model, ps[i], long_n), (model, i)
    assert post(srv.url + "/v1/unload_lora_adapter", {"lora_name": "mlp16"})[0] == 200
    metrics = urllib.request.urlopen(srv.url + "/metrics").read().decode()
    assert 'zerod_engine_lora_requests_total{lora_name="mlp16"} 8.0' in metrics
    deadline = time.monotonic() + 5   # an engine in its own process reports 4 times a second
    while (eng.stats().running or _in_engine(srv)) and time.monotonic() < deadline:
        time.sleep(0.05)
    st = eng.stats()
    assert st.running == 0 and st.kv_pages_free == st.kv_pages_total


def _in_engine(srv) -> int:
    """The engine's running and waiting requests, as /metrics reads them now."""
    text = urllib.request.urlopen(srv.url + "/metrics", timeout=10).read().decode()
    return sum(int(float(v)) for v in re.findall(
        r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M))


def test_cli_takes_vllms_lora_module_forms():
    import click

    from zerod.engine.cli import serve

    ctx = serve.make_context("serve", [
        "--model", "demo", "--enable-lora", "--lora-modules", "a=/p/a",
        '{"name": "b", "path": "/p/b", "base_model_name": "m"}', "--max-loras", "4",
        "--lora-modules", "c=/p/c"])
    assert ctx.params["lora_modules"] == (("a", "/p/a", None), ("b", "/p/b", "m"), ("c", "/p/c", None))
    assert ctx.params["max_loras"] == 4
    for bad, needle in ((["--lora-modules", "nopath"], "name=path"),
                        (["--lora-modules", '{"name": "x"}'], '"path"'),
                        (["--lora-modules"], "requires an argument"),
                        (["--max-lora-rank", "0"], "0")):
        with pytest.raises(click.UsageError) as e:
            serve.make_context("serve", ["--model", "demo", "--enable-lora", *bad])
        assert needle in e.value.format_message(), e.value.format_message()
