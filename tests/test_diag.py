"""`zerod diag` on a host without a GPU (this one): every test of the level skipped
with why, in the JSON shape a GPU host gets; the options refused as doctor refuses
them; an engine on a chosen GPU refuses the run unless --force; and the parts that
judge a GPU (the references, the verdicts, the spec table, the counters before and
after) on the CPU, with results made wrong on purpose."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from zerod.checks.facts import Facts
from zerod.checks.gpu_specs import pcie_gb_s, spec_for
from zerod.cmd_diag import EXIT_BUSY, EXIT_UNKNOWN_GPU, diag, parse_gpus
from zerod.diag import busy, judge, nvml_health, verify
from zerod.diag.catalogue import TESTS, for_level
from zerod.diag.runner import peer_expected

ROOT = Path(__file__).resolve().parent.parent
TEST_KEYS = {"id", "title", "severity", "gpu", "peer", "status", "message", "measured", "expected", "evidence",
             "remediation", "duration_s"}


def _config(tmp_path: Path, sock: str | None = None) -> Path:
    cfg = tmp_path / "zerod.toml"
    cfg.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
                   + (f'control_socket = "{sock}"\n' if sock else ""))
    return cfg


@pytest.mark.parametrize("level", ["quick", "full"])
def test_no_gpu_host_skips_every_test_in_the_same_shape(tmp_path, level):
    r = subprocess.run([sys.executable, "-m", "zerod", "diag", "--level", level, "--json",
                        "--config", str(_config(tmp_path))], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert set(report) == {"version", "host", "tests", "summary"}
    assert [t["id"] for t in report["tests"]] == [t.id for t in for_level(level)]
    assert all(set(t) == TEST_KEYS and t["status"] == "skip" and t["message"] for t in report["tests"])
    why = report["tests"][0]["message"]
    assert "no NVIDIA GPU usable here" in why or "CPU-only" in why or "no CUDA device" in why
    assert report["summary"] == {"pass": 0, "warn": 0, "fail": 0, "skip": len(for_level(level)), "error": 0,
                                 "total": len(for_level(level)), "exit_code": 0}
    assert report["host"]["level"] == level and report["host"]["gpus"] == []
    # kept where the config's [daemon] state_dir says, for doctor, top and /metrics
    assert json.loads((tmp_path / "state" / "diag.json").read_text()) == report


def test_full_adds_the_memory_and_stress_tests():
    quick, full = {t.id for t in for_level("quick")}, {t.id for t in for_level("full")}
    assert full - quick == {"diag.memory_pattern", "diag.gemm_stress"} and quick < full
    assert len({t.id for t in TESTS}) == len(TESTS)


def test_human_output_and_bad_options(tmp_path):
    runner = CliRunner()
    r = runner.invoke(diag, ["--config", str(_config(tmp_path))])
    assert r.exit_code == 0 and "skip diag.gemm_bf16" in r.output and "-> exit 0" in r.output
    r = runner.invoke(diag, ["--gpus", "1-0"])
    assert r.exit_code == 2 and "'1-0' is not a GPU index or a range" in r.output
    r = runner.invoke(diag, ["--level", "slow"])
    assert r.exit_code == 2 and "'slow' is not one of 'quick', 'full'" in r.output
    assert parse_gpus("0,2-3") == [0, 2, 3] and parse_gpus(None) is None and parse_gpus("all") is None


def _two_gpus() -> Facts:
    f = Facts()
    f.put("nvml", {"count": 2}, "test")
    f.put("nvml.gpus", [{"index": 0, "name": "NVIDIA H200"}, {"index": 1, "name": "NVIDIA H200"}], "test")
    return f


class _FakeDaemon:
    """/v1/engines on a Unix socket, as `zerod run` answers it."""

    def __init__(self, path: str, engines: list[dict]) -> None:
        body = json.dumps({"engines": engines}).encode()

        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        class UnixServer(HTTPServer):
            address_family = socket.AF_UNIX

            def server_bind(self):
                self.socket.bind(self.server_address)

            def get_request(self):
                conn, _ = self.socket.accept()
                return conn, ("local", 0)

        self.server = UnixServer(path, H, bind_and_activate=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_refuses_a_gpu_an_engine_serves_on_unless_forced(tmp_path, monkeypatch):
    sock = str(tmp_path / "control.sock")
    fake = _FakeDaemon(sock, [{"name": "llama", "gpus": [1], "state": "healthy", "pid": 4242, "model": "llama-8b"},
                              {"name": "idle", "gpus": [0], "state": "stopped", "pid": None, "model": "x"}])
    monkeypatch.setattr(nvml_health, "read_nvml", _two_gpus)
    ran = []
    monkeypatch.setattr("zerod.diag.runner.run_diag", lambda level, gpus, progress: ran.append(gpus) or {
        "version": "t", "host": {}, "tests": [], "summary": {"exit_code": 0}})
    try:
        runner = CliRunner()
        cfg = str(_config(tmp_path, sock))
        r = runner.invoke(diag, ["--config", cfg])
        assert r.exit_code == EXIT_BUSY, r.output
        assert "refusing: engine llama (llama-8b, healthy, pid 4242) serves on GPU 1" in r.output
        assert "--force" in r.output and ran == []
        r = runner.invoke(diag, ["--config", cfg, "--gpus", "0", "--json"])  # the stopped engine's GPU
        assert r.exit_code == 0 and ran == [[0]]
        r = runner.invoke(diag, ["--config", cfg, "--gpus", "1", "--force", "--json"])
        assert r.exit_code == 0 and ran == [[0], [1]]
        r = runner.invoke(diag, ["--config", cfg, "--gpus", "0,7"])
        assert r.exit_code == EXIT_UNKNOWN_GPU and "no GPU 7 on this host; GPUs: 0, 1" in r.output
    finally:
        fake.close()
    engines, why = busy.engines_from_daemon(sock, timeout=0.5)
    assert engines == [] and "no daemon answers" in why


# -- the references: a right product passes, a wrong one fails ---------------------------------

def _product(n: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g).to(torch.bfloat16)
    b = torch.randn(n, n, generator=g).to(torch.bfloat16)
    return a, b, (a.float() @ b.float()).to(torch.bfloat16)


def test_gemm_reference_accepts_bf16_rounding():
    a, b, c = _product()
    assert verify.gemm_residual(torch, a, b, c) < 1.0
    assert verify.gemm_tile_error(torch, a, b, c) < 1.0


@pytest.mark.parametrize("row,col", [(5, 9), (200, 250)])
def test_gemm_reference_catches_one_wrong_element(row, col):
    a, b, c = _product()
    bad = c.clone()
    bad[row, col] = -bad[row, col] * 4 + 8  # a flipped sign and a wrong exponent, as a bad SM returns
    assert verify.gemm_residual(torch, a, b, bad) > 1.0  # anywhere in the matrix (Freivalds)
    assert (verify.gemm_tile_error(torch, a, b, bad) > 1.0) == (row < verify.TILE and col < verify.TILE)


def test_fp8_operands_go_through_the_same_reference():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(128, 128, generator=g).to(torch.float8_e4m3fn)
    bt = torch.randn(128, 128, generator=g).to(torch.float8_e4m3fn)
    c = (a.float() @ bt.float().t()).to(torch.bfloat16)
    assert verify.gemm_residual(torch, a, bt.t(), c) < 1.0
    c[7, 7] += 1000
    assert verify.gemm_residual(torch, a, bt.t(), c) > 1.0


def test_copy_pattern_counts_every_wrong_word(monkeypatch):
    monkeypatch.setattr(verify, "STEP", 1000)  # several slices over a small buffer
    buf = torch.empty(4321, dtype=torch.int32)
    verify.fill_pattern(torch, buf, seed=5)
    assert verify.pattern_mismatches(torch, buf, seed=5) == 0
    assert verify.pattern_mismatches(torch, buf, seed=6) > 4000  # another seed: another pattern
    buf[17] ^= 1
    buf[3000] = 0
    assert verify.pattern_mismatches(torch, buf, seed=5) == 2


# -- verdicts, the spec table, the counters ------------------------------------------------------

def test_verdict_against_the_spec():
    assert judge.verdict(4000, 4800) == "pass"
    assert judge.verdict(2400, 4800) == "warn"
    assert judge.verdict(1000, 4800) == "fail"
    assert judge.verdict(5.0, None) == "pass"
    assert "83 % of the spec 4,800 GB/s" in judge.describe("copy", 4000, 4800, "GB/s")


def test_spec_table_by_nvml_name():
    assert spec_for("NVIDIA H200").model == "H200 SXM"
    assert spec_for("NVIDIA H100 PCIe").model == "H100 PCIe"
    assert spec_for("NVIDIA H100 80GB HBM3").model == "H100 SXM"
    assert spec_for("NVIDIA A100-SXM4-80GB").fp8_tflops is None
    assert spec_for("NVIDIA L40S").fp8_tflops == 733
    assert spec_for("NVIDIA L4").model == "L4" and spec_for("NVIDIA L40").model == "L40"
    assert spec_for("Tesla T4") is None and spec_for(None) is None
    assert pcie_gb_s(5, 16) == pytest.approx(63.0, abs=0.1) and pcie_gb_s(None, 16) is None


def test_peer_expectation_nvlink_else_pcie():
    h200 = spec_for("NVIDIA H200")
    g0 = {"index": 0, "pcie_gen_max": 5, "pcie_width_max": 16}
    g1 = {"index": 1, "pcie_gen_max": 4, "pcie_width_max": 16}
    assert peer_expected(g0, g1, h200, lambda i: 18) == (450.0, "18 NVLinks x 25 GB/s")
    rate, basis = peer_expected(g0, g1, h200, lambda i: 0)
    assert rate == pytest.approx(31.5, abs=0.1) and basis.startswith("PCIe")


def _counters(**gpu0) -> dict:
    base = {"bus_id": "0000:19:00.0", "ecc_uncorrected_volatile": 0,
            "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": 0, "failure": 0},
            "retired_pending": 0, "clock_events": ["gpu_idle"]}
    return {"gpus": {0: {**base, **gpu0}}, "xids": [], "xid_error": None}


def test_health_counters_before_and_after():
    before = _counters()
    assert nvml_health.judge(0, before, _counters())[0] == "pass"
    status, msg, _ = nvml_health.judge(0, before, _counters(ecc_uncorrected_volatile=2))
    assert status == "fail" and "uncorrectable ECC errors rose 0 -> 2" in msg
    pending = {"correctable": 0, "uncorrectable": 1, "pending": 1, "failure": 0}
    status, msg, _ = nvml_health.judge(0, before, _counters(remapped_rows=pending))
    assert status == "fail" and "pending" in msg
    after = _counters()
    after["xids"] = [{"t_s": 5.0, "pci": "0000:19:00", "xid": 48, "text": "DBE"},
                     {"t_s": 6.0, "pci": "0000:3b:00", "xid": 13, "text": "another GPU"}]
    status, msg, _ = nvml_health.judge(0, before, after)
    assert status == "fail" and "Xid 48 (double-bit ECC error)" in msg and "Xid 13" not in msg
    status, msg, _ = nvml_health.judge(0, before, _counters(clock_events=["hw_thermal_slowdown"]))
    assert status == "warn" and "hw_thermal_slowdown" in msg
    assert nvml_health.judge(1, before, _counters())[0] == "error"


# -- the run's order of work, with stand-ins for torch and the GPU tests --------------------------

def _fake_torch(n_gpus: int):
    import types

    cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: n_gpus,
                                 get_device_name=lambda i: "NVIDIA H200", empty_cache=lambda: None)
    return types.SimpleNamespace(cuda=cuda, version=types.SimpleNamespace(cuda="12.8"), __version__="2.13.0+cu128")


def test_run_order_context_failure_errors_pairs_and_counters(monkeypatch):
    from zerod.diag import gpu_tests as T
    from zerod.diag import runner
    from zerod.diag.report import DiagResult, Figure

    monkeypatch.setattr(nvml_health, "read_nvml", _two_gpus)
    snaps = iter([_counters(), _counters(ecc_uncorrected_volatile=1)])
    monkeypatch.setattr(nvml_health, "snapshot", lambda facts=None, roots=None: {
        **(s := next(snaps)), "gpus": {0: s["gpus"][0], 1: s["gpus"][0]}})
    monkeypatch.setattr(runner, "_nvlink_links", lambda gpu: 18)
    calls = []

    def ok(test_id):
        def fn(torch, gpu, *rest):
            calls.append((test_id, gpu))
            return DiagResult(test_id, "pass", gpu, message="fine", measured=Figure(1.0, "x"))
        return fn

    monkeypatch.setattr(T, "cuda_context", lambda torch, gpu: DiagResult(
        "diag.cuda_context", "pass" if gpu == 0 else "fail", gpu, message="ctx"))
    monkeypatch.setattr(T, "hbm_bandwidth", ok("diag.hbm_bandwidth"))
    monkeypatch.setattr(T, "gemm_bf16", lambda *a: 1 / 0)  # a test that raises
    monkeypatch.setattr(T, "gemm_fp8", ok("diag.gemm_fp8"))
    monkeypatch.setattr(T, "pcie", lambda torch, gpu, g, sizes, d: ok(f"diag.pcie_{d}")(torch, gpu))
    monkeypatch.setattr(T, "memory_pattern", ok("diag.memory_pattern"))
    monkeypatch.setattr(T, "gemm_stress", ok("diag.gemm_stress"))
    peers = []
    monkeypatch.setattr(T, "p2p", lambda torch, s, d, expected, basis, sizes: peers.append((s, d, expected, basis))
                        or DiagResult("diag.p2p_bandwidth", "pass", s, d, message="fine"))
    report = runner.run_diag("full", torch_loader=lambda: _fake_torch(2))
    rows = [(t["id"], t["gpu"], t["peer"], t["status"]) for t in report["tests"]]
    # GPU 1's context failed: its other tests are skipped, not run
    assert ("diag.cuda_context", 1, None, "fail") in rows
    assert all(g == 0 for _, g in calls)
    assert ("diag.hbm_bandwidth", 1, None, "skip") in rows and ("diag.gemm_stress", 1, None, "skip") in rows
    # the test that raised is that test's error, the ones after it still ran
    [bf16] = [t for t in report["tests"] if t["id"] == "diag.gemm_bf16" and t["gpu"] == 0]
    assert bf16["status"] == "error" and "ZeroDivisionError" in bf16["message"] and bf16["remediation"]
    assert ("diag.gemm_stress", 0) in calls
    # both directions of the pair, against 18 NVLinks
    assert [(s, d) for s, d, _, _ in peers] == [(0, 1), (1, 0)] and peers[0][2] == 450.0
    # the counters rose during the run: both GPUs fail diag.health_counters
    assert [r for r in rows if r[0] == "diag.health_counters"] == [
        ("diag.health_counters", 0, None, "fail"), ("diag.health_counters", 1, None, "fail")]
    # the report lists tests in catalogue order, GPU by GPU
    order = [t.id for t in TESTS]
    assert [order.index(r[0]) for r in rows] == sorted(order.index(r[0]) for r in rows)
    assert report["summary"]["exit_code"] == 2
    assert [g["spec"]["model"] for g in report["host"]["gpus"]] == ["H200 SXM", "H200 SXM"]


def test_text_report_shows_figures_and_fixes():
    from zerod.diag.render import render
    from zerod.diag.report import DiagResult, Figure, make_report

    report = make_report([
        DiagResult("diag.hbm_bandwidth", "warn", 0, message="copy: 2,400.0 GB/s, 50 % of the spec 4,800 GB/s",
                   measured=Figure(2400.0, "GB/s"), expected=Figure(4800, "GB/s")),
        DiagResult("diag.p2p_bandwidth", "pass", 0, 1, message="GPU 0 -> GPU 1: 390.0 GB/s")],
        {"level": "quick", "hostname": "h", "time": "t", "duration_s": 12.0,
         "gpus": [{"index": 0, "name": "NVIDIA H200", "spec": {"model": "H200 SXM"}}]})
    text = render(report)
    assert "GPU 0: NVIDIA H200 (spec figures: H200 SXM)" in text
    assert "WARN diag.hbm_bandwidth" in text and "50 % of the spec" in text
    assert "gpu 0->1" in text and "fix: look at `zerod doctor`" in text
    assert text.splitlines()[-1] == "2 tests: 1 ok, 1 warn, 0 fail, 0 skipped, 0 errors -> exit 1"
    assert all(len(line) <= 80 for line in text.splitlines()[1:]), text
