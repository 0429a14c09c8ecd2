"""A support bundle: one .tar.gz with what a support ticket needs, one file per
part named for what it holds, written by `zerod bundle` and by the daemon's
flight recorder on a critical alert.

    facts.json          the doctor's facts snapshot of this host
    doctor.json         doctor's report on those facts
    diag.json           the last `zerod diag` result, when one was kept
    events.json         the event store's last BUNDLE_EVENTS_S (zerod.event_store)
    daemon.json         the running daemon's documents (status, engines, gpus, alerts)
    engine-metrics-NAME.txt  each engine's /metrics: its step statistics and latency histograms
    stacks-NAME.txt     the stacks an EngineStalled dump left
    daemon-log.txt      the daemon's and engines' recent journal (journalctl -u zerod)
    kernel-nvidia.log   the kernel log's NVIDIA lines (NVRM, Xid)
    config.json         the configuration, secrets removed
    manifest.json       when, which host, each part written and each that could not be (and why)

A part that cannot be read never stops the bundle: the manifest says why it is missing.
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import shutil
import socket
import subprocess
import tarfile
import time
import urllib.request
from typing import Any, Callable

from zerod.event_store import EventStore, iso

BUNDLE_EVENTS_S = 7 * 86400.0
DIAG_FILE = "diag.json"  # under state_dir: the last `zerod diag` result
LOG_LINES = 5000
NVIDIA_LINE = re.compile(r"NVRM|Xid|nvidia|NVLink|nvswitch", re.IGNORECASE)
SECRET_KEY = re.compile(r"key|token|secret|passw|credential|auth", re.IGNORECASE)
SECRET_FLAG = re.compile(r"^--?(api[-_]?key|token|password|secret)", re.IGNORECASE)
URL_USERINFO = re.compile(r"(\w+://)[^/@\s]+@")
REDACTED = "<redacted>"


def redact(value: Any, key: str = "") -> Any:
    """The config with every secret replaced: keys that name one, the value after a
    flag that takes one, the user:password part of a URL."""
    if isinstance(value, dict):
        return {k: REDACTED if SECRET_KEY.search(str(k)) and not isinstance(v, (dict, list, bool))
                else redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        out, hide = [], False
        for v in value:
            if hide:
                out.append(REDACTED)
                hide = False
            elif isinstance(v, str) and SECRET_FLAG.match(v):
                if "=" in v:
                    out.append(v.split("=", 1)[0] + "=" + REDACTED)
                else:
                    out.append(v)
                    hide = True
            else:
                out.append(redact(v, key))
        return out
    if isinstance(value, str):
        return URL_USERINFO.sub(lambda m: m.group(1) + REDACTED + "@", value)
    return value


def _run(argv: list[str], timeout: float = 20.0) -> str:
    if shutil.which(argv[0]) is None:
        raise FileNotFoundError(f"{argv[0]} is not installed")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 and not p.stdout:
        raise RuntimeError(f"{' '.join(argv)}: exit {p.returncode}: {p.stderr.strip()[:200]}")
    return p.stdout


def kernel_nvidia_lines() -> str:
    try:
        text = _run(["journalctl", "-k", "-b", "--no-pager", "-o", "short-iso"])
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        text = _run(["dmesg", "-T"])
    return "".join(line + "\n" for line in text.splitlines() if NVIDIA_LINE.search(line))


def _doctor(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    from zerod.checks import DoctorConfig, Roots, probe_facts, run_checks

    cfg = DoctorConfig.from_config(config)
    facts = probe_facts(Roots(), cfg)
    return facts.to_dict(), run_checks(facts, cfg).to_dict()


def _engine_urls(config: dict[str, Any]) -> dict[str, str]:
    from zerod.daemon_config import DaemonConfig
    from zerod.fleet import engine_specs
    from zerod.supervisor import engine_url

    cfg = DaemonConfig.from_dict(config.get("daemon"))
    return {s.name: engine_url(s.flags(), cfg) for s in engine_specs(config, cfg.gpu_index)}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=3.0) as r:  # noqa: S310 - the engines' own loopback URLs
        return r.read().decode(errors="replace")


def _daemon_docs(control_socket: str) -> dict[str, Any]:
    from zerod.tui.client import ControlClient

    client = ControlClient(control_socket, timeout=3.0)
    return {name: client.get(name) for name in ("status", "engines", "gpus", "alerts", "processes")}


def write_bundle(out_path: str, config: dict[str, Any], state_dir: str, control_socket: str | None = None,
                 daemon_docs: Callable[[], dict[str, Any]] | None = None, reason: str = "zerod bundle",
                 clock=time.time) -> dict[str, Any]:
    """Write the bundle; returns its manifest (also inside it)."""
    now = clock()
    parts: dict[str, bytes] = {}
    errors: dict[str, str] = {}

    def part(name: str, build: Callable[[], Any]) -> None:
        try:
            value = build()
        except Exception as exc:  # noqa: BLE001 - a missing part is named, never fatal
            errors[name] = f"{type(exc).__name__}: {exc}"
            return
        if value is None:
            return
        parts[name] = value.encode() if isinstance(value, str) else \
            json.dumps(value, indent=1, default=str).encode()

    doctor: dict[str, Any] = {}

    def facts():
        doctor["facts"], doctor["report"] = _doctor(config)
        return doctor["facts"]

    part("facts.json", facts)
    if "report" in doctor:
        parts["doctor.json"] = json.dumps(doctor["report"], indent=1, default=str).encode()
    else:
        errors["doctor.json"] = "no facts to check (facts.json failed)"
    diag = os.path.join(state_dir, DIAG_FILE)
    if os.path.exists(diag):
        part("diag.json", lambda: open(diag).read())
    part("events.json", lambda: EventStore.for_reading(state_dir).query(since=now - BUNDLE_EVENTS_S))
    if daemon_docs is not None:
        part("daemon.json", daemon_docs)
    elif control_socket:
        part("daemon.json", lambda: _daemon_docs(control_socket))
    try:
        for name, url in _engine_urls(config).items():
            part(f"engine-metrics-{name}.txt", lambda url=url: _get(url + "/metrics"))
    except Exception as exc:  # noqa: BLE001
        errors["engine-metrics"] = f"{type(exc).__name__}: {exc}"
    for path in sorted(glob.glob(os.path.join(state_dir, "stacks-*.txt"))):
        part(os.path.basename(path), lambda path=path: open(path, errors="replace").read()[-200_000:])
    part("daemon-log.txt", lambda: _run(["journalctl", "-u", "zerod", "-n", str(LOG_LINES), "--no-pager",
                                         "-o", "short-iso"]))
    part("kernel-nvidia.log", kernel_nvidia_lines)
    part("config.json", lambda: redact(config))
    manifest = {"created": iso(now), "host": socket.gethostname(), "reason": reason,
                "parts": sorted(parts), "missing": errors}
    parts["manifest.json"] = json.dumps(manifest, indent=1).encode()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".part"
    top = os.path.basename(out_path).removesuffix(".tar.gz").removesuffix(".tgz")
    with tarfile.open(tmp, "w:gz") as tar:
        for name, data in parts.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mtime, info.mode = len(data), int(now), 0o600
            tar.addfile(info, io.BytesIO(data))
    os.chmod(tmp, 0o600)
    os.replace(tmp, out_path)
    return manifest
