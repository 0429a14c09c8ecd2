"""The banner shown while the daemon cannot be reached."""

from __future__ import annotations

from rich.text import Text
from zerod.tui.widgets.line import Line

from zerod.tui import format as fmt


def banner_text(socket_path: str, error: str, *, now: float, down_since: float,
                last_ok: float | None, interval: float) -> Text:
    t = Text()
    t.append("⚠ Cannot reach the zerod daemon at ", "bold")
    t.append(socket_path, "bold underline")
    t.append(f": {error}")
    t.append(f"\n  retrying every {interval:g}s; down for {fmt.duration(now - down_since)}", "dim")
    if last_ok is not None:
        t.append(f"; the panels below show data from {fmt.ago(last_ok, now)}", "dim")
    return t


# how to start the daemon, in the standalone banner and `zerod top --once`
START_HINT = "sudo systemctl start zerod   (or: zerod run --config /etc/zerod/zerod.toml)"


def standalone_text(socket_path: str, error: str, *, nvml_error: str | None, report_at: float | None,
                    now: float, start_hint: str) -> Text:
    """The banner of standalone mode: no daemon, so this host read directly."""
    t = Text()
    t.append("⚠ The zerod daemon is not running", "bold")
    t.append(f" ({socket_path}: {error}).\n")
    t.append("  Start it: ", "dim")
    t.append(start_hint, "bold")
    t.append("\n  Showing this host read directly: GPUs, GPU processes, ", "dim")
    t.append(f"doctor's last report ({fmt.ago(report_at, now)})" if report_at is not None
             else "no doctor report yet (run `zerod doctor`)", "dim")
    t.append("; no engine figures and no alerts without the daemon.", "dim")
    if nvml_error:
        t.append("\n  No NVIDIA GPU to show: ", "bold red")
        t.append(nvml_error, "red")
    return t


class Banner(Line):
    pass
