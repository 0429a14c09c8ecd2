"""The event store and its commands: alert transitions and daemon events kept in
SQLite, retention by age and size, `zerod events` filters and JSON with no daemon
running, `zerod bundle`'s parts with the secrets removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from zerod.alerts import AlertBook
from zerod.bundle import REDACTED, redact
from zerod.cmd_events import parse_since
from zerod.daemon_config import DaemonConfig
from zerod.event_store import EventStore, store_path
from zerod.flight_recorder import FlightRecorder

ROOT = Path(__file__).resolve().parent.parent


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _recorder(tmp_path, clock, **daemon) -> tuple[AlertBook, FlightRecorder]:
    book = AlertBook(clock=clock)
    cfg = DaemonConfig.from_dict({"state_dir": str(tmp_path), "bundle_on_critical": False, **daemon})
    return book, FlightRecorder(cfg, {}, book, clock=clock)


def test_every_alert_transition_and_lifecycle_event_is_kept(tmp_path):
    clock = Clock()
    book, rec = _recorder(tmp_path, clock)
    rec.lifecycle("DaemonStarted", "started", "zerod run started")
    clock.t += 5
    book.fire("EngineStalled", "a", severity="critical", summary="engine a stalled", labels={"engine": "a", "pid": 7})
    # the same summary again: no transition
    book.fire("EngineStalled", "a", severity="critical", summary="engine a stalled", labels={"engine": "a"})
    clock.t += 5
    book.fire("GpuHot", "0", severity="warning", summary="GPU 0 at 90 C", labels={"gpu": 0})
    clock.t += 5
    book.resolve("EngineStalled", "a")
    rec.close()
    rows = EventStore.for_reading(str(tmp_path)).query()
    assert [(r["alertname"], r["state"], r["severity"]) for r in rows] == [
        ("DaemonStarted", "started", "info"), ("EngineStalled", "firing", "critical"),
        ("GpuHot", "firing", "warning"), ("EngineStalled", "resolved", "critical")]
    assert rows[1]["labels"] == {"engine": "a", "pid": "7", "id": "EngineStalled/a"} and rows[1]["engine"] == "a"
    assert rows[1]["time"] == "2027-01-15T08:00:05Z" and rows[0]["kind"] == "daemon"
    store = EventStore.for_reading(str(tmp_path))
    assert [r["alertname"] for r in store.query(engine="a")] == ["EngineStalled", "EngineStalled"]
    assert [r["alertname"] for r in store.query(severities=("warning",))] == ["GpuHot"]
    assert [r["alertname"] for r in store.query(since=clock.t - 6)] == ["GpuHot", "EngineStalled"]


def test_retention_by_age_and_by_size(tmp_path):
    clock = Clock()
    store = EventStore(store_path(str(tmp_path)), max_age_s=3600, max_bytes=256 << 10, clock=clock)
    for i in range(10):
        store.record("alert", "Old", "firing", "info", f"old {i}", t=clock.t - 7200)
    store.record("alert", "New", "firing", "info", "new")
    assert store.prune() == 10 and [r["alertname"] for r in store.query()] == ["New"]
    for i in range(3000):  # ~1 KiB each: well over 256 KiB
        store.record("alert", "Big", "firing", "info", "x" * 1000, t=clock.t + i)
    store.prune()
    size = os.path.getsize(store.path)
    rows = store.query()
    assert size <= (256 << 10) * 1.5 and 0 < len(rows) < 3000
    assert rows[-1]["t"] == clock.t + 2999  # the oldest go first


def test_since_takes_durations_and_times():
    assert parse_since("2h", now=10_000.0) == 10_000.0 - 7200
    assert parse_since("90s", now=100.0) == 10.0
    assert parse_since("2026-12-03T02:00:00Z") == 1796263200.0
    import click
    with pytest.raises(click.BadParameter):
        parse_since("yesterday")


def _zerod(*args, env=None):
    return subprocess.run([sys.executable, "-m", "zerod", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **(env or {})})


def test_zerod_events_reads_the_store_with_the_daemon_down(tmp_path):
    clock = Clock(__import__("time").time() - 600)
    book, rec = _recorder(tmp_path, clock)
    book.fire("CanaryMismatch", severity="critical", summary="answers changed", labels={"gpu": 0})
    clock.t += 300
    rec.lifecycle("DaemonStopped", "stopped", "zerod run stopped")
    rec.close()
    cfg = tmp_path / "zerod.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{tmp_path}"\n')
    r = _zerod("events", "--config", str(cfg), "--since", "2h", "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [(e["alertname"], e["state"], e["severity"]) for e in got] == [
        ("CanaryMismatch", "firing", "critical"), ("DaemonStopped", "stopped", "info")]
    assert set(got[0]) >= {"alertname", "state", "severity", "time", "labels"} and got[0]["labels"]["gpu"] == "0"
    r = _zerod("events", "--config", str(cfg), "--severity", "critical")
    assert r.returncode == 0 and "CanaryMismatch" in r.stdout and "DaemonStopped" not in r.stdout
    r = _zerod("events", "--config", str(cfg), "--severity", "fatal")
    assert r.returncode == 2 and "'fatal': must be one of critical, warning, info" in r.stderr
    assert "Traceback" not in r.stderr
    empty = tmp_path / "none.toml"
    empty.write_text(f'[daemon]\nstate_dir = "{tmp_path / "nowhere"}"\n')
    r = _zerod("events", "--config", str(empty))
    assert r.returncode == 1 and "no event store at" in r.stderr and "Traceback" not in r.stderr


def test_secrets_never_reach_a_bundle():
    config = {"engine": {"api_key": "sk-1", "model": "/m"},
              "daemon": {"engine_command": ["vllm", "serve", "--api-key", "sk-2", "--token=sk-3"],
                         "engine_env": {"HF_TOKEN": "hf-4", "CUDA_VISIBLE_DEVICES": "0"}},
              "alerts": {"alertmanager_url": "https://user:pw-5@am:9093"}}
    text = json.dumps(redact(config))
    assert not any(s in text for s in ("sk-1", "sk-2", "sk-3", "hf-4", "pw-5"))
    assert '"/m"' in text and "CUDA_VISIBLE_DEVICES" in text and text.count(REDACTED) == 5


def test_zerod_bundle_writes_its_parts(tmp_path):
    clock = Clock(__import__("time").time())
    book, rec = _recorder(tmp_path, clock)
    book.fire("EngineStalled", severity="critical", summary="stalled")
    rec.close()
    (tmp_path / "diag.json").write_text('{"tests": []}')
    cfg = tmp_path / "zerod.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{tmp_path}"\ncontrol_socket = "{tmp_path}/no.sock"\n'
                   f'[engine]\napi_key = "sk-secret"\nport = 1\n')
    out = tmp_path / "b.tar.gz"
    r = _zerod("bundle", "--config", str(cfg), "-o", str(out))
    assert r.returncode == 0, r.stderr
    with tarfile.open(out) as tar:
        names = {m.name.split("/", 1)[1]: m for m in tar.getmembers()}
        for part in ("facts.json", "doctor.json", "diag.json", "events.json", "config.json", "manifest.json"):
            assert part in names, (part, sorted(names))
        read = lambda n: tar.extractfile(names[n]).read().decode()  # noqa: E731
        assert [e["alertname"] for e in json.loads(read("events.json"))] == ["EngineStalled"]
        assert "sk-secret" not in read("config.json")
        assert "checks" in json.loads(read("doctor.json"))
        manifest = json.loads(read("manifest.json"))
        assert "daemon.json" in manifest["missing"]  # no daemon on that socket: said, not fatal
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    r = _zerod("bundle", "--config", str(cfg), "-o", str(tmp_path / "b.zip"))
    assert r.returncode == 2 and "name it FILE.tar.gz" in r.stderr


def test_the_flight_recorder_writes_one_bundle_per_alert_name_per_interval(tmp_path):
    clock = Clock(__import__("time").time())
    book = AlertBook(clock=clock)
    cfg = DaemonConfig.from_dict({"state_dir": str(tmp_path), "bundle_min_interval_s": 600, "bundles_kept": 1})
    rec = FlightRecorder(cfg, {}, book, clock=clock)
    book.fire("NvmlUnavailable", severity="critical", summary="no NVML")  # at start
    rec.wait()
    book.fire("GpuHot", "0", severity="warning", summary="hot")  # not critical: no bundle
    clock.t += 5
    book.fire("EngineStalled", severity="critical", summary="stalled")  # its own allowance
    rec.wait()
    clock.t += 5
    book.resolve("EngineStalled")
    book.fire("EngineStalled", severity="critical", summary="stalled again")  # within 600 s: none
    rec.wait()
    assert [p.rsplit("-", 1)[1] for p in rec.bundles_written] == ["NvmlUnavailable.tar.gz", "EngineStalled.tar.gz"]
    kept = sorted(p.name for p in (tmp_path / "bundles").iterdir())
    assert len(kept) == 1 and kept[0].endswith("EngineStalled.tar.gz")  # bundles_kept
    rec.close()
    assert "BundleWritten" in [e["alertname"] for e in EventStore.for_reading(str(tmp_path)).query()]
