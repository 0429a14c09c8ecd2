"""The engine as a supervised child process.

Start (pinned to the GPU's NUMA node, without the daemon's NOTIFY_SOCKET), wait
for `GET /health` = 200 while telling systemd to extend its start timeout, then
check health every `health_interval_s`, each probe allowed `health_timeout_s`. A
child that exits is seen at the next tick (<= 1 s). One that stops answering is
probed every `health_failure_period_s` and judged like a careful orchestrator
(zerod.liveness): after `health_failure_threshold` failures in a row a process
that is stopped or uses no CPU is dead, one still working is slow and gets until
`health_slow_limit_s`; every failure is logged with that evidence. A dead or
overdue engine raises `EngineDown`, gets SIGTERM (its drain when it is working),
SIGKILL after, and is started again after a backoff (1, 2, 4 …
`restart_backoff_max_s`), reset once it has stayed healthy for
`restart_reset_after_s`. `stop()` sends SIGTERM (the engine drains) and waits
`drain_timeout_s` before SIGKILL; `force_stop()` cuts that wait short.

The engine is healthy only when its own process answers: `zerod serve`'s
`/health` carries `"pid"`, which must be the child's (or a descendant's, for a
wrapped `engine_command`). Another server holding the port is named in the log
and in EngineDown, never taken for the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from zerod import liveness, numa
from zerod.alerts import AlertBook
from zerod.daemon_config import DaemonConfig
from zerod.engines import PRESETS
from zerod.fleet import DEFAULT_NAME, EngineSpec
from zerod.registry import AlertRule, owns
from zerod.sdnotify import Notifier, child_environment

log = logging.getLogger("zerod.supervisor")

# The API key as a systemd credential (LoadCredential=api_key:…): handed to the
# engine in its environment (VLLM_API_KEY, which zerod serve reads too), never on
# its command line.
CREDENTIAL_API_KEY = "api_key"
CREDENTIAL_ENV = "VLLM_API_KEY"
# SIGTERM to SIGKILL for an engine judged dead (stopped, or using no CPU): it cannot drain.
HUNG_KILL_GRACE_S = 2.0


def api_key_credential(env: dict[str, str] | None = None) -> str | None:
    """The key in $CREDENTIALS_DIRECTORY/api_key, or None."""
    env = os.environ if env is None else env
    directory = env.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return None
    try:
        key = (Path(directory) / CREDENTIAL_API_KEY).read_text().strip()
    except OSError:
        return None
    return key or None


def engine_argv(engine: dict[str, Any], demo: bool = False, kind: str = "zerod") -> list[str]:
    """The engine's command line from the [engine] table (zerod.engines: vLLM's flag
    names; the API key never goes on it, /proc/PID/cmdline being world-readable)."""
    section = dict(engine)
    if demo and kind == "zerod":
        section.setdefault("model", "demo")
    return PRESETS[kind].argv(section)


def engine_env(engine: dict[str, Any], api_key: str | None = None, kind: str = "zerod") -> dict[str, str]:
    """The engine's extra environment: the credential's key when there is one,
    else [engine] api_key, in the variable the engine reads."""
    if api_key:
        if engine.get("api_key"):
            log.warning("[engine] api_key is ignored: the systemd credential %s is used", CREDENTIAL_API_KEY)
        return {CREDENTIAL_ENV: api_key}
    env = PRESETS[kind].api_key_env
    return {env: str(engine["api_key"])} if env and engine.get("api_key") else {}


def engine_url(engine: dict[str, Any], cfg: DaemonConfig) -> str:
    if cfg.engine_url:
        return cfg.engine_url.rstrip("/")
    host = str(engine.get("host", "127.0.0.1"))
    if host in ("0.0.0.0", "", "::", "[::]"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{int(engine.get('port', PRESETS[cfg.engine].default_port))}"


@dataclass
class EngineFigures:
    state: str = "stopped"
    pid: int | None = None
    restarts: int = 0
    started_at: float | None = None
    healthy_since: float | None = None
    last_exit: str | None = None


ENGINE_UP = "zerod_engine_up"
ENGINE_RESTARTS = "zerod_engine_restarts"


@owns(metrics=(ENGINE_UP, ENGINE_RESTARTS),
      alerts=(AlertRule("EngineDown", "critical", "the engine is down (exited, or its health check fails); "
                        "restarted with backoff"),
              AlertRule("EngineRestarted", "warning", "the daemon restarted the engine")))
class EngineSupervisor:
    def __init__(self, argv: list[str], url: str, cfg: DaemonConfig, book: AlertBook,
                 notifier: Notifier | None = None, binding: numa.Binding | None = None,
                 env: dict[str, str] | None = None, model: str | None = None,
                 extra_env: dict[str, str] | None = None,
                 on_ready: Callable[[], None] | None = None,
                 on_status: Callable[[str], None] | None = None,
                 pid_required: bool = True, health_path: str = "/health", kind: str = "zerod",
                 spec: EngineSpec | None = None) -> None:
        self.argv = list(argv)
        # which engine of the config: its name, GPUs, alert key and series labels
        self.spec = spec or EngineSpec(DEFAULT_NAME, (), {})
        self.health_path = health_path
        self.kind = kind
        # zerod serve's /health always carries its pid; another engine's may not
        self.pid_required = pid_required
        self.url = url
        self.cfg = cfg
        self.book = book
        self.notifier = notifier or Notifier({})
        self.binding = binding or numa.Binding(None, [])
        self.model = model
        self.env = child_environment(env)
        # A source checkout (no install) must find the package in the child too.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (root, self.env.get("PYTHONPATH")) if p)
        self.env.update(cfg.engine_env)
        self.env.update(self.spec.child_env())
        self.env.update(extra_env or {})
        self.on_ready = on_ready
        self.on_status = on_status or (lambda s: None)
        self.proc: subprocess.Popen | None = None
        self.fig = EngineFigures()
        self._stopping = False
        self._forced = False
        self._ready_sent = False
        self._impostor_said: str | None = None
        self._backoff = cfg.restart_backoff_initial_s
        self._session = None
        self.daemon_started = time.monotonic()
        self.progress_at = time.monotonic()  # the supervision loop's heartbeat

    # --- the child ----------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def command(self) -> list[str]:
        tool = "numactl" if self.cfg.numa == "numactl" else "builtin"
        binding = self.binding if self.cfg.numa != "off" else numa.Binding(None, [])
        return numa.wrap_command(self.argv, binding, tool)

    def _spawn(self) -> None:
        cmd = self.command()
        log.info("starting engine%s: %s", self.named, " ".join(cmd))
        # Popen from the event loop's thread; the child gets no NOTIFY_SOCKET.
        self.proc = subprocess.Popen(cmd, env=self.env, stdin=subprocess.DEVNULL, close_fds=True)
        self.fig.pid = self.proc.pid
        self.fig.started_at = time.time()
        self.fig.healthy_since = None
        self._set_state("starting", f"engine starting (pid {self.proc.pid}), waiting for {self.url}/health")

    def _set_state(self, state: str, status: str | None = None) -> None:
        if state != self.fig.state:
            log.info("engine%s %s -> %s%s", self.named, self.fig.state, state, f": {status}" if status else "")
        self.fig.state = state
        if status:
            self.on_status(status)

    async def _health(self, timeout_s: float = 2.0) -> tuple[bool, str]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self._session.get(self.url + self.health_path, timeout=timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    return False, f"HTTP {resp.status}"
        except asyncio.TimeoutError:
            return False, "health request timed out"
        except Exception as exc:  # connection refused while loading, reset …
            return False, f"{type(exc).__name__}: {exc}"
        impostor = self._impostor(body)
        if impostor:
            if impostor != self._impostor_said:  # once per distinct answer, not every second
                log.warning("%s", impostor)
                self._impostor_said = impostor
            return False, impostor
        self.lora_adapters = _lora_adapters(body)
        self._thread_names = _thread_names(body)
        return True, "HTTP 200"

    lora_adapters: list[str] = []   # the LoRA adapters its last /health answer named
    _thread_names: dict[int, str] = {}   # its threads by tid, as its last /health named them

    def _impostor(self, body: bytes) -> str | None:
        """Why this /health answer is not our child's, or None when it is."""
        try:
            pid = json.loads(body).get("pid")
        except (ValueError, AttributeError):
            pid = None
        child = self.proc.pid if self.proc is not None else None
        if not isinstance(pid, int):
            if not self.pid_required:
                return None
            return (f"another server answers on {self.url}/health (no pid in its answer: not zerod serve), "
                    f"not the engine (pid {child}); is the port taken?")
        if pid == child or pid in _descendants(child):
            return None
        return (f"another process answers on {self.url}/health: pid {pid} ({_process_name(pid)}), "
                f"not the engine (pid {child}); is the port taken?")

    async def _kill(self, grace_s: float) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while p.poll() is None and time.monotonic() < deadline and not self._forced:
            self.progress_at = time.monotonic()   # waiting on a drain is progress (watchdog)
            await asyncio.sleep(0.05)
        if p.poll() is None:
            if self._forced:
                log.warning("engine pid %d: SIGKILL without waiting for the drain", p.pid)
            else:
                log.warning("engine pid %d did not stop within %.0f s: SIGKILL", p.pid, grace_s)
            p.kill()
            await asyncio.get_running_loop().run_in_executor(None, p.wait)

    # --- the loop -----------------------------------------------------------
    async def run(self) -> None:
        try:
            while not self._stopping:
                self._spawn()
                why = await self._watch_one()
                if self._stopping:
                    break
                self.fig.last_exit = why
                self.fig.restarts += 1
                self._alert_down(why)
                self.book.fire("EngineRestarted", self.spec.key(), severity="warning",
                               summary=f"engine{self.named} restarted ({self.fig.restarts} so far): {why}",
                               labels={"url": self.url, **self.spec.labels})
                self._set_state("restarting", f"engine down ({why}); restart #{self.fig.restarts} in {self._backoff:.0f} s")
                await self._sleep(self._backoff)
                self._backoff = min(self._backoff * 2, self.cfg.restart_backoff_max_s)
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None

    def _alert_down(self, why: str) -> None:
        self.book.fire("EngineDown", self.spec.key(), severity="critical", summary=f"engine{self.named} down: {why}",
                       description=f"the engine ({' '.join(self.argv[:6])} …) {why}; "
                                   f"zerod restarts it in {self._backoff:.0f} s",
                       labels={"url": self.url, **self.spec.labels},
                       fix="journalctl -u zerod -e shows the engine's own output")

    async def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        # short naps only while systemd must hear EXTEND_TIMEOUT_USEC (before
        # READY) or the stop may come: once serving, one wake-up per interval
        nap = 0.2 if not self._ready_sent else 1.0
        while not self._stopping and time.monotonic() < end:
            self.progress_at = time.monotonic()
            self._extend_start()
            await asyncio.sleep(min(nap, max(0.0, end - time.monotonic())))
        self.progress_at = time.monotonic()

    def _extend_start(self) -> None:
        """Tell systemd we are still starting (the model loads), until the
        configured start timeout is spent."""
        if self._ready_sent:
            return
        now = time.monotonic()
        if now - self.daemon_started > self.cfg.start_timeout_s:
            return
        if now - getattr(self, "_extended_at", 0.0) >= self.cfg.extend_timeout_step_s / 3:
            self.notifier.extend_timeout(self.cfg.extend_timeout_step_s)
            self._extended_at = now

    async def _watch_one(self) -> str:
        """Supervise one child until it exits or hangs; return why it ended."""
        p = self.proc
        assert p is not None
        started = time.monotonic()
        last_ok: float | None = None
        last_err = ""
        stall: liveness.Stall | None = None
        while not self._stopping:
            self.progress_at = time.monotonic()
            rc = p.poll()
            if rc is not None and self._restart_why:
                why, self._restart_why = self._restart_why, None
                return why
            if rc is not None:
                why = f"exited with {_describe_rc(rc)}" + ("" if last_ok else " while starting")
                return why + (f" ({last_err})" if last_err and self._impostor_said == last_err else "")
            ok, detail = await self._health(self.cfg.health_timeout_s)
            now = time.monotonic()
            if self._stopping:
                break
            pause = self.cfg.health_interval_s
            if ok:
                if stall is not None:
                    log.warning("engine%s answers /health again after %.1f s (%d failed probe(s)): %s",
                                self.named, now - last_ok, stall.failures, stall.evidence())
                    stall = None
                if last_ok is None or self.fig.state != "healthy":
                    self.fig.healthy_since = time.time()
                    self._set_state("healthy", f"engine healthy (pid {p.pid}) at {self.url}")
                    if not self._ready_sent:
                        self._ready_sent = True
                        if self.on_ready:
                            self.on_ready()
                    self.book.resolve("EngineDown", self.spec.key())
                last_ok = now
                if self.fig.healthy_since and time.time() - self.fig.healthy_since >= self.cfg.restart_reset_after_s:
                    self._backoff = self.cfg.restart_backoff_initial_s
                    self.book.resolve("EngineRestarted", self.spec.key())
            else:
                last_err = detail
                if last_ok is not None:
                    if stall is None:
                        stall = liveness.Stall(p.pid, self._thread_names)
                    stall.failed()
                    why = self._judge(stall, now - last_ok, detail)
                    if why:
                        self._set_state("unhealthy", f"engine unhealthy: {detail}")
                        self._alert_down(why)  # before the kill: a hung engine may take a while to die
                        # a working engine gets its drain; one that does not run cannot drain
                        await self._kill(grace_s=self.cfg.drain_timeout_s if stall.slow
                                         else HUNG_KILL_GRACE_S)
                        return why
                    if self.fig.state == "healthy":
                        self._set_state("unhealthy", f"engine health failing: {detail}")
                    pause = self.cfg.health_failure_period_s
                elif now - started > self.cfg.start_timeout_s:
                    await self._kill(grace_s=5.0)
                    return f"not healthy within start_timeout_s={self.cfg.start_timeout_s:.0f} s ({last_err})"
                else:
                    self._extend_start()
            await self._sleep(pause)
        return "stopping"

    async def restart(self, why: str) -> None:
        """Kill the engine so the loop restarts it, `why` being its reason (a watcher's
        verdict, e.g. EngineStalled: an engine that answers /health but does no work)."""
        if self.pid is None or self._stopping:
            return
        self._restart_why = why
        log.warning("engine%s: restarting it: %s", self.named, why)
        await self._kill(grace_s=2.0)

    _restart_why: str | None = None

    def _judge(self, stall: liveness.Stall, stalled_s: float, detail: str) -> str | None:
        """Why the stalled engine is to be restarted now, or None to probe again. Logged
        with the process's evidence either way, so a kill never comes unexplained."""
        cfg = self.cfg
        evidence = stall.evidence()
        if stall.failures < cfg.health_failure_threshold:
            log.warning("engine%s: /health failed %d/%d (%s) %.1f s after its last good answer; "
                        "%s", self.named, stall.failures, cfg.health_failure_threshold, detail,
                        stalled_s, evidence)
            return None
        if stall.slow and stalled_s < cfg.health_slow_limit_s:
            log.warning("engine%s: /health failed %d times (%s) over %.1f s but the engine is "
                        "working: %s; restarted only if this lasts health_slow_limit_s=%g s",
                        self.named, stall.failures, detail, stalled_s, evidence,
                        cfg.health_slow_limit_s)
            return None
        why = (f"stopped answering /health for {stalled_s:.1f} s, {stall.failures} failed "
               f"probes ({detail}); {evidence}")
        log.error("engine%s: %s: restarting it", self.named, why)
        return why

    def force_stop(self) -> None:
        """Stop waiting for the drain: SIGKILL the engine now (a second Ctrl-C)."""
        self._forced = True

    async def stop(self, drain_timeout_s: float | None = None) -> int | None:
        """SIGTERM the engine (it drains), SIGKILL after the drain timeout."""
        self._stopping = True
        grace = self.cfg.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self._set_state("stopped" if self.proc is None else self.fig.state)
        await self._kill(grace_s=grace)
        self._set_state("stopped", "engine stopped")
        return self.proc.returncode if self.proc is not None else None

    @property
    def named(self) -> str:
        return f" {self.spec.name}" if self.spec.tagged else ""

    def snapshot(self) -> dict[str, Any]:
        return {"name": self.spec.name, "gpus": list(self.spec.gpus), "state": self.fig.state, "up": self.fig.state == "healthy", "pid": self.pid, "kind": self.kind,
                "url": self.url, "model": self.model, "restarts": self.fig.restarts,
                "numa_node": self.binding.node if self.cfg.numa != "off" else None,
                "cpus": self.binding.cpulist if self.cfg.numa != "off" else None,
                "last_exit": self.fig.last_exit}

    def collect(self):
        yield from collect_engines([self])


def collect_engines(sups: list[EngineSupervisor]):
    """zerod_engine_up and _restarts: one family, a series per engine (labelled
    `engine` with [[engines]]; the one [engine] engine's series unlabelled)."""
    labels = ["engine"] if any(s.spec.tagged for s in sups) else []
    up = GaugeMetricFamily(ENGINE_UP, "1 while the engine answers its health check.", labels=labels)
    restarts = CounterMetricFamily(ENGINE_RESTARTS, "Engine restarts by the daemon.", labels=labels)
    for s in sups:
        value = [s.spec.name] if labels else []
        up.add_metric(value, 1.0 if s.fig.state == "healthy" else 0.0)
        restarts.add_metric(value, float(s.fig.restarts))
    yield from (up, restarts)


def _descendants(pid: int | None) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)} if pid else set()
    except psutil.Error:
        return set()


def _process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "not visible from here"


def _describe_rc(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit code {rc}"


def _thread_names(body: bytes) -> dict[int, str]:
    try:
        return liveness.thread_names(json.loads(body))
    except ValueError:
        return {}


def _lora_adapters(body: bytes) -> list[str]:
    """The LoRA adapter names a zerod serve /health answer lists ([] for other engines)."""
    try:
        names = json.loads(body).get("lora_adapters")
    except (ValueError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
