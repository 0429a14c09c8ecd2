"""EngineClient: the EngineLike the HTTP server holds when the engine runs in its own
process (child.py). The tokenizer is loaded here too, so prompts are tokenized and chat
templates rendered beside the server's other Python, never in the engine's process.

What crosses the channel and when:
- submit() returns at once with a Future of the request's id: the engine answers ACK, or
  REJECTED with the same status and message the engine in-process would raise (the
  server awaits it before it answers the client);
- outputs arrive on this side's reader thread, which calls each request's on_output as
  the engine's poller does in-process;
- stats() is the engine's last push (every STATS_INTERVAL_S); a push older than
  STALE_AFTER_S (40 pushes) is reported unhealthy, as is an engine process that exited;
- LoRA adapters are known here from the start and from each load and unload through
  this client; grammars compile in the engine's process and come back as handles.

An engine process that exits fails every request in flight (finish_reason "error"),
refuses new ones with 503, leaves /health unhealthy and tells `on_lost` (zerod serve then
exits, and the daemon restarts it).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections import namedtuple
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

from ..config import EngineConfig, EngineError, RequestRejected
from ..core.request import RequestOutput, SamplingParams
from ..interface import EngineStats, SubmitFuture
from ..sampling.structured import GrammarError
from .channel import (ABORT, ACK, ADAPTERS, CALL, CONFIG, EVENTS, FAILED, OUTPUT, READY,
                      REJECTED, REPLY, STATS, SUBMIT, Channel)

log = logging.getLogger("zerod.engine.process")

CHILD_MODULE = "zerod.engine.process.child"
# an engine process whose last stats push is older than this is reported unhealthy
STALE_AFTER_S = 10.0
# what the reply of a call may take (a compile, an adapter's files, /metrics)
CALL_TIMEOUT_S = 120.0

Adapter = namedtuple("Adapter", "name path base_model_name")
_ERRORS = {"GrammarError": GrammarError, "EngineError": EngineError, "KeyError": KeyError}


# each socket's buffer, asked for (the kernel caps it at net.core.wmem_max): a burst's
# submits, long prompts among them, fit without the event loop waiting on a send
SOCKET_BUFFER_BYTES = 8 << 20


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _settle(fut: Future | None, value: Any = None, error: BaseException | None = None) -> None:
    """Answer a waiter that may be gone: none, or cancelled (its client left)."""
    if fut is None:
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except InvalidStateError:
        pass


class RemoteGrammars:
    """The grammar compiler as the server sees it: compile() blocks (off the event loop)
    until the engine's process has compiled the spec, and returns its handle."""

    def __init__(self, client: "EngineClient"):
        self.client = client

    def compile(self, spec: Any) -> Any:
        return self.client.call("compile", spec)


class EngineClient:
    def __init__(self, config: EngineConfig | None, log_level: str = "info", log_format: str = "text",
                 command: list[str] | None = None, servers: int = 1, attach: tuple[int, int] | None = None):
        """Start the engine's process from `config` (command: what starts it, the channels'
        descriptors appended; default this Python, -m CHILD_MODULE; gpu/burst_host.py
        models the device there). servers > 1: channels for that many HTTP server
        processes, the others' ends in `spare_channels` (their processes attach to them).
        attach=(index, fd): an HTTP server process's client of an engine another process
        started, on its channel `fd`."""
        self.config = config
        self.index = attach[0] if attach else 0
        self._ids = itertools.count()
        self._calls = itertools.count()
        self._callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self._acks: dict[str, Future] = {}
        self._replies: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._accepting = True
        self.lost: str | None = None        # why the engine process is gone, once it is
        self.on_lost: Callable[[str], None] | None = None   # told once it is (this reader thread)
        self.proc: subprocess.Popen | None = None
        self.spare_channels: list[socket.socket] = []
        if attach is None:
            pairs = [socket.socketpair() for _ in range(servers)]
            for sock in (x for pair in pairs for x in pair):
                for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                    sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)
            ends = [child.fileno() for _, child in pairs]
            command = command or [sys.executable, "-m", CHILD_MODULE]
            self.proc = subprocess.Popen([*command, ",".join(map(str, ends))], pass_fds=ends)
            for _, child in pairs:
                child.close()
            self.spare_channels = [parent for parent, _ in pairs[1:]]
            self.chan = Channel(pairs[0][0])
            self.chan.send((CONFIG, config, log_level, log_format))
        else:
            self.chan = Channel(attach[1])
        try:
            msg = self.chan.recv()   # the build: seconds to minutes
        except (EOFError, OSError):
            code = self.proc.wait() if self.proc is not None else "?"
            msg = (FAILED, f"the engine process exited with code {code} while starting (its "
                           "log above says why)")
        if msg[0] != READY:
            self._reap()
            raise EngineError(msg[1])
        facts = msg[1]
        from ..tokenizer import Tokenizer

        self.model_name: str = facts["model_name"]
        self.model_path: str = facts["model_path"]
        self.max_model_len: int = facts["max_model_len"]
        self.vocab_size: int = facts["vocab_size"]
        self.ready_seconds: float = facts["ready_seconds"]
        self._adapters = [Adapter(*a) for a in facts["adapters"]]
        self._stats: EngineStats = facts["stats"]
        self._stats_at = time.monotonic()
        self.engine_pid: int = self._stats.engine_pid
        try:
            self.tokenizer = Tokenizer(facts["tokenizer"], extra_eos_ids=facts["eos_token_ids"])
        except BaseException:
            self.shutdown()
            raise
        try:   # before READY, as the engine does in its process: no chat request pays it
            self.tokenizer.compile_chat_template()
        except Exception as exc:  # noqa: BLE001 - a broken one fails its first chat request
            log.warning("the chat template does not compile (%s); chat requests will fail", exc)
        self.grammar_compiler = RemoteGrammars(self)
        self.metrics = None   # the engine's registry lives in its process: metrics_text()
        self._reader = threading.Thread(target=self._read, name="zerod-engine-client", daemon=True)
        self._reader.start()
        if attach is None:
            log.info("the engine runs in its own process, pid %d", self.engine_pid)

    def start(self) -> None:
        """The engine's process starts its step loop once built. Here, as Engine.start
        does in its process: what the server's process has built so far lives as long as
        it does, so it leaves the garbage collector's full passes."""
        gc.collect()
        gc.freeze()

    # ----------------------------------------------------------------- requests
    def submit(self, prompt_ids: list[int], params: SamplingParams | None,
               on_output: Callable[[RequestOutput], None], after: str | None = None,
               lora: str | None = None) -> SubmitFuture:
        """The request's id and, later, the engine's answer (interface.SubmitFuture)."""
        if self.lost is not None:
            raise RequestRejected(503, f"the engine is not healthy: {self.lost}", retry_after=10.0)
        if not self._accepting:
            raise RequestRejected(503, "the engine is shutting down", retry_after=5.0)
        key = f"req-{self.index}.{next(self._ids)}"
        fut = SubmitFuture(key)
        with self._lock:
            self._callbacks[key] = on_output
            self._acks[key] = fut
        try:
            self.chan.send((SUBMIT, key, list(prompt_ids), params, after, lora))
        except OSError as exc:
            self._forget(key)
            raise RequestRejected(503, f"the engine process cannot be reached ({exc})",
                                  retry_after=10.0) from None
        return fut

    def abort(self, request_id: str) -> None:
        if self.lost is None:
            try:
                self.chan.send((ABORT, request_id))
            except OSError:
                pass   # the reader sees the engine gone and ends the request

    def _forget(self, key: str) -> None:
        with self._lock:
            self._callbacks.pop(key, None)
            self._acks.pop(key, None)

    # ----------------------------------------------------------------- calls
    def call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Run `method` in the engine's process and wait for its answer (blocks: off the
        event loop). Its exception comes back as GrammarError, EngineError or KeyError."""
        if self.lost is not None:
            raise EngineError(f"the engine is not running: {self.lost}")
        call_id = next(self._calls)
        fut: Future = Future()
        with self._lock:
            self._replies[call_id] = fut
        self.chan.send((CALL, call_id, method, args))
        try:
            return fut.result(timeout)
        except TimeoutError:
            with self._lock:
                self._replies.pop(call_id, None)
            raise EngineError(f"the engine process did not answer {method} within {timeout:.0f} s") from None

    def lora_adapters(self) -> list[Adapter]:
        return list(self._adapters)

    def load_lora(self, name: str, path: str) -> None:
        self._adapters = [Adapter(*a) for a in self.call("load_lora", name, path)]

    def unload_lora(self, name: str) -> None:
        """Refused here at once (KeyError) or gone from the list at once; the engine's
        process refuses new requests for it from the moment the message reaches it."""
        if not any(a.name == name for a in self._adapters):
            raise KeyError(name)
        self._adapters = [a for a in self._adapters if a.name != name]
        if self.lost is None:
            self.chan.send((CALL, next(self._calls), "unload_lora", (name,)))

    def metrics_text(self) -> bytes:
        return self.call("metrics", timeout=10.0)

    def stats(self) -> EngineStats:
        st = self._stats
        if self.lost is not None:
            return dataclasses.replace(st, healthy=False, error=self.lost, running=0, waiting=0)
        age = time.monotonic() - self._stats_at
        if age > STALE_AFTER_S:
            return dataclasses.replace(st, healthy=False, error=(
                f"the engine process (pid {self.engine_pid}) has sent nothing for {age:.0f} s"))
        return st

    # ----------------------------------------------------------------- the engine's events
    def _read(self) -> None:
        callbacks, acks, replies, lock = self._callbacks, self._acks, self._replies, self._lock
        try:
            while True:
                msg = self.chan.recv()
                if msg[0] != EVENTS:
                    continue
                for ev in msg[1]:
                    kind = ev[0]
                    if kind == OUTPUT:
                        _, key, out = ev
                        cb = callbacks.pop(key, None) if out.finished else callbacks.get(key)
                        if cb is not None:
                            cb(out)
                    elif kind == ACK:
                        _settle(acks.pop(ev[1], None), ev[1])
                    elif kind == REJECTED:
                        _, key, status, message, retry_after = ev
                        with lock:
                            callbacks.pop(key, None)
                            fut = acks.pop(key, None)
                        _settle(fut, error=RequestRejected(status, message, retry_after))
                    elif kind == STATS:
                        self._stats, self._stats_at = ev[1], time.monotonic()
                    elif kind == ADAPTERS:
                        self._adapters = [Adapter(*a) for a in ev[1]]
                    elif kind == REPLY:
                        _, call_id, ok, value = ev
                        with lock:
                            fut = replies.pop(call_id, None)
                        if ok:
                            _settle(fut, value)
                        else:
                            _settle(fut, error=_ERRORS.get(value[0], EngineError)(value[1]))
        except (EOFError, OSError):
            pass
        self._on_lost()

    def _on_lost(self) -> None:
        why = f"the engine process (pid {self.engine_pid}) closed its channel"
        try:
            if self.proc is not None:
                why = f"the engine process (pid {self.engine_pid}) exited with code {self.proc.wait(timeout=2)}"
            elif not _alive(self.engine_pid):
                why = f"the engine process (pid {self.engine_pid}) exited"
        except subprocess.TimeoutExpired:
            pass
        self.lost = why
        if self._accepting:
            log.error("%s: failing %d requests in flight", why, len(self._callbacks))
        with self._lock:
            callbacks, self._callbacks = self._callbacks, {}
            acks, self._acks = self._acks, {}
            replies, self._replies = self._replies, {}
        for key, cb in callbacks.items():
            cb(RequestOutput(key, [], "", True, "error", 0, 0, error=why))
        for fut in acks.values():
            _settle(fut, error=RequestRejected(503, f"the engine is not healthy: {why}", 10.0))
        for fut in replies.values():
            _settle(fut, error=EngineError(why))
        if self._accepting and self.on_lost is not None:
            self.on_lost(why)

    # ----------------------------------------------------------------- stop
    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop admitting; the engine's process drains for up to drain_timeout, then ends
        (an attached server's client only closes its channel: the engine is its starter's)."""
        self._accepting = False
        if self.proc is not None and self.lost is None and self.proc.poll() is None:
            try:
                self.call("shutdown", drain_timeout, timeout=drain_timeout + 60)
            except EngineError as exc:
                log.warning("engine process shutdown: %s", exc)
        self._reap()

    def _reap(self) -> None:
        self.chan.close()   # the engine's process ends when its reader sees this
        for spare in self.spare_channels:
            spare.close()
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("the engine process (pid %d) did not exit; killing it", self.proc.pid)
            self.proc.kill()
            self.proc.wait(5)
