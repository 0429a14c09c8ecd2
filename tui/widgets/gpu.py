"""Per GPU: utilization, memory, temperature, power with sparklines; clocks, active
throttle reasons, PCIe replays, ECC, XIDs."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from zerod.tui.widgets.line import Line, set_title

from zerod.tui import format as fmt
from zerod.tui.widgets.metric import MetricRow
from zerod.tui.widgets.spark import Spark

# Reasons that cost speed and are not the normal state of a busy GPU.
BAD_REASONS = {"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
INFO_REASONS = {"gpu_idle", "applications_clocks_setting", "sync_boost", "display_clock_setting"}


def grid_clocks_text(g: dict[str, Any]) -> Text:
    """The clocks line of a 40-column grid panel: SM clock, throttle reasons, then only
    the counters that are not zero."""
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("SM ", "dim")
    t.append(f"{g.get('sm_clock_mhz') if g.get('sm_clock_mhz') is not None else fmt.NA} MHz ")
    reasons = [r for r in (g.get("clock_events_active") or []) if isinstance(r, str) and r not in INFO_REASONS]
    if not reasons:
        t.append("no throttle", "green")
    for i, r in enumerate(reasons):
        t.append("," if i else "")
        t.append(r, "bold red" if r in BAD_REASONS else "yellow")
    xids = g.get("xid_events_total") or {}
    if isinstance(xids, dict) and xids:
        t.append(" XID " + " ".join(f"{k}×{v}" for k, v in sorted(xids.items())), "bold red")
    for key, label in (("ecc_volatile_uncorrected", "ECC"), ("pcie_replays_total", "replays")):
        if g.get(key):
            t.append(f" {label} {g.get(key)}", "bold red")
    return t


def clocks_text(g: dict[str, Any], narrow: bool) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("clk ", "dim")
    t.append(f"SM {g.get('sm_clock_mhz') if g.get('sm_clock_mhz') is not None else fmt.NA}"
             f"/mem {g.get('mem_clock_mhz') if g.get('mem_clock_mhz') is not None else fmt.NA} MHz")
    t.append("  throttle ", "dim")
    reasons = [r for r in (g.get("clock_events_active") or []) if isinstance(r, str)]
    if not reasons:
        t.append("none", "green")
    for i, r in enumerate(reasons):
        if i:
            t.append(",")
        t.append(r, "bold red" if r in BAD_REASONS else ("dim" if r in INFO_REASONS else "yellow"))
    replays = g.get("pcie_replays_total")
    ecc = g.get("ecc_volatile_uncorrected")
    xids = g.get("xid_events_total") or {}
    t.append("  PCIe replays " if not narrow else "  replays ", "dim")
    t.append(str(replays if replays is not None else fmt.NA), "bold red" if replays else "")
    t.append("  ECC ", "dim")
    t.append(str(ecc if ecc is not None else fmt.NA), "bold red" if ecc else "")
    t.append("  XID ", "dim")
    if isinstance(xids, dict) and xids:
        t.append(" ".join(f"{k}×{v}" for k, v in sorted(xids.items())), "bold red")
    else:
        t.append("none", "green")
    return t


class GpuPanel(Vertical):
    def __init__(self, index: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.index = index

    def compose(self) -> ComposeResult:
        with Grid(classes="gpu-metrics"):
            yield MetricRow("util", 0.0, 1.0, classes="m-util")
            yield MetricRow("temp", classes="m-temp")
            yield MetricRow("mem", 0.0, None, classes="m-mem")
            yield MetricRow("power", 0.0, None, classes="m-power")
        yield Line("", classes="gpu-clocks")

    def show(self, g: dict[str, Any], narrow: bool) -> None:
        uuid = str(g.get("uuid") or "")
        set_title(self, f"GPU {g.get('index', '?')} · {g.get('name') or '?'}" + (
            f" · {uuid[:12]}…" if uuid and not narrow else ""))
        h = g.get("history") or {}
        util = fmt.num(g.get("utilization_ratio"))
        self.query_one(".m-util", MetricRow).set(
            Text(fmt.pct(util), "bold" if util is not None and util > 0.9 else ""),
            fmt.series(h.get("utilization_ratio")))
        temp = fmt.num(g.get("temperature_celsius"))
        self.query_one(".m-temp", MetricRow).set(
            Text(f"{temp:.0f} °C" if temp is not None else fmt.NA, "bold red" if (temp or 0) >= 85 else ""),
            fmt.series(h.get("temperature_celsius")))
        total = fmt.num(g.get("memory_total_bytes"))
        self.query_one(".m-mem", MetricRow).set(
            f"{fmt.gib(g.get('memory_used_bytes'))}/{fmt.gib(total)} GiB",
            fmt.series(h.get("memory_used_bytes")), hi=total)
        limit = fmt.num(g.get("power_limit_watts"))
        power = fmt.num(g.get("power_watts"))
        self.query_one(".m-power", MetricRow).set(
            f"{power:.0f}/{limit:.0f} W" if power is not None and limit else
            (f"{power:.0f} W" if power is not None else fmt.NA),
            fmt.series(h.get("power_watts")), hi=limit)
        grid = self.parent is not None and self.parent.has_class("-grid")
        self.query_one(".gpu-clocks", Line).set(grid_clocks_text(g) if grid else clocks_text(g, narrow))
        bad = any(r in BAD_REASONS for r in (g.get("clock_events_active") or []))
        self.set_class(bad or bool(g.get("ecc_volatile_uncorrected")), "-alarm")


def gpu_row_text(g: dict[str, Any], narrow: bool) -> Text:
    """One GPU on one line (hosts with several GPUs)."""
    t = Text(no_wrap=True, overflow="ellipsis")
    util = fmt.num(g.get("utilization_ratio"))
    t.append(f"{fmt.pct(util):>4}", "bold" if util is not None and util > 0.9 else "")
    t.append("  mem ", "dim")
    t.append(f"{fmt.gib(g.get('memory_used_bytes'))}/{fmt.gib(g.get('memory_total_bytes'))}G")
    temp = fmt.num(g.get("temperature_celsius"))
    t.append("  ")
    t.append(f"{temp:.0f}°C" if temp is not None else fmt.NA, "bold red" if (temp or 0) >= 85 else "")
    power, limit = fmt.num(g.get("power_watts")), fmt.num(g.get("power_limit_watts"))
    t.append("  ")
    t.append(f"{power:.0f}/{limit:.0f}W" if power is not None and limit else
             (f"{power:.0f}W" if power is not None else fmt.NA))
    reasons = [r for r in (g.get("clock_events_active") or []) if isinstance(r, str)]
    bad = [r for r in reasons if r in BAD_REASONS]
    if bad:
        t.append("  " + ",".join(bad), "bold red")
    elif reasons and not narrow:
        t.append("  " + ",".join(r for r in reasons if r not in INFO_REASONS), "yellow")
    xids = g.get("xid_events_total") or {}
    if isinstance(xids, dict) and xids:
        t.append("  XID " + " ".join(f"{k}×{v}" for k, v in sorted(xids.items())), "bold red")
    if g.get("ecc_volatile_uncorrected"):
        t.append(f"  ECC {g.get('ecc_volatile_uncorrected')}", "bold red")
    if g.get("pcie_replays_total"):
        t.append(f"  replays {g.get('pcie_replays_total')}", "bold red")
    if not narrow:
        t.append(f"  SM {g.get('sm_clock_mhz') if g.get('sm_clock_mhz') is not None else fmt.NA}MHz", "dim")
    return t


class GpuRow(Horizontal):
    """Compact form: label, utilization sparkline, the rest as text."""

    def __init__(self, index: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.index = index

    def compose(self) -> ComposeResult:
        yield Line("", classes="gpu-row-label")
        yield Spark(0.0, 1.0, classes="gpu-row-spark")
        yield Line("", classes="gpu-row-value")

    def show(self, g: dict[str, Any], narrow: bool) -> None:
        self.query_one(".gpu-row-label", Line).set(Text(f"GPU {g.get('index', '?')}", "bold"))
        self.query_one(Spark).set(fmt.series((g.get("history") or {}).get("utilization_ratio")))
        self.query_one(".gpu-row-value", Line).set(gpu_row_text(g, narrow))
        bad = any(r in BAD_REASONS for r in (g.get("clock_events_active") or []))
        self.set_class(bad or bool(g.get("ecc_volatile_uncorrected")), "-alarm")


GRID_FROM = (150, 44)  # columns, rows from which 3-8 GPUs get a panel each, four across
GRID_MAX = 8


def grid_fits(n_gpus: int, width: int, height: int) -> bool:
    return 2 < n_gpus <= GRID_MAX and width >= GRID_FROM[0] and height >= GRID_FROM[1]


class GpuList(VerticalScroll):
    """One GpuPanel per GPU on hosts with one or two GPUs (one at 80 columns), and on
    hosts with up to eight from 150×44 on (a grid four across, each metric on its own
    line); one GpuRow per GPU inside a single border otherwise. A line of its own when
    NVML is unavailable."""

    chosen: set[int] = set()

    def compose(self) -> ComposeResult:
        yield Line("waiting for the daemon…", classes="gpu-note")

    def show(self, gpus: dict[str, Any], narrow: bool, chosen: set[int] | None = None) -> None:
        """`chosen`: the GPUs of the engine the Engine panel shows, highlighted (several engines)."""
        self.chosen = chosen or set()
        items = [g for g in (gpus.get("gpus") or []) if isinstance(g, dict)]
        nvml = gpus.get("nvml") or {}
        note = self.query_one(".gpu-note", Line)
        if nvml and not nvml.get("ok"):
            note.set(Text(f"NVML unavailable: {nvml.get('error') or 'unknown error'}", "bold red"))
            note.display = True
        elif not items:
            note.set(Text("no GPUs reported", "dim"))
            note.display = True
        else:
            note.display = False
        grid = grid_fits(len(items), self.app.size.width, self.app.size.height)
        compact = len(items) > (1 if narrow else 2) and not grid
        kind = GpuRow if compact else GpuPanel
        self.set_class(compact, "-compact")
        self.set_class(grid, "-grid")
        narrow = narrow or grid  # a grid panel is 40 columns wide
        if compact:
            set_title(self, f"GPUs ({len(items)}) · utilization over time, then now")
        current = list(self.query(kind))
        others = list(self.query(GpuRow if kind is GpuPanel else GpuPanel))
        if others or [p.index for p in current] != [g.get("index") for g in items]:
            for p in current + others:
                p.remove()
            fresh = [kind(g.get("index"), classes="gpu-panel" if kind is GpuPanel else "gpu-row")
                     for g in items]
            if fresh:
                self.mount_all(fresh)
            # Freshly mounted widgets compose on the next tick; fill them then.
            self.call_after_refresh(self._fill, kind, items, narrow)
            return
        self._fill(kind, items, narrow)

    def _fill(self, kind, items, narrow) -> None:
        for w, g in zip(self.query(kind), items):
            w.show(g, narrow)
            w.set_class(g.get("index") in self.chosen, "-chosen")
