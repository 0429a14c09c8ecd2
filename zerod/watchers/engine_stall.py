"""`EngineStalled`: an engine that answers /health but produces nothing.

From the engine's own metrics (zerod.watchers.engine_metrics, under the daemon's
names, so vLLM and SGLang are judged the same way): requests running and the
generated-token counter flat for `[daemon] stall_after_s` -> a critical alert
with the evidence, taken before anything is touched:

- every thread's Python stack: SIGUSR2 to a zerod engine, which appends them to
  its ZEROD_STACK_FILE (zerod.engine.core.stack_dump); `py-spy dump` for another
  engine when py-spy is installed;
- the engine's /health answer: its step count and the last step's shape;
- what its GPUs were doing (the NVML watcher's last poll).

Then, with `stall_restart` (the default), the supervisor restarts the engine.
The alert resolves once tokens flow again or nothing is running.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from typing import Any, Callable

import psutil

from zerod.alerts import AlertBook
from zerod.daemon_config import DaemonConfig
from zerod.engine import metrics as names
from zerod.engine.core.stack_dump import SIGNAL as STACK_SIGNAL
from zerod.registry import AlertRule, owns
from zerod.watchers import Watcher
from zerod.watchers.engine_metrics import EngineMetricsWatcher

STACK_WAIT_S = 2.0
PY_SPY_TIMEOUT_S = 5.0  # the watch loop counts as stuck after 10 s
STACK_MAX_CHARS = 16000
STEP_LOOP_FRAME = "_loop_body"  # zerod.engine.core.engine: the step thread's loop


def stack_file(state_dir: str, engine: str) -> str:
    """Where a zerod engine appends its stacks on SIGUSR2 (its ZEROD_STACK_FILE)."""
    return os.path.join(state_dir, f"stacks-{engine}.txt")


def step_thread_stack(dump: str) -> str | None:
    """The one thread of a faulthandler dump that runs the step loop."""
    blocks = dump.split("\n\n")
    for b in blocks:
        if STEP_LOOP_FRAME in b:
            return b.strip()
    return None


@owns(alerts=(AlertRule("EngineStalled", "critical", "requests running and no token generated for stall_after_s: the step thread's stack, the last step and the GPUs as evidence; restarted by policy"),))
class EngineStallWatcher(Watcher):
    name = "engine_stall"
    blocking = False

    def __init__(self, book: AlertBook, cfg: DaemonConfig, metrics: EngineMetricsWatcher, supervisor,
                 gpus: Callable[[], list[dict[str, Any]]] = lambda: [], stacks_path: str | None = None,
                 clock=time.time) -> None:
        super().__init__()
        self.spec = metrics.spec
        if self.spec.tagged:
            self.name = f"{self.name}:{self.spec.name}"
        self.book = book
        self.cfg = cfg
        self.metrics = metrics
        self.supervisor = supervisor
        self.gpus = gpus
        self.stacks_path = stacks_path
        self.clock = clock
        self.interval_s = cfg.watch_interval_s
        self._pid: int | None = None
        self._tokens: float | None = None
        self._moving_at: float | None = None  # the last scrape that saw tokens move (or nothing running)
        self._fired = False
        self.last_evidence: dict[str, Any] | None = None

    async def apoll(self) -> None:
        s = self.metrics.last
        pid = self.supervisor.pid
        if pid != self._pid:  # a new process: its counters start again
            self._pid, self._tokens, self._moving_at = pid, None, None
        if s is None or pid is None:
            return
        running = s.values.get(names.REQUESTS_RUNNING, 0.0)
        tokens = s.values.get(names.GENERATION_TOKENS_TOTAL)
        if tokens is None:  # an engine that does not export the counter: no verdict
            return
        if running <= 0 or tokens != self._tokens or self._moving_at is None:
            moved = self._tokens is not None and tokens != self._tokens
            self._tokens, self._moving_at = tokens, s.t
            if running <= 0 or moved:
                self._resolve()
            return
        stalled_s = s.t - self._moving_at
        if self._fired or stalled_s < self.cfg.stall_after_s:
            return
        self._fired = True
        evidence = await self.evidence(pid)
        self.last_evidence = evidence
        self._fire(running, tokens, stalled_s, evidence)
        if self.cfg.stall_restart:
            await self.supervisor.restart(f"stalled: {running:.0f} request(s) running and no token for "
                                          f"{stalled_s:.0f} s (EngineStalled)")

    def _resolve(self) -> None:
        if self._fired:
            self._fired = False
            self.book.resolve("EngineStalled", self.spec.key())

    def _fire(self, running: float, tokens: float, stalled_s: float, ev: dict[str, Any]) -> None:
        named = f" {self.spec.name}" if self.spec.tagged else ""
        health = ev.get("health") or {}
        step = health.get("last_step")
        shape = (f"last step #{health.get('steps', '?')}: {step['rows']} rows, {step['prefill_tokens']} prompt "
                 f"tokens, {step['decodes']} decodes, {step['seconds'] * 1000:.1f} ms, "
                 f"{self.clock() - step['at']:.0f} s ago" if isinstance(step, dict) else
                 f"last step: {'#' + str(health['steps']) if 'steps' in health else 'not reported by this engine'}")
        gpus = "; ".join(
            f"GPU {g['index']}: {_pct(g.get('utilization_ratio'))} busy, SM {g.get('sm_clock_mhz', '?')} MHz, "
            f"{_w(g.get('power_watts'))}, {g.get('memory_used_bytes', 0) / 2**30:.1f} GiB used"
            + (f", clock events {', '.join(g['clock_events_active'])}" if g.get("clock_events_active") else "")
            for g in ev["gpus"]) or "no GPU reading (NVML unavailable)"
        stack = ev.get("step_stack") or ev.get("stacks") or ev.get("stacks_error") or "no stack dump"
        self.book.fire(
            "EngineStalled", self.spec.key(), severity="critical",
            labels={**self.spec.labels, "pid": self._pid, "running": int(running)},
            summary=f"engine{named} stalled: {running:.0f} request(s) running, no token for {stalled_s:.0f} s "
                    f"while /health answers",
            description=f"generated tokens flat at {tokens:.0f} for {stalled_s:.0f} s with {running:.0f} request(s) "
                        f"running; {shape}; {gpus}; "
                        + ("zerod restarts it" if self.cfg.stall_restart else "[daemon] stall_restart = false: "
                                                                                "left running")
                        + f"; step thread stack:\n{stack[:STACK_MAX_CHARS]}",
            fix="the stack shows where the step loop waits: a CUDA call that never returns points at the GPU "
                "(zerod diag, the kernel log's Xid lines), a lock or queue at the engine (file an issue with "
                "`zerod bundle`)")

    async def evidence(self, pid: int) -> dict[str, Any]:
        """The stacks, the engine's /health, the GPUs: each independently, none may fail the alert."""
        ev: dict[str, Any] = {"gpus": []}
        stacks = await self._stacks(pid)
        ev.update(stacks)
        try:
            ev["health"] = await self._health()
        except Exception as exc:  # noqa: BLE001 - evidence is best effort
            ev["health_error"] = f"{type(exc).__name__}: {exc}"
        engine = _engine_process(pid, ev.get("health"))
        if engine is not None:   # `zerod serve --engine-process`: the step thread is there
            ev["server_stacks"] = ev.pop("stacks", None)
            ev.pop("step_stack", None)
            ev.update(await self._stacks(engine))
        try:
            ev["gpus"] = self.gpus()
        except Exception:  # noqa: BLE001
            pass
        return ev

    async def _health(self) -> dict[str, Any]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.get(self.supervisor.url + self.supervisor.health_path,
                                   timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                return json.loads(await r.read())

    async def _stacks(self, pid: int) -> dict[str, Any]:
        if self.stacks_path and self.supervisor.kind == "zerod":
            return await self._faulthandler_dump(pid)
        spy = shutil.which("py-spy")
        if spy is None:
            return {"stacks_error": f"no stack dump: a {self.supervisor.kind} engine has no ZEROD_STACK_FILE and "
                                    f"py-spy is not installed (pip install py-spy)"}
        proc = await asyncio.create_subprocess_exec(spy, "dump", "--pid", str(pid), stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), PY_SPY_TIMEOUT_S)
        except asyncio.TimeoutError:
            proc.kill()
            return {"stacks_error": f"py-spy dump took over {PY_SPY_TIMEOUT_S:.0f} s"}
        return {"stacks": out.decode(errors="replace")}

    async def _faulthandler_dump(self, pid: int) -> dict[str, Any]:
        path = self.stacks_path
        try:
            start = os.path.getsize(path)
        except OSError:
            start = 0
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError as exc:
            return {"stacks_error": f"SIGUSR2 to pid {pid}: {exc.strerror}"}
        end = time.monotonic() + STACK_WAIT_S
        text, size = "", start
        while time.monotonic() < end:
            await asyncio.sleep(0.1)
            try:
                now = os.path.getsize(path)
            except OSError:
                continue
            if now > start and now == size:  # grown, and done growing
                break
            size = now
        try:
            with open(path, errors="replace") as f:
                f.seek(start)
                text = f.read()
        except OSError as exc:
            return {"stacks_error": f"cannot read {path}: {exc.strerror}"}
        if not text:
            return {"stacks_error": f"pid {pid} wrote no stacks to {path} within {STACK_WAIT_S:.0f} s"}
        return {"stacks": text, "step_stack": step_thread_stack(text)}


def _engine_process(pid: int, health: Any) -> int | None:
    """The engine's own process that /health names (engine_pid), if it is one of pid's
    descendants: no other process is ever signalled."""
    engine = health.get("engine_pid") if isinstance(health, dict) else None
    if not isinstance(engine, int) or engine == pid:
        return None
    try:
        return engine if engine in {c.pid for c in psutil.Process(pid).children(recursive=True)} else None
    except psutil.Error:
        return None


def _pct(v: float | None) -> str:
    return "?%" if v is None else f"{v:.0%}"


def _w(v: float | None) -> str:
    return "? W" if v is None else f"{v:.0f} W"
