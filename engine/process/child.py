"""The engine's process: `python -m zerod.engine.process.child FD`, started by
EngineClient with its end of the socket pair as FD. It builds the Engine from the
config the server sends, answers READY (or FAILED, with the reason), then serves the
server's messages until the server says shutdown or its end closes.

Its threads beside the engine's: a reader per server process (link 0's is this module's
main thread; messages in order: a submit before its abort), a sender per server process
(answers, refusals, replies, stats, batched as they come) and the stats pusher. Outputs
leave from the engine's poller thread itself, one message per step record
(OutputPoller.after_record): no hand-off on the way to the first token. Calls that block
(a grammar's compile, an adapter's files, the shutdown's drain) run on a small pool, so
submits and aborts behind them are not held up.

The process ignores SIGINT and SIGTERM: a terminal's Ctrl-C and systemd's stop reach
every process of the group, and the server drives the drain. It ends when the server
closes its end, killed or not.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..config import EngineError, RequestRejected
from ..sampling.structured import GrammarError
from .channel import (ABORT, ACK, ADAPTERS, CALL, EVENTS, FAILED, OUTPUT, READY, REJECTED,
                      REPLY, STATS, STATS_INTERVAL_S, SUBMIT, Channel, RemoteGrammar)

log = logging.getLogger("zerod.engine.process")

# what an engine whose server is gone gets to stop before its process exits anyway
SERVER_GONE_STOP_S = 5.0
# compiled grammars kept for the submits that name them: a request's grammar is
# compiled just before its submit, so the most recent few thousand are plenty
GRAMMARS_KEPT = 4096


def adapters_of(engine) -> list[tuple[str, str, str | None]]:
    """The engine's adapters as /v1/models lists them (no weights cross the pipe)."""
    return [(a.name, a.path, a.base_model_name) for a in engine.lora_adapters()]


def error_of(exc: BaseException) -> tuple[str, str]:
    """An exception as a REPLY carries it: the kind the server side re-raises, the message."""
    for kind in (GrammarError, RequestRejected, EngineError, KeyError):
        if isinstance(exc, kind):
            return kind.__name__, exc.args[0] if kind is KeyError and exc.args else str(exc)
    return "Error", f"{type(exc).__name__}: {exc}"


class Link:
    """One HTTP server process's channel: its own outbound stream and sender thread. The
    keys of its requests in flight are there to abort when it goes."""

    def __init__(self, index: int, chan: Channel):
        self.index = index
        self.chan = chan
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self.outputs: list = []   # the poller's outputs of the record it is on (its thread only)
        self.keys: set[str] = set()
        self.sender = threading.Thread(target=self._send_loop, name=f"zerod-engine-send-{index}",
                                       daemon=True)

    def _send_loop(self) -> None:
        q = self.out
        while True:
            ev = q.get()
            batch = []
            while ev is not None:
                batch.append(ev)
                try:
                    ev = q.get_nowait()
                except queue.Empty:
                    break
            if batch:
                try:
                    self.chan.send((EVENTS, batch))
                except OSError:
                    return   # that server is gone; its reader sees it too
            if ev is None:
                return

    def flush_outputs(self) -> None:
        """The poller's outputs of one record, one message, sent from the poller's thread."""
        if self.outputs:
            batch, self.outputs = self.outputs, []
            try:
                self.chan.send((EVENTS, batch))
            except OSError:
                pass   # that server is gone; its reader sees it too

    def close(self) -> None:
        self.out.put(None)
        self.sender.join(timeout=10)
        self.chan.close()


class EngineHost:
    """The engine's side of the channels: link 0 is the `zerod serve` process that
    started the engine (its CONFIG, its shutdown; the engine stops when it goes), links
    1.. the HTTP server processes beside it (`--api-server-count`)."""

    def __init__(self, engine, chans: list[Channel]):
        self.engine = engine
        self.links = [Link(i, c) for i, c in enumerate(chans)]
        self.rids: dict[str, str] = {}      # a server's key -> the engine's request id
        self._lock = threading.Lock()       # rids and the links' keys: readers and the poller
        self.grammars: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._grammar_ids = itertools.count(1)
        self.calls = ThreadPoolExecutor(4, thread_name_prefix="zerod-engine-call")
        self._stopping = threading.Event()

    # ----------------------------------------------------------------- the servers' messages
    def serve(self) -> None:
        e = self.engine
        e.poller.after_record = self._flush_outputs
        e.start()   # READY's stats then name the step and poller threads
        ready = (READY, dict(
            model_name=e.model_name, model_path=e.model_path, model_dir=str(e.model_dir),
            tokenizer=str(e.config.tokenizer or e.model_dir),
            eos_token_ids=list(e.model_config.eos_token_ids or []),
            max_model_len=e.max_model_len, vocab_size=e.vocab_size,
            ready_seconds=e.ready_seconds, adapters=adapters_of(e), stats=self._stats(e.stats())))
        for link in self.links:
            try:
                link.chan.send(ready)
            except OSError:
                pass   # that server is gone already: its reader sees the channel closed
            link.sender.start()
        threading.Thread(target=self._stats_loop, name="zerod-engine-stats", daemon=True).start()
        for link in self.links[1:]:
            threading.Thread(target=self._read, args=(link,), name=f"zerod-engine-read-{link.index}",
                             daemon=True).start()
        self._read(self.links[0])
        if not self._stopping.is_set():
            # The server is gone (killed, or it exited): nobody is left to serve. A step
            # thread stuck on the device would hold a plain shutdown for its join's 30 s
            # while a restarted engine loads beside it, so this one gets a few seconds.
            log.info("the server's end of the channel closed: stopping the engine")
            self._stopping.set()
            stop = threading.Thread(target=e.shutdown, args=(0,), name="zerod-engine-stop", daemon=True)
            stop.start()
            stop.join(SERVER_GONE_STOP_S)
            if stop.is_alive():
                log.error("the engine did not stop within %.0f s of its server's end; exiting",
                          SERVER_GONE_STOP_S)
                os._exit(1)
        for link in self.links:
            link.close()

    def _read(self, link: Link) -> None:
        e = self.engine
        try:
            while True:
                msg = link.chan.recv()
                kind = msg[0]
                if kind == SUBMIT:
                    self._submit(link, *msg[1:])
                elif kind == ABORT:
                    rid = self.rids.get(msg[1])
                    if rid is not None:
                        e.abort(rid)
                elif kind == CALL:
                    self.calls.submit(self._call, link, *msg[1:])
        except (EOFError, OSError):
            pass   # that server closed its end (or is gone)
        if link.index and not self._stopping.is_set():
            with self._lock:
                gone = [self.rids[k] for k in link.keys if k in self.rids]
            if gone:   # a server that stopped has drained: one with requests left died
                log.warning("HTTP server %d closed its channel: aborting its %d requests",
                            link.index, len(gone))
            else:
                log.info("HTTP server %d closed its channel", link.index)
            for rid in gone:
                e.abort(rid)

    def _submit(self, link: Link, key: str, ids: list[int], params, after: str | None,
                lora: str | None) -> None:
        try:
            if params is not None and isinstance(params.grammar, RemoteGrammar):
                params.grammar = self._grammar(params.grammar.handle)
            done = [False]
            with self._lock:
                rid = self.engine.submit(ids, params, self._on_output(link, key, done),
                                         after=self.rids.get(after) if after else None, lora=lora)
                if not done[0]:
                    self.rids[key] = rid
                    link.keys.add(key)
        except RequestRejected as exc:
            link.out.put((REJECTED, key, exc.status, exc.message, exc.retry_after))
            return
        except Exception as exc:  # noqa: BLE001 - a bug: that client gets a 500, the rest go on
            log.exception("submit of %s failed", key)
            link.out.put((REJECTED, key, 500, f"the engine failed to queue the request: {exc}", None))
            return
        link.out.put((ACK, key))

    def _on_output(self, link: Link, key: str, done: list[bool]):
        rids, keys, lock = self.rids, link.keys, self._lock

        def on_output(out) -> None:   # the engine's poller thread; sent after its record
            out.request_id = key
            if out.finished:
                with lock:
                    done[0] = True
                    rids.pop(key, None)
                    keys.discard(key)
            link.outputs.append((OUTPUT, key, out))

        return on_output

    def _flush_outputs(self) -> None:
        for link in self.links:
            link.flush_outputs()

    def _grammar(self, handle: int):
        with self._lock:   # compiles add and evict on the pool's threads
            compiled = self.grammars.get(handle)
            if compiled is not None:
                self.grammars.move_to_end(handle)
        if compiled is None:
            raise RequestRejected(400, "the request's compiled grammar is no longer held by the "
                                       "engine; send the request again")
        return compiled

    # ----------------------------------------------------------------- calls (pool threads)
    def _call(self, link: Link, call_id: int, method: str, args: tuple) -> None:
        try:
            value, ok = getattr(self, "call_" + method)(*args), True
        except Exception as exc:  # noqa: BLE001 - the caller re-raises it
            value, ok = error_of(exc), False
        link.out.put((REPLY, call_id, ok, value))

    def call_compile(self, spec) -> RemoteGrammar:
        compiled = self.engine.grammar_compiler.compile(spec)
        with self._lock:
            handle = next(self._grammar_ids)
            self.grammars[handle] = compiled
            while len(self.grammars) > GRAMMARS_KEPT:
                self.grammars.popitem(last=False)
        return RemoteGrammar(handle)

    def call_load_lora(self, name: str, path: str) -> list:
        self.engine.load_lora(name, path)
        return self._adapters_changed()

    def call_unload_lora(self, name: str) -> list:
        self.engine.unload_lora(name)
        return self._adapters_changed()

    def _adapters_changed(self) -> list:
        """Every server process lists the adapters now (/v1/models, /health)."""
        adapters = adapters_of(self.engine)
        for link in self.links:
            link.out.put((ADAPTERS, adapters))
        return adapters

    def call_metrics(self) -> bytes:
        return self.engine.metrics_text()

    def call_shutdown(self, drain_timeout: float) -> None:
        self._stopping.set()
        self.engine.shutdown(drain_timeout)   # its last outputs are queued before the reply

    # ----------------------------------------------------------------- statistics
    def _stats(self, st):
        st.engine_pid = os.getpid()
        st.engine_threads = {t.name: t.native_id for t in threading.enumerate()
                             if t.native_id is not None}
        return st

    def _stats_loop(self) -> None:
        while not self._stopping.wait(STATS_INTERVAL_S):
            try:
                ev = (STATS, self._stats(self.engine.stats()))
            except Exception:  # noqa: BLE001 - the servers judge a silent engine stale
                log.exception("engine stats failed")
                continue
            for link in self.links:
                link.out.put(ev)


def _tell(chan: Channel, msg: tuple) -> None:
    try:
        chan.send(msg)
    except OSError:
        pass   # the server is gone: nobody to tell


def main(argv: list[str]) -> int:
    """argv[1]: the channels' descriptors, comma-separated, link 0 first."""
    chans = [Channel(int(fd)) for fd in argv[1].split(",")]
    chan = chans[0]
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        _, config, level, log_format = chan.recv()
    except (EOFError, OSError):
        return 1
    from ..logs import setup_logging
    from ..core.stack_dump import register_from_env

    setup_logging(level, log_format, "zerod-engine")
    register_from_env()   # the daemon's SIGUSR2 reaches the step thread here (/health's engine_pid)
    threading.current_thread().name = "zerod-engine-read"
    try:
        from ..core.engine import Engine

        engine = Engine(config)
    except (EngineError, ValueError, OSError) as exc:
        _tell(chan, (FAILED, str(exc)))
        return 1
    except BaseException as exc:  # noqa: BLE001 - the server says why; the log has the traceback
        log.exception("the engine did not start")
        _tell(chan, (FAILED, f"{type(exc).__name__}: {exc}"))
        return 1
    EngineHost(engine, chans).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
