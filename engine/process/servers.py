"""`zerod serve --api-server-count N`: N HTTP server processes on one port, one engine.

The process `zerod serve` started binds the port, starts the engine's process with a
channel for each HTTP server (client.EngineClient, servers=N), then starts N - 1 more
`zerod serve` processes with the same command line. Each finds ZEROD_API_SERVER in its
environment: which server it is, its channel to the engine and the listening socket,
all inherited. Every process accepts on the one socket, so the kernel hands each new
connection to whichever is free; each runs its own event loop under its own GIL, so a
burst's requests are parsed, validated and tokenized side by side.

The first process is the one the daemon supervises. On its stop (SIGTERM, SIGINT) it
passes SIGTERM on to the others, drains its own requests, waits for theirs, then stops
the engine. One that exits early is logged; the others serve on. The others die with the
first (PR_SET_PDEATHSIG), so none outlives it on the port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass

from ..prctl import kill_with_parent

log = logging.getLogger("zerod.engine.process")

ENV = "ZEROD_API_SERVER"   # "INDEX:CHANNEL_FD:LISTEN_FD:READY_FD:PARENT", for the servers after the first
READY_WAIT_S = 120.0        # what the first process waits for the others to listen


@dataclass(frozen=True)
class Attached:
    index: int
    channel_fd: int
    listen_fd: int
    ready_fd: int
    parent: int

    def die_with_parent(self) -> None:
        """This process ends with the first one, killed or not (PR_SET_PDEATHSIG): no HTTP
        server outlives it on the port."""
        kill_with_parent()
        if os.getppid() != self.parent:     # it died before the prctl took effect
            os._exit(1)

    def ready(self) -> None:
        """Tell the first process this one listens."""
        try:
            os.write(self.ready_fd, b"1")
            os.close(self.ready_fd)
        except OSError:
            pass


def attached(env: dict[str, str] | None = None) -> Attached | None:
    """This process's place among the HTTP servers, None for the first (or only) one."""
    v = (os.environ if env is None else env).get(ENV, "")
    if not v:
        return None
    try:
        index, chan, listen, ready, parent = (int(x) for x in v.split(":"))
    except ValueError:
        raise ValueError(f"{ENV}={v!r} is not INDEX:CHANNEL_FD:LISTEN_FD:READY_FD:PARENT (zerod "
                         "serve sets it for its own server processes, not by hand)") from None
    return Attached(index, chan, listen, ready, parent)


def ignore_further_stops() -> None:
    """In one of the other server processes, once its stop has come (on its event loop):
    a second SIGTERM (systemd's to the whole group beside the first process's) changes
    nothing, and one landing while the loop closes would find its wakeup pipe gone."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)


class ServerProcesses:
    """The HTTP server processes after the first: started, watched, stopped."""

    def __init__(self, argv: list[str], channels: list[socket.socket], listen: socket.socket):
        self.procs: list[subprocess.Popen] = []
        self.stopping = False
        self._ready: list[int] = []
        for i, chan in enumerate(channels, start=1):
            r, w = os.pipe()
            env = {**os.environ, ENV: f"{i}:{chan.fileno()}:{listen.fileno()}:{w}:{os.getpid()}"}
            self.procs.append(subprocess.Popen([sys.executable, "-m", "zerod", "serve", *argv],
                                               env=env, pass_fds=(chan.fileno(), listen.fileno(), w),
                                               stdin=subprocess.DEVNULL))
            chan.close()   # its process holds these now
            os.close(w)
            self._ready.append(r)
        for i, p in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(i, p), name=f"zerod-api-watch-{i}",
                             daemon=True).start()
        log.info("HTTP server processes beside this one: pids %s", [p.pid for p in self.procs])

    def wait_ready(self, timeout: float = READY_WAIT_S) -> None:
        """Until each listens (or has exited, or the time is up): the first process
        listens last, so its /health answering means every process serves."""
        import select
        import time

        deadline = time.monotonic() + timeout
        waiting = list(self._ready)
        while waiting and time.monotonic() < deadline:
            done, _, _ = select.select(waiting, [], [], max(0.0, deadline - time.monotonic()))
            for r in done:   # a byte, or EOF from a process that exited first
                os.read(r, 1)
                os.close(r)
                waiting.remove(r)
        for r in waiting:
            os.close(r)
        if waiting:
            log.warning("%d HTTP server process(es) not listening after %.0f s; serving without them",
                        len(waiting), timeout)

    def _watch(self, index: int, p: subprocess.Popen) -> None:
        code = p.wait()
        if not self.stopping:
            log.error("HTTP server process %d (pid %d) exited with code %d; the others serve on",
                      index, p.pid, code)

    def terminate(self) -> None:
        """SIGTERM to each, once: they drain as this one does."""
        if self.stopping:
            return
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def wait(self, timeout: float) -> None:
        self.terminate()
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("HTTP server process pid %d did not stop; killing it", p.pid)
                p.kill()
                p.wait(5)
