"""Who holds a TCP port: said when a bind fails with EADDRINUSE, by the engine
(`zerod serve`) and the daemon (its /metrics) alike. It stands in the engine's room
because the engine imports nothing of the daemon, while the daemon may import the
engine's shared parts. psutil only: no heavy import."""

from __future__ import annotations


def port_holder(port: int) -> str:
    """' (held by pid 123, python3)' when the listening process is visible, else ''."""
    try:
        import psutil

        for c in psutil.net_connections(kind="inet"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN:
                if c.pid is None:
                    return " (held by a process of another user)"
                try:
                    return f" (held by pid {c.pid}, {psutil.Process(c.pid).name()})"
                except psutil.Error:
                    return f" (held by pid {c.pid})"
    except Exception:  # noqa: BLE001 - naming the holder is a courtesy, never an error
        pass
    return ""
