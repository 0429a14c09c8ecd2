"""deploy/grafana/zerod.json: a well-formed dashboard, and every metric its queries use is
one that `zerod run --demo` exports - the daemon's /metrics and the engine's, scraped from
a real demo daemon (metric names are a contract: a renamed metric breaks this test)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from test_checks_helpers import REPO

DASHBOARD = REPO / "deploy" / "grafana" / "zerod.json"
METRIC = re.compile(r"\bzerod_[a-z0-9_]+\b")
# The series a family of each type exposes (prometheus_client; OpenMetrics adds _created).
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "info": ("_info",), "summary": ("_sum", "_count", "_created"), "untyped": ("",)}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(d: dict) -> list[str]:
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def used_metrics(d: dict) -> set[str]:
    return {m for e in queries(d) for m in METRIC.findall(e)}


def exposed(text: str) -> set[str]:
    """Every series name a scrape of `text` can hold: the samples, and for each # TYPE
    the names its type exposes (a labelled family has no sample until it is used)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            if kind == "counter":  # the text format names a counter's family with its _total
                name = name.removesuffix("_total")
            names |= {name + s for s in SUFFIXES.get(kind, ("",))}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_dashboard_is_well_formed():
    d = dashboard()
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    names = {v["name"] for v in d["templating"]["list"]}
    assert {"datasource", "host"} <= names
    for e in queries(d):
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        assert 'instance=~"$host:.*"' in e, e  # every panel follows the host picker
    # the daemon and the engine both appear
    used = used_metrics(d)
    assert any(m.startswith("zerod_gpu_") for m in used)
    assert "zerod_engine_inter_token_latency_seconds_bucket" in used


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


@pytest.mark.slow
def test_every_metric_the_dashboard_uses_is_exported_by_the_demo_daemon():
    d = tempfile.mkdtemp(prefix="zgf")
    port = _free_port()
    cfg = os.path.join(d, "zerod.toml")
    with open(cfg, "w") as f:
        f.write(f"[engine]\nport = {port}\n")
    log_path = os.path.join(d, "daemon.log")
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "zerod", "run", "--demo", "--config", cfg,
                             "--metrics-port", "0", "--control-socket", os.path.join(d, "control.sock")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        end, daemon_url, text = time.monotonic() + 90, None, ""
        while True:
            log.seek(0)
            out = log.read()
            m = re.search(r"metrics on (http://\S+)", out)
            daemon_url = m.group(1) if m else None
            try:
                engine = _get(f"http://127.0.0.1:{port}/metrics")
                text = _get(daemon_url) if daemon_url else ""
                if "zerod_engine_up 1.0" in text:
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.monotonic() < end, f"the demo daemon did not come up:\n{out[-3000:]}"
            time.sleep(0.3)
        names = exposed(text) | exposed(engine)
        missing = sorted(used_metrics(dashboard()) - names)
        assert not missing, f"the dashboard queries metrics nobody exports: {missing}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


@pytest.mark.skipif(not __import__("shutil").which("promtool"), reason="promtool is not installed")
def test_every_query_is_valid_promql(tmp_path):
    """promtool parses each query as a recording rule, Grafana's variables filled in."""
    import yaml

    rules = [{"record": f"zerod:dashboard_query:{i}",
              "expr": e.replace("$__rate_interval", "1m").replace("$host", "node1")}
             for i, e in enumerate(queries(dashboard()))]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
