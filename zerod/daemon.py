"""`zerod run`: the daemon's life cycle.

    (config checked by zerod.cmd_config) -> preflight gate (zerod.preflight)
    -> the parts: engine supervisor, watchers, and the views over them
    -> /metrics + control API (they read the views) -> engine child (NUMA-pinned)
    -> READY=1 once its own /health answers -> WATCHDOG=1 while the watchers move
    -> SIGTERM or SIGINT: STOPPING=1, drain the engine, exit 0; a second one
       stops at once

Several engines ([[engines]], zerod.fleet): a preflight, a supervisor, a
metrics and a latency watcher per engine, each child pinned to its GPUs' NUMA
node with CUDA_VISIBLE_DEVICES set to its GPUs; one host-wide NVML, process and
XID watcher (a foreign process is attributed to the engines of its GPUs);
READY=1 once every engine has answered its /health; each engine restarted alone.

Exit codes: 0 stopped; 78 (EX_CONFIG) refused to start — a bad config, a
failing preflight check or an endpoint it may not open (the unit's
RestartPreventExitStatus=78 keeps systemd from retrying a host that needs a
person); 1 anything else.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from zerod import numa
from zerod.alerts import AlertBook, AlertmanagerPusher
from zerod.checks.state_dir import diag_result_path
from zerod.daemon_config import AlertsConfig, DaemonConfig
from zerod.diag.service import DiagService
from zerod.engines import PRESETS
from zerod.fleet import EngineSpec, engine_specs
from zerod.history import HistoryRecorder
from zerod.engine.core.stack_dump import ENV as STACK_ENV
from zerod.flight_recorder import FlightRecorder
from zerod.engine.port_holder import port_holder
from zerod.preflight import Preflight, PreflightRefused, RecheckWatcher
from zerod.registry import build_watchers
from zerod.sdnotify import Notifier
from zerod.supervisor import EngineSupervisor, api_key_credential, engine_argv, engine_env, engine_url
from zerod.views import EngineView, Views
from zerod.watchers import Watcher
from zerod.watchers.canary import CanaryWatcher
from zerod.watchers.compute_mode import ComputeModeGuard
from zerod.watchers.engine_metrics import EngineMetricsWatcher
from zerod.watchers.engine_stall import EngineStallWatcher, stack_file
from zerod.watchers.gpu_processes import GpuProcessWatcher
from zerod.watchers.latency import LatencyWatcher
from zerod.watchers.nvml_gpm import GpmWatcher
from zerod.watchers.nvml_session import NvmlSession
from zerod.watchers.nvml_stats import NvmlStatsWatcher
from zerod.watchers.xid_events import XidWatcher

log = logging.getLogger("zerod.daemon")

EX_OK, EX_FAIL, EX_CONFIG = 0, 1, 78
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Daemon:
    def __init__(self, config: dict[str, dict[str, Any]], demo: bool = False, *,
                 nvml: Any = None, scan: Any = None, proc_roots: Any = None,
                 notifier: Notifier | None = None, sysfs: str = "/sys",
                 env: dict[str, str] | None = None, diag_command: tuple[str, ...] | None = None) -> None:
        self.cfg = DaemonConfig.from_dict(config.get("daemon"))
        self.alerts_cfg = AlertsConfig.from_dict(config.get("alerts"))
        self.specs = engine_specs(config, self.cfg.gpu_index)
        if demo:
            for spec in self.specs:
                spec.section.setdefault("model", "demo")
        self.demo = demo
        self.host = socket.gethostname()
        self.started_at = time.time()
        self.book = AlertBook(self.alerts_cfg.resolved_retention_s, log_resolved=self.alerts_cfg.log_resolved)
        self.notifier = notifier or Notifier()
        self.recorder = FlightRecorder(self.cfg, config, self.book, daemon_docs=self._docs)
        self.nvml = NvmlSession(nvml, self.cfg.nvml_retry_s)
        self.api_key = api_key_credential(env)
        self.preflights = [Preflight(config, self.book, enabled=self.cfg.preflight, demo=demo,
                                     api_key_set=bool(self.api_key), host=self.host, spec=spec)
                           for spec in self.specs]
        self.sysfs = sysfs
        self._scan = scan
        self._proc_roots = proc_roots
        self._diag_command = diag_command  # tests stand a script in for `python -m zerod diag`
        self._first_diag: asyncio.Task | None = None
        self.supervisors: list[EngineSupervisor] = []
        self.watchers: list[Watcher] = []
        self.registered: list[Watcher] = []  # built from zerod.registry (per_host / per_engine)
        self.fault_watchers: list[Watcher] = []  # EngineStalled and the canary, each engine's
        self._nvml_stats: NvmlStatsWatcher | None = None  # EngineStalled's GPU evidence
        self.views: Views | None = None
        self.netlink = None
        self.metrics_address: tuple[str, int] | None = None
        self.control_path: str | None = None
        self.ready_at: float | None = None
        self._stop: asyncio.Event | None = None
        self._stop_signal: str | None = None
        self._status_text = ""
        self._watchdog_note = ""

    # ------------------------------------------------------------------ the parts
    def _binding(self, spec: EngineSpec) -> numa.Binding:
        """The NUMA node of the engine's GPUs (one node for all of them, else not pinned)."""
        named = f"engine {spec.name}" if spec.tagged else "engine"
        if self.cfg.numa == "off":
            return numa.Binding(None, [], self.cfg.numa_memory_policy, "[daemon] numa = \"off\"")
        plans = []
        for gpu in spec.gpus:
            dev = self.nvml.device(gpu) if self.nvml.ok else None
            plans.append(numa.plan_binding(dev.bus_id if dev else None, self.cfg.numa_memory_policy, self.sysfs))
        b = plans[0]
        nodes = sorted({p.node for p in plans if p.node is not None})
        if len(nodes) > 1:
            b = numa.Binding(None, [], self.cfg.numa_memory_policy,
                             f"its GPUs {', '.join(map(str, spec.gpus))} are on NUMA nodes {', '.join(map(str, nodes))}")
        if b.active:
            log.info("%s pinned to NUMA node %d (CPUs %s, memory %s): %s", named, b.node, b.cpulist, b.policy,
                     b.reason)
        else:
            log.warning("%s not pinned: %s", named, b.reason)
        return b

    def _supervisor(self, spec: EngineSpec) -> EngineSupervisor:
        cfg = self.cfg
        preset = PRESETS[cfg.engine]
        command = spec.command or cfg.engine_command
        section = spec.flags()
        return EngineSupervisor(
            command or engine_argv(section, self.demo, cfg.engine),
            engine_url(section, cfg), cfg, self.book, self.notifier, self._binding(spec),
            model=str(section.get("served_model_name") or section.get("model", "?")),
            extra_env={**engine_env(section, self.api_key, cfg.engine),
                       **self._stack_env(spec)},
            on_ready=self._on_ready, on_status=self._set_status,
            pid_required=preset.reports_pid and not command,
            health_path=preset.health_path, kind=cfg.engine, spec=spec)

    def _stack_env(self, spec: EngineSpec) -> dict[str, str]:
        """ZEROD_STACK_FILE for a zerod engine: where SIGUSR2 dumps its stacks (EngineStalled)."""
        if self.cfg.engine != "zerod" or self.recorder.store is None:
            return {}
        return {STACK_ENV: stack_file(self.cfg.state_dir, spec.name)}

    def _engine_gpus(self, spec: EngineSpec) -> list[int]:
        return list(spec.gpus) if spec.gpus else [self.cfg.gpu_index]

    def _docs(self) -> dict[str, Any]:
        """The control API's documents, for a bundle written while the daemon runs."""
        v = self.views
        return {} if v is None else {"status": v.status(), "engines": v.engines_doc(), "gpus": v.gpus(),
                                     "alerts": v.alerts(), "processes": v.processes_doc()}

    def _build(self) -> Views:
        """The supervisors, the watchers and the views over them (nothing runs yet)."""
        cfg, book = self.cfg, self.book
        preset = PRESETS[cfg.engine]
        self.supervisors = [self._supervisor(spec) for spec in self.specs]
        nvml_stats = NvmlStatsWatcher(self.nvml, book, cfg, demo=self.demo)
        processes = GpuProcessWatcher(
            book, cfg, allowed=tuple(p for pf in self.preflights for p in pf.doctor.allowed_gpu_processes),
            own_pids=lambda: {os.getpid()},
            engines=lambda: [(s.spec, s.pid) for s in self.supervisors], nvml_ok=lambda: self.nvml.ok,
            roots=self._proc_roots, scan=self._scan, nvml_session=self.nvml)
        xid = XidWatcher(self.nvml, book, cfg)
        self._nvml_stats = nvml_stats
        gpm = GpmWatcher(self.nvml, cfg)
        self.watchers = [nvml_stats, processes, xid, gpm]
        engines = []
        for sup, preflight in zip(self.supervisors, self.preflights):
            engines.append(self._engine_parts(sup, preflight, processes, preset))
            self.watchers += [engines[-1].engine_metrics, engines[-1].latency]
            self.watchers += self._fault_watchers(sup, engines[-1].engine_metrics)
            if engines[-1].compute_mode is not None:
                self.watchers.append(engines[-1].compute_mode)
            if self.cfg.preflight:
                self.watchers.append(RecheckWatcher(preflight, cfg.recheck_interval_s))
        if cfg.netlink:
            from zerod.watchers.netlink import NetlinkWatcher  # pyroute2: the daemon's, never doctor's

            hosts = tuple(dict.fromkeys(str(s.section.get("host", "127.0.0.1")) for s in self.specs))
            self.netlink = NetlinkWatcher(book, cfg.watch_interval_s, hosts, self._recheck_bind_exposure)
            self.watchers.append(self.netlink)
        self.registered = build_watchers(self, engines)
        self.watchers += self.registered
        history = HistoryRecorder(cfg.watch_interval_s, lambda: {i: g.as_json() for i, g in list(nvml_stats.gpus.items())},
                                  lambda: [(e.name, e.latency.figures) for e in engines])
        self.watchers.append(history)
        self.views = Views(self.host, self.started_at, cfg.allow_write_actions, book, nvml_stats, xid, processes,
                           self.watchers, engines, history)
        self.views.gpm = gpm
        self.views.diag = DiagService(book, diag_result_path(cfg.state_dir or None),
                                      engines=lambda: [e.status() for e in engines],
                                      **({"command": self._diag_command} if self._diag_command else {}))
        return self.views

    def _recheck_bind_exposure(self) -> None:
        for preflight in self.preflights:
            preflight.recheck_bind_exposure()

    def _engine_parts(self, sup: EngineSupervisor, preflight: Preflight, processes: GpuProcessWatcher,
                      preset) -> EngineView:
        """One engine's watchers: its metrics, its latency (naming the foreign
        processes on its own GPUs), its compute-mode guard."""
        cfg, book, spec = self.cfg, self.book, sup.spec
        engine_metrics = EngineMetricsWatcher(book, cfg, sup.url, engine_pid=lambda: sup.pid,
                                              up=lambda: sup.fig.state == "healthy", series=preset.series,
                                              spec=spec)
        latency = LatencyWatcher(book, cfg, engine_metrics, recent_foreign=lambda: [
            c for c in processes.recent_foreign.values() if not spec.tagged or spec.name in c["engines"]])
        guard = None
        if cfg.exclusive_gpu:
            guard = ComputeModeGuard(self.nvml, book, cfg, engine_pid=lambda: sup.pid,
                                     engine_up=lambda: sup.fig.state == "healthy")
            if spec.tagged:
                guard.name = f"{guard.name}:{spec.name}"
        return EngineView(sup, engine_metrics, latency, preflight, guard)

    def _fault_watchers(self, sup: EngineSupervisor, metrics: EngineMetricsWatcher) -> list[Watcher]:
        """EngineStalled and the canary for one engine (each off at 0 s)."""
        cfg, spec, out = self.cfg, sup.spec, []
        gpus = self._engine_gpus(spec)
        if cfg.stall_after_s > 0:
            stats = self._nvml_stats
            out.append(EngineStallWatcher(
                self.book, cfg, metrics, sup, gpus=lambda: [stats.gpus[i].as_json() for i in gpus if i in stats.gpus],
                stacks_path=self._stack_env(spec).get(STACK_ENV)))
        if cfg.canary_interval_s > 0:
            out.append(CanaryWatcher(self.book, cfg, sup, api_key=self.api_key, gpus=lambda: gpus))
        self.fault_watchers += out
        return out

    # ------------------------------------------------------------------ life cycle
    def _set_status(self, text: str) -> None:
        if text != self._status_text:
            self._status_text = text
            self.notifier.status(text)

    def _on_ready(self) -> None:
        """READY=1 once every engine has been healthy once."""
        if self.ready_at is not None or not all(s._ready_sent for s in self.supervisors):
            return
        self.ready_at = time.time()
        self.recorder.lifecycle("DaemonReady", "ready", f"every engine healthy {self.ready_at - self.started_at:.1f} s "
                                f"after the daemon started")
        text = "; ".join(f"serving {s.model or '?'} at {s.url} (engine{s.named} pid {s.pid})"
                         for s in self.supervisors)
        log.info("ready: %s", text)
        self._status_text = text
        self.notifier.ready(text)

    def _on_signal(self, sig: signal.Signals) -> None:
        name = sig.name
        if self._stop_signal is None:
            self._stop_signal = name
            self._stop.set()
            return
        log.warning("second %s: stopping now, without waiting for the engine to drain", name)
        for s in self.supervisors:
            s.force_stop()

    async def _start_servers(self, views: Views) -> list:
        from aiohttp import web

        from zerod.control_api import bind_unix_socket, make_app
        from zerod.daemon_metrics import make_registry, render

        runners = []
        if self.cfg.metrics_port >= 0:
            registry = make_registry(views)

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
            runners.append(r)
            try:
                await web.TCPSite(r, self.cfg.metrics_host, self.cfg.metrics_port).start()
            except OSError as exc:   # name the port, the setting and who holds it
                holder = port_holder(self.cfg.metrics_port) if exc.errno == errno.EADDRINUSE else ""
                raise OSError(exc.errno, f"/metrics cannot listen on {self.cfg.metrics_host}:"
                              f"{self.cfg.metrics_port} ([daemon] metrics_port): "
                              f"{exc.strerror or exc}{holder}") from None
            addr = r.addresses[0]
            self.metrics_address = (addr[0], addr[1])
            log.info("metrics on http://%s:%d/metrics", self.cfg.metrics_host, addr[1])
        path = self.cfg.control_socket
        sock = bind_unix_socket(path)
        self.control_path = path
        r = web.AppRunner(make_app(views), access_log=None)
        await r.setup()
        runners.append(r)
        await web.SockSite(r, sock).start()
        log.info("control API on unix:%s (mode 0600, %s)", path,
                 "write actions enabled" if self.cfg.allow_write_actions else "read-only")
        return runners

    async def _run_watcher(self, w: Watcher, pool) -> None:
        loop = asyncio.get_running_loop()
        w.last_run_at = time.monotonic()
        if w.delay_first:
            await asyncio.sleep(w.interval_s)
        while True:
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
            await asyncio.sleep(max(0.0, w.interval_s - (time.monotonic() - w.last_run_at)))

    def _progress_ok(self) -> tuple[bool, str]:
        now = time.monotonic()
        for w in self.watchers:
            allowance = max(3 * w.interval_s, 10.0)
            if not w.progressed_within(allowance, now):
                return False, f"watcher {w.name} made no progress for {allowance:.0f} s"
        for s in self.supervisors:
            if now - s.progress_at > max(10.0, 3 * self.cfg.health_timeout_s):
                return False, f"engine{s.named} supervision made no progress"
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
            if self.ready_at is not None and self.supervisors:
                firing = self.book.firing()
                eng = "; ".join(f"engine{s.named} {s.fig.state}" + (f" (pid {s.pid})" if s.pid else "")
                                + f" at {s.url}" for s in self.supervisors)
                names = sorted({a.alertname for a in firing})
                self._set_status(f"{eng}; " + (
                    f"{len(firing)} alert(s) firing: {', '.join(names)}" if firing else "no alerts"))
            await asyncio.sleep(min(1.0, wd_every))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="zerod-watch")
        runners: list = []
        tasks: list[asyncio.Task] = []
        self.recorder.lifecycle("DaemonStarted", "started", f"zerod run (pid {os.getpid()}) started; "
                                f"{len(self.specs)} engine(s): {', '.join(s.name for s in self.specs)}")
        rc = EX_FAIL
        try:
            self._set_status("preflight: reading the host")
            try:
                for preflight in self.preflights:
                    await loop.run_in_executor(pool, preflight.gate)
            except PreflightRefused as exc:
                log.critical("%s", exc)
                self._set_status(str(exc).splitlines()[0])
                rc = EX_CONFIG
                return rc
            if self._stop.is_set():
                log.info("%s during preflight: not starting", self._stop_signal)
                rc = EX_OK
                return rc
            await loop.run_in_executor(pool, self.nvml.ensure)
            views = self._build()
            try:
                runners = await self._start_servers(views)
            except OSError as exc:
                log.critical("cannot open the daemon's endpoints: %s", exc)
                self._set_status(f"cannot open endpoints: {exc}")
                rc = EX_CONFIG
                return rc
            rc = await self._serve(loop, pool, tasks)
            return rc
        finally:
            await self._cleanup(loop, pool, tasks, runners)
            self.recorder.lifecycle("DaemonStopped", "stopped",
                                    f"zerod run stopped ({self._stop_signal or 'no signal'}), exit code {rc}",
                                    severity="info" if rc == EX_OK else "warning")
            await loop.run_in_executor(None, self.recorder.wait, 10.0)  # a bundle being written: finish it
            self.recorder.close()

    async def _serve(self, loop, pool, tasks: list[asyncio.Task]) -> int:
        if self.alerts_cfg.alertmanager_url:
            pusher = AlertmanagerPusher(self.book, self.alerts_cfg.alertmanager_url,
                                        self.alerts_cfg.resend_interval_s, self.alerts_cfg.timeout_s,
                                        self.alerts_cfg.labels, instance=self.host)
            tasks.append(asyncio.create_task(pusher.run(), name="alertmanager"))
        if self.cfg.diag_on_start:  # the watchers and the watchdog run meanwhile; the engines wait for it
            self._first_diag = asyncio.create_task(self._diag_before_engines(), name="diag-on-start")
        tasks += [asyncio.create_task(self._supervise(s), name="supervisor" + s.named.replace(" ", ":"))
                  for s in self.supervisors]
        tasks += [asyncio.create_task(self._run_watcher(w, pool), name=w.name) for w in self.watchers]
        tick = asyncio.create_task(self._tick(), name="tick")
        tasks.append(tick)
        stop_wait = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait([stop_wait, *tasks], return_when=asyncio.FIRST_COMPLETED)
        if stop_wait not in done:
            stop_wait.cancel()
            for t in done:
                exc = t.exception()
                log.critical("internal task %s ended: %r; stopping", t.get_name(), exc,
                             exc_info=(type(exc), exc, exc.__traceback__) if exc else None)
            self.notifier.stopping(f"internal error in {', '.join(t.get_name() for t in done)}")
            await self._stop_engines()
            return EX_FAIL
        tick.cancel()  # the watch loop ends here: no WATCHDOG=1 after STOPPING=1
        again = "Ctrl-C" if self._stop_signal == "SIGINT" else self._stop_signal
        log.info("%s: stopping; the engine gets up to %.0f s to drain (%s again to stop at once)",
                 self._stop_signal, self.cfg.drain_timeout_s, again)
        self.notifier.stopping("stopping: draining the engine")
        self.notifier.extend_timeout(self.cfg.drain_timeout_s + 10)
        await self._stop_engines()
        return EX_OK

    async def _diag_before_engines(self) -> None:
        gpus = sorted({g for spec in self.specs for g in spec.gpus})
        self._set_status(f"zerod diag --level quick on GPU {', '.join(map(str, gpus))} before the engines start")
        await self.views.diag.run("quick", gpus)

    async def _supervise(self, sup: EngineSupervisor) -> None:
        """The engine's supervisor, once the diag on start (if any) has ended, whatever it found
        (a failing test raises GpuDiagFailed; the engine starts all the same)."""
        if self._first_diag is not None:
            await asyncio.shield(self._first_diag)
        await sup.run()

    async def _stop_engines(self) -> None:
        """Every engine drains at once (each within drain_timeout_s)."""
        rcs = await asyncio.gather(*(s.stop() for s in self.supervisors))
        for s, rc in zip(self.supervisors, rcs):
            log.info("engine%s stopped (%s)", s.named, "exit code %s" % rc if rc is not None else "not running")
        log.info("daemon exits")

    async def _cleanup(self, loop, pool, tasks: list[asyncio.Task], runners: list) -> None:
        if self._first_diag is not None:
            tasks.append(self._first_diag)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.views is not None and self.views.diag is not None:
            await self.views.diag.close()
        await asyncio.gather(*(s.stop(drain_timeout_s=5.0) for s in self.supervisors
                               if s.proc and s.proc.poll() is None))
        if self.views is not None:
            for e in self.views.engines:
                if e.compute_mode is not None:  # the engine has stopped: the GPUs get their mode back
                    await loop.run_in_executor(None, e.compute_mode.restore)
                await e.engine_metrics.close()
            for w in self.fault_watchers:
                if isinstance(w, CanaryWatcher):
                    await w.close()
            await loop.run_in_executor(None, self.views.xid.stop)
            for w in self.registered:
                if hasattr(w, "stop"):
                    await loop.run_in_executor(None, w.stop)
            if self.netlink is not None:
                await loop.run_in_executor(None, self.netlink.stop)
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
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
