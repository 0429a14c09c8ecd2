"""The output side: the pinned host ring and the output poller thread.

The step loop copies each step's sampled token ids into one slot of a pinned host ring
(non_blocking) and records a CUDA event; it then hands the poller a StepRecord. The
poller waits on the event (a blocking-sync event: it sleeps, it does not spin), reads the
ids, detokenizes, applies stop ids / stop strings / max_tokens, observes the metrics and
calls each request's on_output. On the CPU the same code runs with no-op events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..prctl import set_os_thread_name
from ..sampling import prompt_logprobs
from ..sampling.logprobs import MAX_LOGPROBS, TokenLogprob, rows_from_host
from .request import Request, RequestOutput
from ..tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("zerod.engine")


@dataclass
class LogprobSegment:
    """Logprob rows of one step, laid out contiguously in a ring slot's lp buffers:
    row i of `rows` (ring rows, i.e. indices into the step's rows) has values
    lp_vals[val_off + i*(k+1) : ...+k+1] and ids lp_ids[id_off + i*k : ...+k]."""
    rows: list[int]
    k: int
    val_off: int
    id_off: int


class HostRing:
    """depth slots of pinned int64 token ids, plus a free-slot queue for backpressure.

    Beside them, per slot, room for every row's logprobs (1 + MAX_LOGPROBS floats and
    MAX_LOGPROBS ids): a step copies into it only the rows that asked for logprobs, so
    the plain path's copy stays the sampled ids alone. `segments[slot]` says what the
    step that filled the slot put there (written by the step loop before the poller
    sees the slot, read by the poller after the step's event).

    Prompt logprobs (prompt_logprobs.py) have their own buffers, room for `prompt_rows`
    rows per slot, allocated on first use (a server whose clients never ask pays nothing);
    `prompt[slot]` is the PromptRows the step put there, or None."""

    def __init__(self, depth: int, rows: int, device: torch.device, prompt_rows: int = 0):
        self.cuda = device.type == "cuda"
        self.depth, self.prompt_rows = depth, prompt_rows
        self.prompt: list[prompt_logprobs.PromptRows | None] = [None] * depth
        self._plp: tuple[torch.Tensor, torch.Tensor] | None = None
        self.tokens = torch.zeros(depth, rows, dtype=torch.int64, pin_memory=self.cuda)
        self.lp_vals = torch.zeros(depth, rows * (1 + MAX_LOGPROBS), dtype=torch.float32,
                                   pin_memory=self.cuda)
        self.lp_ids = torch.zeros(depth, rows * MAX_LOGPROBS, dtype=torch.int64, pin_memory=self.cuda)
        self.segments: list[list[LogprobSegment]] = [[] for _ in range(depth)]
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(depth):
            self.free.put(i)

    def prompt_buffers(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot's prompt-logprob buffers: float32 values, int64 ids (rows x (k+2), rows x k)."""
        if self._plp is None:
            n = self.prompt_rows
            self._plp = (torch.zeros(self.depth, n * (MAX_LOGPROBS + 2), dtype=torch.float32,
                                     pin_memory=self.cuda),
                         torch.zeros(self.depth, n * MAX_LOGPROBS, dtype=torch.int64,
                                     pin_memory=self.cuda))
        return self._plp[0][slot], self._plp[1][slot]

    def event(self):
        if self.cuda:
            return torch.cuda.Event(blocking=True, enable_timing=True)
        return None


@dataclass
class StepRecord:
    ring_idx: int
    rows: list[Request]
    start: object            # CUDA event or perf_counter() float
    end: object              # CUDA event or perf_counter() float
    prefill_tokens: int = 0  # what the step ran, for the step-cost model
    decodes: int = 0
    shape: dict | None = None  # the step trace's fields (step_trace.py), when tracing
    launch_s: float = 0.0      # host time of the launch


@dataclass
class FinishRecord:
    req: Request
    reason: str              # abort | error
    error: str | None = None


class OutputPoller(threading.Thread):
    def __init__(self, tokenizer: Tokenizer, ring: HostRing, metrics, notify_stop: Callable[[Request], None],
                 on_stream_error: Callable[[BaseException], None],
                 on_step_time: Callable[[int, int, float], None] = lambda p, d, s: None,
                 trace=None):
        super().__init__(name="zerod-poller", daemon=True)
        self.tok = tokenizer
        self.ring = ring
        self.metrics = metrics
        self.notify_stop = notify_stop
        self.on_stream_error = on_stream_error
        self.on_step_time = on_step_time
        self.trace = trace          # step_trace.StepTrace, or None
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.eos = set(tokenizer.eos_token_ids)
        self.inflight = 0           # records queued and not yet handled
        self.last_step: dict | None = None
        # called on this thread after each record's outputs, before it counts as handled:
        # an engine in its own process sends the record's outputs from here, in one message
        # and without a hand-off to another thread (engine/process/child.py)
        self.after_record: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def put(self, rec) -> None:
        with self._lock:
            self.inflight += 1
        self.q.put(rec)

    def stop(self) -> None:
        self.q.put(None)

    # ------------------------------------------------------------------ thread
    def run(self) -> None:
        set_os_thread_name(self.name)
        while True:
            rec = self.q.get()
            if rec is None:
                return
            try:
                if isinstance(rec, StepRecord):
                    self._step(rec)
                else:
                    self._finish(rec.req, rec.reason, error=rec.error)
            except Exception:  # noqa: BLE001 - the poller must survive anything
                log.exception("output poller: unexpected error")
            finally:
                if self.after_record is not None:
                    try:
                        self.after_record()
                    except Exception:  # noqa: BLE001
                        log.exception("output poller: after_record failed")
                with self._lock:
                    self.inflight -= 1

    def _step(self, rec: StepRecord) -> None:
        n = len(rec.rows)
        if self.ring.cuda:
            try:
                rec.end.synchronize()
                step_s = rec.start.elapsed_time(rec.end) / 1000.0
            except Exception as exc:  # noqa: BLE001 - a CUDA error surfaced by the event
                self.ring.free.put(rec.ring_idx)
                self.on_stream_error(exc)
                for r in rec.rows:
                    self._finish(r, "error", error=f"CUDA error: {exc}")
                return
        else:
            step_s = rec.end - rec.start
        toks = self.ring.tokens[rec.ring_idx, :n].tolist()
        lps = self._logprobs(rec.ring_idx, rec.rows, toks)
        prompt_rows = self.ring.prompt[rec.ring_idx]
        if prompt_rows is not None:   # before the tokens: a first output carries them
            prompt_logprobs.gather(prompt_rows, *self.ring.prompt_buffers(rec.ring_idx))
        self.ring.free.put(rec.ring_idx)
        self.metrics.step_seconds.observe(step_s)
        self.metrics.iteration_tokens.observe(rec.prefill_tokens + rec.decodes)
        if step_s > 0.25:
            log.info("a step took %.0f ms (%d prompt tokens, %d decodes)", step_s * 1000,
                     rec.prefill_tokens, rec.decodes)
        self.on_step_time(rec.prefill_tokens, rec.decodes, step_s)
        if self.trace is not None and rec.shape is not None:
            self.trace.step(rec.shape, rec.launch_s, step_s)
        # the last step's shape, in /health: what a stalled engine was doing last
        self.last_step = {"rows": n, "prefill_tokens": rec.prefill_tokens, "decodes": rec.decodes,
                          "seconds": round(step_s, 6), "at": time.time()}
        now = time.monotonic()
        gen = 0
        gaps: list[float] = []        # the metered rows' inter-token gaps, observed once a step
        for i, (r, t) in enumerate(zip(rec.rows, toks)):
            if not r.finished:
                gen += not r.params.unmetered
                self._token(r, t, now, gaps, lps.get(i) if lps else None)
        if gen:
            self.metrics.generation_tokens.inc(gen)
        if gaps:
            self.metrics.itl.observe_many(gaps)
            self.metrics.max_itl.observe(max(gaps))

    def _logprobs(self, ring_idx: int, rows: list[Request], toks: list[int]) -> dict[int, TokenLogprob]:
        """The step's logprob rows, by ring row (empty when no row asked)."""
        out: dict[int, TokenLogprob] = {}
        for seg in self.ring.segments[ring_idx]:
            n, k = len(seg.rows), seg.k
            vals = self.ring.lp_vals[ring_idx, seg.val_off:seg.val_off + n * (k + 1)].view(n, k + 1).tolist()
            ids = self.ring.lp_ids[ring_idx, seg.id_off:seg.id_off + n * k].view(n, k).tolist()
            chosen = [toks[i] for i in seg.rows]
            ks = [rows[i].params.logprobs for i in seg.rows]   # each its own k <= the segment's
            out.update(zip(seg.rows, rows_from_host(chosen, vals, ids, ks)))
        return out

    # ------------------------------------------------------------------ per token
    def _token(self, r: Request, tok: int, now: float, gaps: list[float],
               lp: TokenLogprob | None = None) -> None:
        p = r.params
        if r.first_token_at is None:
            r.first_token_at = now
            if not p.unmetered:
                self.metrics.ttft.observe(now - r.arrival)
                self.metrics.prompt_tokens.inc(r.prompt_len)
            r.detok = IncrementalDetokenizer(self.tok, r.prompt_ids, p.skip_special_tokens)
        elif not p.unmetered:
            gaps.append(now - r.last_token_at)
        r.last_token_at = now
        r.out_ids.append(tok)
        n = len(r.out_ids)
        is_stop_tok = n > p.min_tokens and ((not p.ignore_eos and tok in self.eos) or tok in p.stop_token_ids)
        if is_stop_tok:
            text = r.pending + r.detok.flush()
            r.pending = ""
            self._emit(r, [tok], text, "stop", lp=lp)
            self.notify_stop(r)
            return
        piece = r.detok.add(tok)
        text = r.pending + piece
        reason = None
        if p.stop and n > p.min_tokens:
            hit, end = -1, -1
            for s in p.stop:
                i = text.find(s)
                if i >= 0 and (hit < 0 or i < hit):
                    hit, end = i, i + len(s)
            if hit >= 0:
                r.pending = ""
                self._emit(r, [tok], text[:end if p.include_stop_str_in_output else hit], "stop", lp=lp)
                self.notify_stop(r)
                return
        if n >= r.max_tokens:
            text += r.detok.flush()
            r.pending = ""
            reason = "length"
        elif p.stop:
            hold = max(len(s) for s in p.stop) - 1
            cut = max(len(text) - hold, 0)
            r.pending = text[cut:]
            text = text[:cut]
        self._emit(r, [tok], text, reason, lp=lp)

    def _emit(self, r: Request, ids: list[int], text: str, reason: str | None, error: str | None = None,
              lp: TokenLogprob | None = None) -> None:
        if reason is not None:
            r.finished = True
            if not r.params.unmetered:
                self.metrics.finished(reason)
                self.metrics.e2e.observe(time.monotonic() - r.arrival)
                self.metrics.phases(r.arrival, r.scheduled_at, r.first_token_at, r.last_token_at)
        out = RequestOutput(r.id, ids, text, reason is not None, reason, r.prompt_len, len(r.out_ids), error,
                            cached_tokens=r.num_cached, logprobs=None if lp is None else [lp],
                            prompt_logprobs=r.prompt_logprobs if len(r.out_ids) == 1 and ids else None)
        try:
            r.on_output(out)
        except Exception:  # noqa: BLE001 - a client callback must not kill the poller
            log.exception("on_output callback of request %s raised", r.id)

    def _finish(self, r: Request, reason: str, error: str | None = None) -> None:
        if r.finished:
            return
        self._emit(r, [], "", reason, error)
