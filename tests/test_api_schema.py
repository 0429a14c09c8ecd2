"""GET /openapi.json: generated from the tables that validate requests, and held to by
the running demo server under schemathesis (no 5xx; statuses, content types, headers and
bodies as documented; schema-breaking requests refused)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from test_server_fake import FakeEngine
from zerod.engine.api.server import ServerThread

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance,negative_data_rejection,"
          "unsupported_method,allow_header_conformance")


def test_openapi_request_schemas_are_the_validation_tables():
    eng = FakeEngine()
    srv = ServerThread(eng).start()
    try:
        doc = json.load(urllib.request.urlopen(srv.url + "/openapi.json", timeout=10))
        assert doc["openapi"].startswith("3.1")
        schemas = doc["components"]["schemas"]
        assert schemas["CompletionRequest"] == srv.server.schemas.completion.schema()
        assert schemas["ChatCompletionRequest"] == srv.server.schemas.chat.schema()
        props = schemas["CompletionRequest"]["properties"]
        # this engine's bounds: vocabulary 1000, max_model_len 256
        assert props["top_k"]["anyOf"][0]["maximum"] == 1000
        assert props["max_tokens"]["anyOf"][0]["maximum"] == 256
        assert props["prompt"]["anyOf"][1]["items"]["maximum"] == 999
        assert props["n"]["anyOf"][0]["maximum"] == 128   # MAX_CHOICES
        assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                     "/health", "/metrics", "/openapi.json", "/tokenize",
                                     "/detokenize", "/version"}
    finally:
        srv.stop()
        eng.shutdown()


@pytest.fixture(scope="module")
def demo_server():
    p = subprocess.Popen([sys.executable, "-m", "zerod", "serve", "--model", "demo",
                          "--device", "cpu", "--port", "0", "--max-model-len", "512",
                          "--kv-pages", "512"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        url, lines = None, []
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"ready on (http://\S+)", line)
            url = m.group(1) if m else None
        assert url, "".join(lines)
        threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
        yield url
    finally:
        p.terminate()
        p.wait(30)


@pytest.mark.slow
def test_schemathesis_against_the_demo_server(demo_server, tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([str(Path(sys.executable).with_name("schemathesis")), "run",
                        demo_server + "/openapi.json", "--checks", CHECKS, "--seed", "0",
                        "--max-examples", "30", "--workers", "1", "--no-shrink",
                        # a valid request may be long: n=105 chat choices to max_model_len on
                        # the CPU take more than schemathesis's default 10 s
                        "--request-timeout", "60"],
                       cwd=tmp_path,  # its cache directory lands there
                       capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "passed" in r.stdout
    assert time.monotonic() - t0 < 120
