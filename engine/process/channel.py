"""The messages between the HTTP server's process and the engine's, over a socket pair.

Each message is a tuple whose first item is one of the tags below; pickled whole by
multiprocessing's Connection. Each side reads on one thread and sends under one lock.

Server -> engine:
  (CONFIG, EngineConfig, log_level, log_format)        once, first
  (SUBMIT, key, prompt_ids, params, after_key, lora)   params.grammar: a GRAMMAR handle
  (ABORT, key)
  (CALL, call_id, method, args)                        answered by a REPLY
Engine -> server:
  (READY, facts) | (FAILED, message)                    once, after the build
  (EVENTS, [event, ...])                                one ordered stream, batched as it comes:
      (OUTPUT, key, RequestOutput) | (ACK, key) | (REJECTED, key, status, message, retry_after)
      | (STATS, EngineStats) | (REPLY, call_id, ok, value)   value: the result, or (kind, message)
      | (ADAPTERS, [(name, path, base_model_name), ...])    after a load or unload, to every server

A request's key is the server's own id for it (the engine's ids stay in its process);
with several server processes (`--api-server-count`), each has its own channel and keys.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection

CONFIG, SUBMIT, ABORT, CALL = "config", "submit", "abort", "call"
READY, FAILED, EVENTS, REPLY = "ready", "failed", "events", "reply"
OUTPUT, ACK, REJECTED, STATS, ADAPTERS = "output", "ack", "rejected", "stats", "adapters"

# the child's statistics, pushed this often: what /health and the daemon read of it
STATS_INTERVAL_S = 0.25


class Channel:
    """One end of the pair: send() from any thread, recv() from one."""

    def __init__(self, sock_or_fd: socket.socket | int):
        fd = sock_or_fd.detach() if isinstance(sock_or_fd, socket.socket) else sock_or_fd
        self.fd = fd
        self.conn = Connection(fd)
        self._lock = threading.Lock()

    def send(self, msg: tuple) -> None:
        with self._lock:
            self.conn.send(msg)

    def recv(self) -> tuple:
        return self.conn.recv()

    def close(self) -> None:
        """Both directions shut first: that wakes a recv() blocked on another thread (a
        bare close does not) and the other end reads EOF."""
        try:
            with socket.socket(fileno=os.dup(self.fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.conn.close()
        except OSError:
            pass


@dataclass(frozen=True)
class RemoteGrammar:
    """A grammar compiled in the engine's process, as the server holds it: the handle a
    submit's SamplingParams.grammar carries back."""
    handle: int
