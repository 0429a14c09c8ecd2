"""Who owns which series and alert: each part of the daemon declares its own.

A watcher (or the supervisor, or the preflight) says on its class which metric
families its `collect()` yields and which alerts it raises:

    @owns(metrics=("zerod_gpu_xid_events",),
          alerts=(AlertRule("XidError", "critical", "an Xid event from NVML, with its meaning and action"),))
    class XidWatcher(Watcher): ...

A watcher the daemon does not wire by hand also says how it is built, once per
host or once per engine (node_exporter's collectors: adding one touches one file):

    @owns(alerts=(AlertRule("EngineStalled", "critical", "..."),), per_engine=True)
    class EngineStalledWatcher(Watcher):
        @classmethod
        def build(cls, parts, engine): return cls(parts.book, parts.cfg, engine.supervisor)

`parts` is the daemon (`cfg`, `book`, `nvml`, `demo`, `supervisors`, `preflights`);
`engine` a zerod.views.EngineView (`supervisor`, `engine_metrics`, `latency`,
`preflight`, `compute_mode`, `name`). `build` returns None to stay off (a setting
says so). The daemon polls what it builds like any watcher, yields its `collect()`
on /metrics (families of the same name merged across engines) and calls its
`stop()`, if it has one, on the way out. A per-engine watcher's `name` is a label
of zerod_watcher_runs_total: add the engine's name with several engines.

The list of alert names (`alert_names()`), the alert table of docs/daemon.md
(`alerts_table()`) and prometheus/zerod-rules.yml are generated or checked from
this registry (tests/test_registry.py). Metric names are prometheus_client's
family names (a counter's without `_total`).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

SEVERITIES = ("critical", "warning", "info")
# the parts of the daemon that own series or alerts beside the watchers of zerod.watchers
CORE_OWNERS = ("zerod.supervisor", "zerod.preflight", "zerod.alerts", "zerod.views")


@dataclass(frozen=True)
class AlertRule:
    """An alert a part raises: its name, the severity it usually fires with, what it means."""
    name: str
    severity: str
    meaning: str
    prometheus_rule: bool = True  # False: only the daemon can see it (prometheus/ has no rule for it)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"alert {self.name}: severity {self.severity!r} is not one of {SEVERITIES}")


@dataclass(frozen=True)
class Owner:
    name: str  # module.Class
    cls: type
    metrics: tuple[str, ...]
    alerts: tuple[AlertRule, ...]
    per_host: bool
    per_engine: bool


OWNERS: dict[str, Owner] = {}


def owns(*, metrics: tuple[str, ...] = (), alerts: tuple[AlertRule, ...] = (),
         per_host: bool = False, per_engine: bool = False):
    """Class decorator: the class owns these metric families and alerts. `per_host` /
    `per_engine`: the daemon builds it through its `build` classmethod."""
    if per_host and per_engine:
        raise ValueError("a watcher is built per host or per engine, not both")

    def mark(cls: type) -> type:
        if (per_host or per_engine) and not hasattr(cls, "build"):
            raise TypeError(f"{cls.__qualname__}: per_host/per_engine needs a build classmethod")
        key = f"{cls.__module__}.{cls.__qualname__}"
        OWNERS[key] = Owner(key, cls, tuple(metrics), tuple(alerts), per_host, per_engine)
        return cls

    return mark


def load() -> dict[str, Owner]:
    """Every owner: the core parts and every module of zerod.watchers, imported."""
    import zerod.watchers as pkg

    for name in CORE_OWNERS:
        importlib.import_module(name)
    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{mod.name}")
    return OWNERS


def alert_rules() -> list[AlertRule]:
    # by owner, then as declared: the same order whatever imported the owners first
    rules = [r for _, o in sorted(load().items()) for r in o.alerts]
    seen: dict[str, AlertRule] = {}
    for r in rules:
        if r.name in seen:
            raise ValueError(f"alert {r.name} is registered twice")
        seen[r.name] = r
    return rules


def alert_names() -> tuple[str, ...]:
    return tuple(r.name for r in alert_rules())


def metric_owners() -> dict[str, str]:
    """Metric family -> the owner that yields it."""
    out: dict[str, str] = {}
    for o in load().values():
        for m in o.metrics:
            if m in out:
                raise ValueError(f"metric {m} is registered by {out[m]} and {o.name}")
            out[m] = o.name
    return out


def buildable(per_engine: bool) -> list[Owner]:
    return [o for o in load().values() if (o.per_engine if per_engine else o.per_host)]


def alerts_table() -> str:
    """The alert table of docs/daemon.md."""
    owner_of = {r.name: o.name for o in load().values() for r in o.alerts}
    lines = ["| alert | severity | raised by | meaning |", "|---|---|---|---|"]
    for r in alert_rules():
        lines.append(f"| `{r.name}` | {r.severity} | `{owner_of[r.name]}` | {r.meaning} |")
    return "\n".join(lines) + "\n"


def build_watchers(parts: Any, engines: list[Any]) -> list[Any]:
    """The registered watchers the daemon does not wire by hand: one per host, one per engine."""
    out = [o.cls.build(parts) for o in buildable(per_engine=False)]
    out += [o.cls.build(parts, e) for o in buildable(per_engine=True) for e in engines]
    return [w for w in out if w is not None]


if __name__ == "__main__":  # python -m zerod.registry: print the alert table for docs/daemon.md
    # through the imported module: the owners register there, not in this __main__ copy
    from zerod import registry

    print(registry.alerts_table(), end="")
