"""Shared test setup.

GPU tests carry `@pytest.mark.gpu` and are skipped where CUDA is not available
(CI has no GPU); they run on the device H200 (see gpu/).

Slow tests are marked `slow` here, by module, so that `scripts/test -m "not slow"`
is a fast subset (under a minute on a 2-core machine); CI (`.ci/run`) runs them all.
These modules start real servers, daemons, Alertmanager, Textual apps, transformers
or Triton's interpreter, and each took seconds in `pytest --durations=0`; a new test
of that kind belongs in one of them, or on this list.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# what zerod keeps on disk (doctor's last report, diag's result, the daemon's events and
# bundles; zerod.checks.state_dir) goes to a directory of this run, never the user's or /var/lib
os.environ.setdefault("ZEROD_STATE_DIR", tempfile.mkdtemp(prefix="zerod-state-"))

SLOW_MODULES = {
    "test_alerts.py",  # a real Alertmanager
    "test_daemon_faults.py",  # demo engines with ZEROD_FAULT: stalled and restarted, weights perturbed
    "test_daemon_fleet.py",  # two daemons' engines started, one killed and restarted alone
    "test_daemon_foreign.py",  # a daemon and a foreign GPU holder, alerted within 2 s
    "test_daemon_lifecycle.py",  # daemons started, crashed, hung and stopped
    "test_daemon_liveness.py",  # engines that stall and stop, judged over 10-15 s each
    "test_engine_agreement.py",  # transformers as the reference
    "test_engine_process.py",  # `zerod serve --engine-process` subprocesses, killed and stopped
    "test_engine_tp.py",  # tensor-parallel ranks as processes (gloo), `zerod serve -tp 2`
    "test_families_gpu.py",  # every family against transformers, batched and alone (CPU variants)
    "test_fp8_checkpoints.py",  # FP8 checkpoints against transformers with W8A8 emulated
    "test_fp8_kernels.py",  # Triton's interpreter on the FP8 kernels
    "test_fp8_kv_and_config.py",  # engines with FP8 KV pages, teacher-forced
    "test_kernels_interpreter.py",  # Triton's CPU interpreter, one subprocess per group
    "test_lora_engine.py",  # transformers + peft as the reference
    "test_openai_server.py",  # the demo engine in-process and in a process of its own
    "test_lora_server.py",  # servers with adapters loaded and unloaded under load
    "test_lora_kernels.py",  # the LoRA kernels in Triton's interpreter
    "test_server_cli.py",  # `zerod serve` subprocesses, SIGTERM drains
    "test_tui_app.py",  # Textual Pilot sessions
    "test_tui_processes.py",  # Textual Pilot sessions (sort, filter, tree)
    "test_tui_once.py",  # fake daemons and the host read twice, half a second apart
    "test_tui_real_daemon.py",  # the dashboard on a real daemon
    "test_tui_snapshots.py",  # SVG snapshots
}


def start_engine(kind: str, config):
    """A started engine of `kind`: "in-process" (Engine) or "engine-process" (EngineClient,
    the engine in a process of its own, as `zerod serve --engine-process` runs it)."""
    if kind == "engine-process":
        from zerod.engine.process.client import EngineClient

        return EngineClient(config)
    from zerod.engine.core.engine import Engine

    eng = Engine(config)
    eng.start()
    return eng


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        if Path(str(item.fspath)).name in SLOW_MODULES:
            item.add_marker(slow)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs on the device H200, see gpu/)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
