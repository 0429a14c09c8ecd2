"""`zerod run`: the daemon's life cycle.

    config -> preflight gate -> /metrics + control API -> engine child (NUMA-pinned)
    -> READY=1 once healthy -> watchers + WATCHDOG=1 while they make progress
    -> SIGTERM: STOPPING=1, drain the engine, exit 0

Exit codes: 0 stopped cleanly; 78 (EX_CONFIG) refused to start — a bad config
or a failing preflight check (the unit's RestartPreventExitStatus=78 keeps
systemd from retrying a host that needs a person); 1 anything else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import time
from typing import Any

from zerod import __version__, numa
from zerod.alerts import AlertBook, AlertmanagerPusher
from zerod.daemon_config import AlertsConfig, DaemonConfig
from zerod.sdnotify import Notifier
from zerod.supervisor import EngineSupervisor, engine_argv, engine_env, engine_url
from zerod.watchers import Watcher
from zerod.watchers.engine_metrics import COUNTERS, EngineMetricsWatcher
from zerod.watchers.gpu_processes import GpuProcessWatcher
from zerod.watchers.latency import LatencyWatcher
from zerod.watchers.nvml_session import NvmlSession
from zerod.watchers.nvml_stats import NvmlStatsWatcher
from zerod.watchers.xid_events import XidWatcher

log = logging.getLogger("zerod.daemon")

EX_OK, EX_FAIL, EX_CONFIG = 0, 1, 78
# With --demo these are waived: a CPU-only machine fails them by design.
DEMO_WAIVER = "--demo runs the demo model without a GPU"
# Re-checks while the engine runs skip what only means something before it starts
# (its own memory fills the GPU) or what a watcher already follows every second.
RECHECK_SKIP = ("gpu.memory_headroom", "gpu.foreign_processes")


class PreflightRefused(Exception):
    pass


class _Recheck(Watcher):
    name = "rechecks"

    def __init__(self, daemon: "Daemon") -> None:
        super().__init__()
        self.d = daemon
        self.interval_s = daemon.cfg.recheck_interval_s

    def poll(self) -> None:
        self.d.preflight(recheck=True)


class Daemon:
    def __init__(self, config: dict[str, dict[str, Any]], demo: bool = False, *,
                 nvml: Any = None, scan: Any = None, proc_roots: Any = None,
                 notifier: Notifier | None = None, sysfs: str = "/sys") -> None:
        self.sections = {k: dict(v) for k, v in config.items()}
        self.cfg = DaemonConfig.from_dict(self.sections.get("daemon"))
        self.alerts_cfg = AlertsConfig.from_dict(self.sections.get("alerts"))
        self.engine_section = dict(self.sections.get("engine") or {})
        self.demo = demo
        if demo:
            self.engine_section.setdefault("model", "demo")
        self.book = AlertBook(self.alerts_cfg.resolved_retention_s, log_resolved=self.alerts_cfg.log_resolved)
        self.notifier = notifier or Notifier()
        self.nvml = NvmlSession(nvml, self.cfg.nvml_retry_s)
        self.sysfs = sysfs
        self._scan = scan
        self._proc_roots = proc_roots
        self.host = socket.gethostname()
        self.started_at = time.time()
        self.report = None
        self.report_taken_at: float | None = None
        self.doctor_cfg = None
        self.watchers: list[Watcher] = []
        self.supervisor: EngineSupervisor | None = None
        self.processes: GpuProcessWatcher | None = None
        self.nvml_stats: NvmlStatsWatcher | None = None
        self.xid: XidWatcher | None = None
        self.engine_metrics: EngineMetricsWatcher | None = None
        self.latency: LatencyWatcher | None = None
        self.metrics_address: tuple[str, int] | None = None
        self.control_path: str | None = None
        self.ready_at: float | None = None
        self._stop: asyncio.Event | None = None
        self._status_text = ""
        self._watchdog_note = ""

    # ------------------------------------------------------------------ preflight
    def preflight(self, recheck: bool = False) -> None:
        """Run doctor's checks; refuse (PreflightRefused) on a failing check that
        is not waived. A re-check only raises or resolves `PreflightFailed`."""
        if not self.cfg.preflight:
            if not recheck:
                log.warning("preflight disabled ([daemon] preflight = false): starting without checks")
            return
        from zerod.checks import probe_facts, run_checks
        from zerod.checks.config import DoctorConfig
        from zerod.checks.report import CATALOGUE

        cfg = DoctorConfig.from_config(self.sections)
        if self.demo:
            extra = {cid: DEMO_WAIVER for cid in CATALOGUE
                     if (cid.startswith("gpu.") or cid == "numa.gpu_affinity") and cid not in cfg.waivers}
            cfg = dataclasses.replace(cfg, waivers={**cfg.waivers, **extra})
        self.doctor_cfg = cfg
        t0 = time.monotonic()
        facts = probe_facts(config=cfg)
        report = run_checks(facts, config=cfg, skip=RECHECK_SKIP if recheck else None)
        self.report, self.report_taken_at = report, time.time()
        failing = report.failing()
        if not recheck:
            c = report.counts
            log.info("preflight: %d pass, %d warn, %d fail, %d skip, %d error in %.0f ms",
                     c["pass"], c["warn"], c["fail"], c["skip"], c["error"], (time.monotonic() - t0) * 1000)
            demo_waived = sorted(k for k, v in report.waived.items() if v == DEMO_WAIVER)
            if demo_waived:
                found: list[str] = []
                for x in report.checks:
                    if x.id in demo_waived and x.message:
                        m = x.message.split("; found ", 1)[-1]
                        if m not in found and "see gpu.driver_loaded" not in m:
                            found.append(m)
                log.warning("preflight: --demo waives the GPU checks (%s); they found: %s",
                            ", ".join(demo_waived), " | ".join(found)[:600] or "nothing")
            for cid, why in sorted(report.waived.items()):
                if why != DEMO_WAIVER:
                    log.warning("preflight: %s waived in [doctor] waivers (%s)", cid, why)
            for x in report.checks:
                if x.status in ("warn", "error"):
                    log.warning("preflight: %s %s: %s", x.id, x.status, x.message)
        current = {}
        for x in failing:
            current[x.id] = dict(severity="critical" if x.severity == "critical" else "warning",
                                 summary=f"check {x.id} fails: {x.title}", description=x.message,
                                 labels={"check": x.id}, fix=x.remediation or None)
        self.book.sync("PreflightFailed", current)
        if failing and not recheck:
            lines = [f"  {x.id} ({x.title}): {x.message}" + (f"\n      fix: {x.remediation}" if x.remediation else "")
                     for x in failing]
            raise PreflightRefused(
                f"refusing to start: {len(failing)} preflight check(s) fail:\n" + "\n".join(lines) +
                "\nFix them, or waive one on purpose in the config: [doctor] waivers = { \"<check id>\" = \"why\" }")

    # ------------------------------------------------------------------ snapshots
    def gpu_rows(self) -> list[dict[str, Any]]:
        if self.nvml_stats is None:
            return []
        rows = []
        for idx in sorted(self.nvml_stats.gpus):
            g = dict(self.nvml_stats.gpus[idx])
            if self.xid is not None:
                g["xid_events_total"] = dict(self.xid.counts.get(idx, {}))
            rows.append(g)
        return rows

    def gpus_doc(self) -> dict[str, Any]:
        doc = self.nvml_stats.snapshot() if self.nvml_stats else {
            "nvml": {"ok": False, "error": "not started", "driver_version": None}, "gpus": []}
        if self.xid is not None:
            for g in doc["gpus"]:
                g["xid_events_total"] = dict(self.xid.counts.get(g["index"], {}))
        return doc

    def check_rows(self) -> list[dict[str, Any]]:
        return [{"id": c.id, "status": c.status} for c in (self.report.checks if self.report else [])]

    def checks_doc(self) -> dict[str, Any]:
        if self.report is None:
            return {"version": __version__, "host": {"hostname": self.host}, "checks": [],
                    "summary": {}, "taken_at": None}
        return {**self.report.to_dict(), "taken_at": self.report_taken_at}

    def status(self) -> dict[str, Any]:
        eng = self.supervisor.snapshot() if self.supervisor else {
            "state": "stopped", "up": False, "pid": None, "url": None, "model": None,
            "restarts": 0, "numa_node": None, "cpus": None}
        eng = {k: eng.get(k) for k in ("state", "up", "pid", "url", "model", "restarts", "numa_node", "cpus")}
        pre = None
        if self.report is not None:
            pre = {**self.report.counts, "exit_code": self.report.exit_code, "taken_at": self.report_taken_at}
        return {"version": __version__, "host": self.host, "daemon_pid": os.getpid(),
                "started_at": self.started_at, "uptime_s": round(time.time() - self.started_at, 1),
                "write_actions": self.cfg.allow_write_actions, "paused": False,
                "engine": eng, "preflight": pre}

    def engine_doc(self) -> dict[str, Any]:
        up = bool(self.supervisor and self.supervisor.fig.state == "healthy")
        last = self.engine_metrics.last if self.engine_metrics else None
        v = last.values if last else {}

        def num(name: str):
            x = v.get(name)
            return int(x) if x is not None else None

        lat = self.latency.snapshot() if self.latency else {}
        return {
            "up": up, "url": self.supervisor.url if self.supervisor else None,
            "running": num("zerod_engine_requests_running"), "waiting": num("zerod_engine_requests_waiting"),
            "kv_pages_total": num("zerod_engine_kv_pages_total"), "kv_pages_free": num("zerod_engine_kv_pages_free"),
            "output_tokens_per_s": lat.get("output_tokens_per_s"),
            "ttft_p50_s": lat.get("ttft_p50_s"), "ttft_p99_s": lat.get("ttft_p99_s"),
            "itl_p50_s": lat.get("itl_p50_s"), "itl_p99_s": lat.get("itl_p99_s"),
            "allocator_retries_total": num(COUNTERS["allocator_retries_total"]),
            "allocator_ooms_total": num(COUNTERS["allocator_ooms_total"]),
            "stream_errors_total": num(COUNTERS["stream_errors_total"]),
            "history": lat.get("history", {k: [] for k in (
                "output_tokens_per_s", "running", "waiting", "kv_pages_used", "itl_p99_s", "ttft_p99_s")}),
        }

    # ------------------------------------------------------------------ life cycle
    def _set_status(self, text: str) -> None:
        if text != self._status_text:
            self._status_text = text
            self.notifier.status(text)

    def _on_ready(self) -> None:
        self.ready_at = time.time()
        s = self.supervisor
        text = f"serving {s.model or '?'} at {s.url} (engine pid {s.pid})"
        log.info("ready: %s", text)
        self._status_text = text
        self.notifier.ready(text)

    def _binding(self) -> numa.Binding:
        if self.cfg.numa == "off":
            return numa.Binding(None, [], self.cfg.numa_memory_policy, "[daemon] numa = \"off\"")
        dev = self.nvml.device(self.cfg.gpu_index) if self.nvml.ok else None
        b = numa.plan_binding(dev.bus_id if dev else None, self.cfg.numa_memory_policy, self.sysfs)
        if b.active:
            log.info("engine pinned to NUMA node %d (CPUs %s, memory %s): %s", b.node, b.cpulist, b.policy, b.reason)
        else:
            log.warning("engine not pinned: %s", b.reason)
        return b

    def _control_path(self) -> str:
        path = self.cfg.control_socket
        explicit = "control_socket" in (self.sections.get("daemon") or {})
        parent = os.path.dirname(path) or "."
        if explicit or os.access(parent, os.W_OK) or (not os.path.exists(parent) and os.access(os.path.dirname(parent) or "/", os.W_OK)):
            return path
        base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/zerod-{os.getuid()}"
        alt = os.path.join(base, "zerod", "control.sock") if os.environ.get("XDG_RUNTIME_DIR") else os.path.join(base, "control.sock")
        log.warning("cannot write %s (not root?): control socket at %s (zerod top --socket %s)", parent, alt, alt)
        return alt

    async def _start_servers(self) -> list:
        from aiohttp import web

        from zerod.control_api import bind_unix_socket, make_app
        from zerod.daemon_metrics import make_registry, render

        runners = []
        if self.cfg.metrics_port >= 0:
            registry = make_registry(self)

            async def metrics(_req):
                return web.Response(body=render(registry),
                                    headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

            async def health(_req):
                return web.json_response({"ok": True})

            app = web.Application()
            app.router.add_get("/metrics", metrics)
            app.router.add_get("/health", health)
            r = web.AppRunner(app, access_log=None)
            await r.setup()
            site = web.TCPSite(r, self.cfg.metrics_host, self.cfg.metrics_port)
            await site.start()
            addr = r.addresses[0]
            self.metrics_address = (addr[0], addr[1])
            log.info("metrics on http://%s:%d/metrics", self.cfg.metrics_host, addr[1])
            runners.append(r)
        path = self._control_path()
        sock = bind_unix_socket(path)
        r = web.AppRunner(make_app(self), access_log=None)
        await r.setup()
        await web.SockSite(r, sock).start()
        self.control_path = path
        log.info("control API on unix:%s (mode 0600, %s)", path,
                 "write actions enabled" if self.cfg.allow_write_actions else "read-only")
        runners.append(r)
        return runners

    async def _run_watcher(self, w: Watcher, pool) -> None:
        loop = asyncio.get_running_loop()
        w.last_run_at = time.monotonic()
        first = True
        while True:
            if not first or w.name != "rechecks":
                t0 = time.monotonic()
                try:
                    if w.blocking:
                        await loop.run_in_executor(pool, w.poll)
                    else:
                        await w.apoll()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    w.errors += 1
                    msg = f"{type(exc).__name__}: {exc}"
                    if msg != w.last_error:
                        log.warning("watcher %s failed: %s", w.name, msg, exc_info=w.errors == 1)
                    w.last_error = msg
                else:
                    w.last_error = None
                w.runs += 1
                w.busy_s += time.monotonic() - t0
                w.last_run_at = time.monotonic()
            first = False
            await asyncio.sleep(max(0.0, w.interval_s - (time.monotonic() - w.last_run_at)))

    def _progress_ok(self) -> tuple[bool, str]:
        now = time.monotonic()
        for w in self.watchers:
            allowance = max(3 * w.interval_s, 10.0)
            if not w.progressed_within(allowance, now):
                return False, f"watcher {w.name} made no progress for {allowance:.0f} s"
        if self.supervisor and now - self.supervisor.progress_at > max(10.0, 3 * self.cfg.health_timeout_s):
            return False, "engine supervision made no progress"
        return True, ""

    async def _tick(self) -> None:
        """The watch loop's heartbeat: WATCHDOG=1 only while everything moves,
        STATUS= when the picture changes."""
        last_wd = 0.0
        wd_every = max(0.2, min(self.notifier.watchdog_usec / 2e6, 1.0)) if self.notifier.watchdog_enabled else 1.0
        while True:
            ok, why = self._progress_ok()
            now = time.monotonic()
            if self.notifier.watchdog_enabled and not self._stop.is_set():
                if ok and now - last_wd >= wd_every:
                    self.notifier.watchdog()
                    last_wd = now
                if not ok and why != self._watchdog_note:
                    log.error("withholding WATCHDOG=1: %s", why)
                self._watchdog_note = why
            if self.ready_at is not None and self.supervisor is not None:
                firing = self.book.firing()
                s = self.supervisor
                eng = f"engine {s.fig.state}" + (f" (pid {s.pid})" if s.pid else "")
                names = sorted({a.alertname for a in firing})
                self._set_status(f"{eng} at {s.url}; " + (
                    f"{len(firing)} alert(s) firing: {', '.join(names)}" if firing else "no alerts"))
            await asyncio.sleep(min(1.0, wd_every))

    async def run(self) -> int:
        from concurrent.futures import ThreadPoolExecutor

        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="zerod-watch")
        self._set_status("preflight: reading the host")
        try:
            await loop.run_in_executor(pool, self.preflight)
        except PreflightRefused as exc:
            log.critical("%s", exc)
            self._set_status(str(exc).splitlines()[0])
            pool.shutdown(wait=False)
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            return EX_CONFIG
        runners = []
        tasks: list[asyncio.Task] = []
        try:
            try:
                runners = await self._start_servers()
            except OSError as exc:
                log.critical("cannot open the daemon's endpoints: %s", exc)
                self._set_status(f"cannot open endpoints: {exc}")
                return EX_CONFIG
            await loop.run_in_executor(pool, self.nvml.ensure)
            argv = self.cfg.engine_command or engine_argv(self.engine_section, self.demo)
            self.supervisor = EngineSupervisor(
                argv, engine_url(self.engine_section, self.cfg), self.cfg, self.book, self.notifier,
                self._binding(), model=str(self.engine_section.get("served_model_name")
                                           or self.engine_section.get("model", "?")),
                extra_env=engine_env(self.engine_section),
                on_ready=self._on_ready, on_status=self._set_status)
            sup = self.supervisor
            self.nvml_stats = NvmlStatsWatcher(self.nvml, self.book, self.cfg, demo=self.demo)
            allowed = tuple(self.doctor_cfg.allowed_gpu_processes) if self.doctor_cfg else ()
            self.processes = GpuProcessWatcher(
                self.book, self.cfg, allowed=allowed, own_pids=lambda: {os.getpid()},
                engine_pid=lambda: sup.pid, nvml_ok=lambda: self.nvml.ok, roots=self._proc_roots,
                scan=self._scan, nvml_session=self.nvml)
            self.xid = XidWatcher(self.nvml, self.book, self.cfg)
            self.engine_metrics = EngineMetricsWatcher(self.book, self.cfg, sup.url, engine_pid=lambda: sup.pid,
                                                       up=lambda: sup.fig.state == "healthy")
            self.latency = LatencyWatcher(self.book, self.cfg, self.engine_metrics,
                                          recent_foreign=lambda: list(self.processes.recent_foreign.values()))
            self.watchers = [self.nvml_stats, self.processes, self.xid, self.engine_metrics, self.latency]
            if self.cfg.preflight:
                self.watchers.append(_Recheck(self))
            if self.alerts_cfg.alertmanager_url:
                pusher = AlertmanagerPusher(self.book, self.alerts_cfg.alertmanager_url,
                                            self.alerts_cfg.resend_interval_s, self.alerts_cfg.timeout_s,
                                            self.alerts_cfg.labels, instance=self.host)
                tasks.append(asyncio.create_task(pusher.run(), name="alertmanager"))
            tasks.append(asyncio.create_task(sup.run(), name="supervisor"))
            tasks += [asyncio.create_task(self._run_watcher(w, pool), name=w.name) for w in self.watchers]
            tasks.append(asyncio.create_task(self._tick(), name="tick"))
            stop_wait = asyncio.create_task(self._stop.wait())
            done, _ = await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
            if stop_wait not in done:
                for t in done:
                    exc = t.exception()
                    log.critical("internal task %s ended: %r; stopping", t.get_name(), exc,
                                 exc_info=(type(exc), exc, exc.__traceback__) if exc else None)
                self.notifier.stopping(f"internal error in {', '.join(t.get_name() for t in done)}")
                await sup.stop()
                return EX_FAIL
            for t in tasks:  # the watch loop ends here: no WATCHDOG=1 after STOPPING=1
                if t.get_name() == "tick":
                    t.cancel()
            log.info("SIGTERM: stopping; draining the engine (up to %.0f s)", self.cfg.drain_timeout_s)
            self.notifier.stopping("stopping: draining the engine")
            self.notifier.extend_timeout(self.cfg.drain_timeout_s + 10)
            rc = await sup.stop()
            log.info("engine stopped (%s); daemon exits", "exit code %s" % rc if rc is not None else "not running")
            return EX_OK
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.supervisor and self.supervisor.proc and self.supervisor.proc.poll() is None:
                await self.supervisor.stop(drain_timeout_s=5.0)
            if self.xid:
                await loop.run_in_executor(None, self.xid.stop)
            if self.engine_metrics:
                await self.engine_metrics.close()
            for r in runners:
                await r.cleanup()
            if self.control_path:
                try:
                    os.unlink(self.control_path)
                except OSError:
                    pass
            self.nvml.close()
            pool.shutdown(wait=False, cancel_futures=True)
            self.notifier.close()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
