"""What the daemon serves: the control API's documents (docs/control-api.md)
and the series of /metrics, both read from the parts' cached snapshots.

The parts (the supervisor, the preflight, the watchers, the alert book) each
own their snapshot and their metric families; this module only puts them
together — the GPU rows and their XID counts meet here, once.

Every engine, one or several ([[engines]]), has its supervisor, metrics and
latency watchers, preflight and compute-mode guard (an `EngineView`); `Views`
holds the list only. The documents for "the engine" are the first engine's, so
a one-engine client reads what it always read, and `?engine=NAME` or
/v1/engines reach the others. Families of the same name from several engines
are merged into one family here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from zerod import __version__
from zerod.alerts import AlertBook
from zerod.engine import metrics as names
from zerod.history import HistoryRecorder
from zerod.preflight import Preflight
from zerod.registry import owns
from zerod.supervisor import EngineSupervisor, collect_engines
from zerod.watchers import Watcher
from zerod.watchers.compute_mode import ComputeModeGuard
from zerod.watchers.engine_metrics import EngineMetricsWatcher
from zerod.watchers.gpu_processes import GpuProcessWatcher
from zerod.watchers.latency import LatencyWatcher
from zerod.watchers.nvml_stats import NvmlStatsWatcher
from zerod.watchers.xid_events import XidWatcher

INFO = "zerod"
PROCESS_SM = "zerod_gpu_process_sm_utilization_ratio"
PROCESS_MEMORY = "zerod_gpu_process_memory_utilization_ratio"
WATCHER_RUNS, WATCHER_ERRORS, WATCHER_BUSY = "zerod_watcher_runs", "zerod_watcher_errors", "zerod_watcher_busy_seconds"
ENGINE_KEYS = ("state", "up", "pid", "kind", "url", "model", "restarts", "numa_node", "cpus")
HISTORY_KEYS = ("output_tokens_per_s", "running", "waiting", "kv_pages_used", "itl_p99_s", "ttft_p99_s")


class NoSuchEngine(LookupError):
    """`?engine=NAME` names no engine of this daemon; the message lists them."""


@dataclass(eq=False)
class EngineView:
    """One supervised engine and the parts that watch it."""
    supervisor: EngineSupervisor
    engine_metrics: EngineMetricsWatcher
    latency: LatencyWatcher
    preflight: Preflight
    compute_mode: ComputeModeGuard | None = None

    @property
    def name(self) -> str:
        return self.supervisor.spec.name

    def status(self) -> dict[str, Any]:
        eng = self.supervisor.snapshot()
        return {"name": self.name, "gpus": eng["gpus"], **{k: eng.get(k) for k in ENGINE_KEYS},
                "preflight": self.preflight.summary()}

    def engine(self) -> dict[str, Any]:
        last = self.engine_metrics.last
        values = last.values if last else {}

        def num(name: str) -> int | None:
            x = values.get(name)
            return int(x) if x is not None else None

        lat = self.latency.snapshot()
        return {
            "up": self.supervisor.fig.state == "healthy", "url": self.supervisor.url,
            "running": num(names.REQUESTS_RUNNING), "waiting": num(names.REQUESTS_WAITING),
            "kv_pages_total": num(names.KV_PAGES_TOTAL), "kv_pages_free": num(names.KV_PAGES_FREE),
            "output_tokens_per_s": lat["output_tokens_per_s"],
            "ttft_p50_s": lat["ttft_p50_s"], "ttft_p99_s": lat["ttft_p99_s"],
            "itl_p50_s": lat["itl_p50_s"], "itl_p99_s": lat["itl_p99_s"],
            "load_bucket": lat["load_bucket"],
            "ttft_normal_p99_s": lat["ttft_normal_p99_s"], "itl_normal_p99_s": lat["itl_normal_p99_s"],
            "allocator_retries_total": num(names.ALLOCATOR_RETRIES_TOTAL),
            "allocator_ooms_total": num(names.ALLOCATOR_OOMS_TOTAL),
            "stream_errors_total": num(names.STREAM_ERRORS_TOTAL),
            # stalls: steps whose launch held the step thread over 10 ms (all reasons), and the
            # longest gap between two tokens of any stream over the engine's last minute
            "slow_steps_total": num(names.SLOW_STEPS_TOTAL),
            "max_itl_s": values.get(names.MAX_ITL_SECONDS),
            "prefix_cache_queries_total": num(names.PREFIX_CACHE_QUERIES_TOTAL),
            "prefix_cache_hits_total": num(names.PREFIX_CACHE_HITS_TOTAL),
            "prefix_cache_pages": num(names.PREFIX_CACHE_PAGES),
            "lora_adapters": list(self.supervisor.lora_adapters),
            "history": {k: lat["history"].get(k, []) for k in HISTORY_KEYS},
        }


def _merged(families):
    """Families of the same name (one per engine) as one: the exposition format
    allows a name once."""
    out: dict[str, Any] = {}
    for fam in families:
        if fam.name in out:
            out[fam.name].samples.extend(fam.samples)
        else:
            out[fam.name] = fam
    return list(out.values())


@owns(metrics=(INFO, PROCESS_SM, PROCESS_MEMORY, WATCHER_RUNS, WATCHER_ERRORS, WATCHER_BUSY))
@dataclass(eq=False)  # compared and hashed by identity: a registry keys on it
class Views:
    host: str
    started_at: float
    allow_write_actions: bool
    book: AlertBook
    nvml_stats: NvmlStatsWatcher
    xid: XidWatcher
    processes: GpuProcessWatcher
    watchers: list[Watcher]
    engines: list[EngineView]  # every engine; the first answers for "the engine"
    history: HistoryRecorder | None = None  # GET /v1/history: the daemon's hour of samples
    diag: Any = None  # zerod.diag.service.DiagService: the last `zerod diag`, runs on request
    gpm: Any = None  # zerod.watchers.nvml_gpm.GpmWatcher (also a watcher: its series come with theirs)

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("the views need at least one engine")

    def find(self, name: str | None) -> EngineView:
        """The engine named `name` (None: the first)."""
        if name is None:
            return self.engines[0]
        for e in self.engines:
            if e.name == name:
                return e
        raise NoSuchEngine(f"no engine named {name!r}; engines: {', '.join(e.name for e in self.engines)}")

    # --- the control API's documents ------------------------------------------
    def status(self) -> dict[str, Any]:
        first = self.engines[0].status()
        return {"version": __version__, "host": self.host, "daemon_pid": os.getpid(),
                "started_at": self.started_at, "uptime_s": round(time.time() - self.started_at, 1),
                "write_actions": self.allow_write_actions, "paused": False,
                "engine": {k: first[k] for k in ENGINE_KEYS}, "preflight": self._preflight_summary(),
                "engines": [e.status() for e in self.engines],
                "diag": self.diag.status() if self.diag is not None else None}

    def _preflight_summary(self) -> dict[str, Any] | None:
        """Every engine's preflight counted together (the worst exit code)."""
        summaries = [e.preflight.summary() for e in self.engines]
        if len(summaries) == 1 or None in summaries:
            return summaries[0]
        out = {k: sum(s[k] for s in summaries) for k in summaries[0] if k not in ("exit_code", "taken_at")}
        return {**out, "exit_code": max(s["exit_code"] for s in summaries),
                "taken_at": max(s["taken_at"] for s in summaries)}

    def checks(self, engine: str | None = None) -> dict[str, Any]:
        return self.find(engine).preflight.checks_doc()

    def engines_doc(self) -> dict[str, Any]:
        return {"engines": [{**e.status(), **e.engine()} for e in self.engines]}

    def gpus(self) -> dict[str, Any]:
        doc = self.nvml_stats.snapshot()
        xids = self.xid.snapshot()
        guards = {id(g): g for g in (e.compute_mode for e in self.engines) if g is not None}
        held: dict[int, dict[str, Any]] = {}
        for g in guards.values():
            held.update(g.snapshot())
        owner = {gpu: e.name for e in self.engines for gpu in e.supervisor.spec.gpus}
        tagged = any(e.supervisor.spec.tagged for e in self.engines)
        for g in doc["gpus"]:
            g["engine"] = owner.get(g["index"]) if tagged else None
            g["xid_events_total"] = xids.get(g["index"], {})
            g["exclusive_gpu"] = held.get(g["index"], {}).get("exclusive_gpu", False)
            g["exclusive_refused"] = held.get(g["index"], {}).get("exclusive_refused")
            if self.gpm is not None:
                g.update(self.gpm.snapshot(g["index"]))
        return doc

    def processes_doc(self) -> dict[str, Any]:
        doc = self.processes.snapshot()
        util = self.nvml_stats.process_utilization
        for row in doc["processes"]:
            sm, mem = util.get(row["gpu"], {}).get(row["pid"], (None, None))
            row["sm_utilization_ratio"], row["memory_utilization_ratio"] = sm, mem
        return doc

    def _process_utilization(self):
        """Per-process SM and memory utilization (NVML's samples) by GPU, role and
        process name: the rows of the process watcher meet NVML's samples here."""
        labels = ["gpu", "uuid", "role", "process"]
        sm = GaugeMetricFamily(PROCESS_SM,
                               "SM utilization of the processes on the GPU (0-1), by role and name.", labels=labels)
        mem = GaugeMetricFamily(PROCESS_MEMORY,
                                "Memory-controller utilization of the processes on the GPU (0-1), by role and name.",
                                labels=labels)
        rows = {r["pid"]: r for r in self.processes.rows}
        for gpu, by_pid in sorted(self.nvml_stats.process_utilization.items()):
            g = self.nvml_stats.gpus.get(gpu)
            if g is None:
                continue
            sums: dict[tuple[str, str], list[float]] = {}
            for pid, (s_ratio, m_ratio) in by_pid.items():
                row = rows.get(pid)
                key = (row["role"], row["name"]) if row else ("unlisted", "?")
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += s_ratio
                acc[1] += m_ratio
            for (role, name), (s_sum, m_sum) in sorted(sums.items()):
                sm.add_metric([str(gpu), g.uuid, role, name], s_sum)
                mem.add_metric([str(gpu), g.uuid, role, name], m_sum)
        yield from (sm, mem)

    def alerts(self) -> dict[str, Any]:
        return {"alerts": [a.to_dict() for a in self.book.all()]}

    def engine(self, engine: str | None = None) -> dict[str, Any]:
        return self.find(engine).engine()

    def foreign_start_time(self, pid: int) -> tuple[bool, float | None]:
        """For the signal action: is `pid` foreign now, and when did it start."""
        return self.processes.foreign_start_time(pid)

    # --- /metrics ---------------------------------------------------------------
    def collect(self):
        yield InfoMetricFamily(INFO, "zerod build information.", value={"version": __version__})
        for part in (self.nvml_stats, self.xid, self.processes, self.book):
            yield from part.collect()
        # the registered watchers beyond these (zerod.registry): their own series, merged across engines
        known = (self.nvml_stats, self.xid, self.processes)
        yield from _merged(f for w in self.watchers if hasattr(w, "collect") and all(w is not k for k in known)
                           for f in w.collect())
        yield from _merged(f for e in self.engines for f in e.preflight.collect())
        yield from collect_engines([e.supervisor for e in self.engines])
        yield from self._process_utilization()
        if self.diag is not None:
            yield from self.diag.collect()
        runs = CounterMetricFamily(WATCHER_RUNS, "Watcher polls.", labels=["watcher"])
        errors = CounterMetricFamily(WATCHER_ERRORS, "Watcher polls that failed.", labels=["watcher"])
        busy = CounterMetricFamily(WATCHER_BUSY, "Wall time spent in watcher polls.",
                                   labels=["watcher"])
        for w in self.watchers:
            runs.add_metric([w.name], float(w.runs))
            errors.add_metric([w.name], float(w.errors))
            busy.add_metric([w.name], float(w.busy_s))
        yield from (runs, errors, busy)
