"""The engine: requests running/waiting, KV pages, output tokens/s, TTFT and ITL."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from zerod.tui.widgets.line import Line, set_title

from zerod.tui import format as fmt
from zerod.tui.widgets.metric import MetricRow
from zerod.tui.widgets.statusbar import ENGINE_STYLE


def _lat(p50: Any, p99: Any, regressed: bool, narrow: bool, normal: Any = None) -> Text:
    first = fmt.ms(p50)
    if narrow and first.endswith(" ms") and fmt.ms(p99).endswith(" ms"):
        first = first[:-3]  # "71.2 p99 400 ms": the unit once, so it fits 80 columns
    t = Text(no_wrap=True)
    t.append(f"{first} ", "")
    t.append("p99 ", "dim")
    t.append(fmt.ms(p99), "bold red" if regressed else "bold")
    if normal is not None and not narrow:  # the learned normal p99 at this load
        t.append(f" (normal {fmt.ms(normal)})", "dim")
    return t


def _counter(t: Text, label: str, value: Any) -> None:
    t.append(f"{label} ", "dim")
    t.append(f"{value if value is not None else fmt.NA}", "bold red" if value else "green")


class EnginePanel(Vertical):
    def compose(self) -> ComposeResult:
        yield MetricRow("reqs", 0.0, None, classes="m-reqs")
        yield MetricRow("KV", 0.0, None, classes="m-kv")
        yield MetricRow("tok/s", 0.0, None, classes="m-tps")
        yield MetricRow("TTFT", 0.0, None, classes="m-ttft")
        yield MetricRow("ITL", 0.0, None, classes="m-itl")
        yield Line("", classes="engine-counters m-alloc")
        yield Line("", classes="engine-counters m-errors")

    def show(self, status: dict[str, Any], engine: dict[str, Any], alerts: dict[str, Any],
             narrow: bool) -> None:
        st = status.get("engine") or {}
        state = st.get("state") or ("healthy" if engine.get("up") else "stopped" if engine else "?")
        # 80 columns leave 34 for the title: there the word "Engine" goes (the rows say
        # what the panel is) and the model, the one field of any length, comes last.
        title = Text("" if narrow else "Engine ")
        if st.get("name") and st.get("of"):  # several engines: which one this is (e picks)
            title.append(f"{st['name']} ({st['of']}) ", "bold reverse")
        title.append(f"● {state}", ENGINE_STYLE.get(state, "bold"))
        if st.get("restarts"):
            title.append(f" · {st.get('restarts')} restarts", "bold yellow")
        if not narrow and st.get("pid"):
            title.append(f" · pid {st.get('pid')}")
        if st.get("kind") and st.get("kind") != "zerod":  # another engine: say which
            title.append(f" · {st.get('kind')}")
        if st.get("model"):
            title.append(f" · {st.get('model')}")
        loras = engine.get("lora_adapters") or []
        if loras:   # LoRA adapters served beside the model
            title.append(f" + {len(loras)} LoRA" if narrow else f" + LoRA {', '.join(loras)}", "dim")
        set_title(self, title)
        firing = {str((a.get("labels") or {}).get("slo", "")) for a in (alerts.get("alerts") or [])
                  if isinstance(a, dict) and a.get("state") == "firing" and a.get("alertname") == "LatencyRegression"}
        h = engine.get("history") or {}
        run, wait = engine.get("running"), engine.get("waiting")
        reqs = Text(no_wrap=True)
        reqs.append(f"{run if run is not None else fmt.NA}", "bold")
        reqs.append(" run ", "dim")
        reqs.append(f"{wait if wait is not None else fmt.NA}", "bold yellow" if wait else "bold")
        reqs.append(" wait", "dim")
        self.query_one(".m-reqs", MetricRow).set(reqs, fmt.series(h.get("running")))
        total, free = fmt.num(engine.get("kv_pages_total")), fmt.num(engine.get("kv_pages_free"))
        if total and free is not None:
            used = total - free
            kv = Text(f"{used:.0f}/{total:.0f} ", no_wrap=True)
            kv.append(f"{used / total * 100:.0f}%", "bold red" if used / total > 0.95 else "bold")
            q, hits = engine.get("prefix_cache_queries_total"), engine.get("prefix_cache_hits_total")
            if q:
                kv.append(f"  cache {hits / q * 100:.0f}% hit", "dim")
        else:
            kv = Text(fmt.NA)
        self.query_one(".m-kv", MetricRow).set(kv, fmt.series(h.get("kv_pages_used")), hi=total)
        self.query_one(".m-tps", MetricRow).set(
            Text(fmt.rate(engine.get("output_tokens_per_s")), "bold"), fmt.series(h.get("output_tokens_per_s")))
        ttft_bad = any("ttft" in s for s in firing)
        itl_bad = any("itl" in s for s in firing)
        self.query_one(".m-ttft", MetricRow).set(
            _lat(engine.get("ttft_p50_s"), engine.get("ttft_p99_s"), ttft_bad, narrow, engine.get("ttft_normal_p99_s")),
            fmt.series(h.get("ttft_p99_s")))
        self.query_one(".m-itl", MetricRow).set(
            _lat(engine.get("itl_p50_s"), engine.get("itl_p99_s"), itl_bad, narrow, engine.get("itl_normal_p99_s")),
            fmt.series(h.get("itl_p99_s")))
        alloc = Text(no_wrap=True, overflow="ellipsis")
        _counter(alloc, "alloc retries", engine.get("allocator_retries_total"))
        alloc.append("  ")
        _counter(alloc, "OOMs", engine.get("allocator_ooms_total"))
        self.query_one(".m-alloc", Line).set(alloc)
        errors = Text(no_wrap=True, overflow="ellipsis")
        _counter(errors, "stream errors", engine.get("stream_errors_total"))
        if engine.get("slow_steps_total") is not None:   # zerod's own engine: its stalls
            steps = engine.get("slow_steps_total")
            errors.append("  slow steps ", "dim")
            errors.append(str(steps), "bold yellow" if steps else "green")
            gap = engine.get("max_itl_s")
            errors.append(f"  longest gap {fmt.ms(gap)}", "bold red" if gap is not None and gap > 0.1 else "")
        if not narrow:
            errors.append("  (sparklines: p99 over time)", "dim")
        self.query_one(".m-errors", Line).set(errors)
        self.set_class(bool(firing), "-alarm")
