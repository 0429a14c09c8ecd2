"""--log-format json and journald's native fields: what an operator's log pipeline reads."""

from __future__ import annotations

import json
import logging
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from zerod.engine import logs

ROOT = Path(__file__).resolve().parent.parent


def _record(msg="hello", level=logging.WARNING, fields=None):
    rec = logging.LogRecord("zerod.alerts", level, __file__, 1, msg, None, None)
    if fields is not None:
        setattr(rec, logs.FIELDS, fields)
    return rec


def _parse_journal(data: bytes) -> dict[str, str]:
    out, i = {}, 0
    while i < len(data):
        nl = data.index(b"\n", i)
        eq = data.find(b"=", i, nl)
        if eq >= 0:
            out[data[i:eq].decode()] = data[eq + 1:nl].decode()
            i = nl + 1
        else:  # binary framing: KEY\n<u64 le length><value>\n
            key = data[i:nl].decode()
            (n,) = struct.unpack("<Q", data[nl + 1:nl + 9])
            out[key] = data[nl + 9:nl + 9 + n].decode()
            i = nl + 9 + n + 1
    return out


def test_json_lines_carry_the_fields():
    line = logs.JsonFormatter().format(_record("disk full", fields={"alert": "X", "gpu": 3}))
    obj = json.loads(line)
    assert obj["message"] == "disk full" and obj["level"] == "warning"
    assert obj["logger"] == "zerod.alerts" and obj["alert"] == "X" and obj["gpu"] == 3
    assert obj["time"].endswith("Z")


def test_journal_native_fields_over_a_socket(tmp_path):
    path = str(tmp_path / "journal.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    handler = logs.JournalHandler("zerod", path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    try:
        handler.emit(_record("two\nlines", logging.CRITICAL,
                             {"alert": "XidError", "label_gpu": "0", "9lives": 1}))
        entry = _parse_journal(server.recv(65536))
    finally:
        handler.close()
        server.close()
    assert entry["MESSAGE"] == "two\nlines"  # the binary framing keeps the newline
    assert entry["PRIORITY"] == "2" and entry["SYSLOG_IDENTIFIER"] == "zerod"
    assert entry["ALERT"] == "XidError" and entry["LABEL_GPU"] == "0"
    assert entry["F9LIVES"] == "1" and entry["LOGGER"] == "zerod.alerts"


def test_journal_unreachable_falls_back_to_priority_prefixed_stderr(tmp_path, capsys):
    handler = logs.JournalHandler("zerod", str(tmp_path / "absent.sock"))
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.fallback.stream = sys.stderr
    handler.emit(_record("still here"))
    handler.close()
    assert "<4>zerod.alerts: still here" in capsys.readouterr().err


def test_alert_log_record_carries_its_labels(caplog):
    from zerod.alerts import AlertBook

    with caplog.at_level(logging.INFO):
        AlertBook().fire("XidError", "0", severity="critical", summary="GPU 0 reported Xid 79",
                         labels={"gpu": 0})
    rec = next(r for r in caplog.records if "XidError" in r.getMessage())
    fields = getattr(rec, logs.FIELDS)
    assert fields["alert"] == "XidError" and fields["label_gpu"] == "0"
    assert fields["state"] == "firing" and fields["severity"] == "critical"


def test_setup_logging_json_writes_one_object_per_record(capsys, monkeypatch):
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup_logging("info", "json")
        logging.getLogger("zerod.access").info("a line", extra={logs.FIELDS: {"status": 200}})
    finally:
        root.handlers[:], root.level = saved
    obj = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert obj["message"] == "a line" and obj["status"] == 200


@pytest.mark.parametrize("bad", ["xml", "JSON "])
def test_bad_log_format_is_named(bad):
    r = subprocess.run([sys.executable, "-m", "zerod", "serve", "demo", "--log-format", bad],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--log-format" in r.stderr
