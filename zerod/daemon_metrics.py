"""The daemon's /metrics: a registry over the views (each part yields its own
families from its snapshot at scrape time: nothing updates a gauge from a
loop) plus the process collector. Names in docs/daemon.md; GPU series carry
`gpu` (index) and `uuid`; never a pid.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.process_collector import ProcessCollector

from zerod.engine.metrics import build_info  # also turns _created series off, process-wide
from zerod.views import Views


def make_registry(views: Views) -> CollectorRegistry:
    # auto_describe=False: registering does not scrape once to learn the names
    reg = CollectorRegistry(auto_describe=False)
    reg.register(views)
    ProcessCollector(registry=reg, namespace="zerod")  # zerod_process_cpu_seconds_total …
    build_info(reg, "daemon")
    return reg


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
