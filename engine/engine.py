"""Engine: the facade (docs/engine-interface.md), admission FIFO and the step loop thread.

The zero-layer loop: each step takes every waiting request whose KV reservation fits
(FIFO, stop at the first that does not), runs prompt chunks (chunked prefill under a
token budget) and one decode step for every running request, and hands the step to the
output poller. Nothing is sorted, prioritised, preempted or swapped.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import random
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from .config import EngineConfig, EngineError, RequestRejected
from .hf_config import load_model_config, parse_dtype
from .kv_pool import KVPool, page_bytes
from .loader import build_model
from .metrics import EngineMetrics
from .model_runner import Chunk, ModelRunner
from .output import FinishRecord, OutputPoller, StepRecord, set_os_thread_name
from .interface import EngineStats
from .request import Request, RequestOutput, SamplingParams
from .tokenizer import Tokenizer

__all__ = ["Engine", "EngineConfig", "EngineError", "EngineStats", "RequestOutput",
           "RequestRejected", "SamplingParams"]

log = logging.getLogger("zerod.engine")

_CPU_KV_BUDGET = 256 << 20


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    d = torch.device(name)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError("device cuda asked for, but torch sees no CUDA GPU")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    return d


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = cfg = config
        t0 = time.monotonic()
        model_dir = cfg.model
        if model_dir == "demo":
            from .demo import demo_model_dir
            model_dir = str(demo_model_dir())
            log.warning("serving the built-in demo model from %s: random weights, it produces "
                        "meaningless text", model_dir)
        self.model_dir = Path(model_dir)
        self.model_path = cfg.model
        if not self.model_dir.is_dir():
            raise EngineError(f"model directory {self.model_dir} does not exist")
        self.device = dev = _resolve_device(cfg.device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        mc = self.model_config = load_model_config(self.model_dir)
        if cfg.dtype == "auto":
            dtype = torch.float32 if dev.type == "cpu" else parse_dtype(mc.torch_dtype or "bfloat16")
            if dev.type == "cuda" and dtype == torch.float32:
                dtype = torch.bfloat16
        else:
            dtype = parse_dtype(cfg.dtype)
        self.dtype = dtype
        self.tokenizer = Tokenizer(cfg.tokenizer or self.model_dir, extra_eos_ids=mc.eos_token_ids)
        self.model_name = cfg.served_model_name or (
            "demo" if cfg.model == "demo" else self.model_dir.name)
        self.vocab_size = mc.vocab_size
        load_format = cfg.load_format
        D = mc.head_dim
        if dev.type == "cuda" and not (D & (D - 1) == 0 and D >= 16):
            from . import ops
            log.warning("head_dim %d is not a power of two >= 16: attention runs the torch reference", D)
            ops.DISABLED.update({"decode_attention", "prefill_attention"})
        self.model = build_model(mc, self.model_dir, "dummy" if load_format == "dummy" else "safetensors",
                                 dtype, dev, seed=cfg.seed)

        # ---- max_model_len and the KV pool
        want_len = cfg.max_model_len or mc.max_position_embeddings
        if mc.sliding_window and want_len > mc.sliding_window:
            if cfg.max_model_len:
                raise EngineError(f"max_model_len {want_len} exceeds the model's sliding window "
                                  f"{mc.sliding_window} (sliding-window attention is not implemented)")
            want_len = mc.sliding_window
        pb = page_bytes(mc, cfg.block_size, dtype)
        per_seq_pages = (want_len + cfg.block_size - 1) // cfg.block_size
        if cfg.kv_pages is not None:
            num_pages = cfg.kv_pages
        elif dev.type == "cuda":
            num_pages = self._cuda_pages(pb)
        else:
            budget = cfg.kv_cache_memory_bytes or _CPU_KV_BUDGET
            num_pages = min(budget // pb, cfg.max_num_seqs * per_seq_pages + 1)
        if num_pages < 2:
            raise EngineError(f"no room for the KV cache: one page of {cfg.block_size} tokens takes "
                              f"{pb / 2**20:.1f} MiB; raise gpu_memory_utilization / the KV budget")
        cap = (num_pages - 1) * cfg.block_size
        if want_len > cap:
            if cfg.max_model_len:
                raise EngineError(f"max_model_len {want_len} needs {per_seq_pages} KV pages, the pool has "
                                  f"{num_pages - 1}; lower max_model_len or raise the KV budget")
            log.info("max_model_len capped to %d tokens (the KV pool's size)", cap)
            want_len = cap
        self.max_model_len = int(want_len)
        self.pool = KVPool(mc, num_pages, cfg.block_size, dtype, dev)
        self.runner = ModelRunner(cfg, mc, self.model, self.pool, dev, self.max_model_len,
                                  self.tokenizer.eos_token_ids)
        self.runner.capture_graphs()
        if dev.type == "cuda":
            try:
                self.runner.warmup()
            except Exception as exc:  # noqa: BLE001 - a slower first request, not a failed start
                log.warning("prefill warm-up failed (%s); kernels compile on first use", exc)

        # ---- state
        self.metrics = EngineMetrics(self._snapshot)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[Request] = collections.deque()
        self._n_waiting = 0                   # approximate, read by submit without the loop
        self._prefilling: list[Request] = []
        self._decoding: list[Request] = []
        self._by_id: dict[str, Request] = {}
        self._free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self._ids = itertools.count()
        self._rng = random.Random(cfg.seed)
        self._lock = threading.Lock()
        self._accepting = True
        self._stop = threading.Event()
        self._healthy = True
        self._error: str | None = None
        self._stream_errors = 0
        self._steps = 0
        self._running_count = 0
        self.poller = OutputPoller(self.tokenizer, self.runner.ring, self.metrics,
                                   notify_stop=lambda r: self._inbox.put(("stopped", r)),
                                   on_stream_error=self._on_stream_error)
        self._loop = threading.Thread(target=self._run, name="zerod-step", daemon=True)
        self._started = False
        self.ready_seconds = time.monotonic() - t0
        log.info("engine ready: %s on %s (%s), %d KV pages of %d tokens, max_model_len %d, graphs %s, %.1fs",
                 self.model_name, dev, dtype, num_pages - 1, cfg.block_size, self.max_model_len,
                 bool(self.runner.graphs), self.ready_seconds)

    # ------------------------------------------------------------------ sizing
    def _cuda_pages(self, pb: int) -> int:
        cfg, mc = self.config, self.model_config
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        # activation headroom: a prefill of the token budget + decode logits/sampling of a full batch
        T = cfg.prefill_token_cap
        act = T * (6 * mc.hidden_size + 3 * mc.intermediate_size + 2 * (mc.q_size + 2 * mc.kv_size)) * 4
        act += cfg.max_num_seqs * mc.vocab_size * 4 * 8
        act += T * T * 2 if T <= 8192 else 0      # a block-diagonal prefill mask
        headroom = act + (1 << 30)                # + graphs, cuBLAS workspaces, fragmentation
        budget = cfg.gpu_memory_utilization * total - (total - free) - headroom
        pages = int(budget // pb)
        if pages < 2:
            raise EngineError(
                f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB "
                f"after loading the weights, gpu_memory_utilization {cfg.gpu_memory_utilization} "
                f"leaves {budget / 2**30:.2f} GiB; raise it or use a smaller model")
        return pages

    # ------------------------------------------------------------------ facade
    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.poller.start()
        self._loop.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams | None,
               on_output: Callable[[RequestOutput], None]) -> str:
        params = params or SamplingParams()
        n = len(prompt_ids)
        if not self._accepting:
            raise RequestRejected(503, "the engine is shutting down", retry_after=5.0)
        if n == 0:
            raise RequestRejected(400, "the prompt is empty")
        if not self._healthy:
            raise RequestRejected(503, f"the engine is not healthy: {self._error}", retry_after=10.0)
        vs = self.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vs for t in prompt_ids):
            raise RequestRejected(400, f"prompt token ids must be integers in [0, {vs})")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if max_tokens < 1 or n + max_tokens > self.max_model_len:
            raise RequestRejected(400, f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the "
                                       f"model's context of {self.max_model_len} tokens")
        if self.pool.pages_for(n + max_tokens) > self.pool.total:
            raise RequestRejected(400, f"prompt + max_tokens ({n + max_tokens} tokens) can never fit in the "
                                       f"KV pool ({self.pool.total * self.pool.page_size} tokens)")
        with self._lock:
            if self._n_waiting >= self.config.max_waiting:
                raise RequestRejected(429, f"the wait line is full ({self.config.max_waiting} requests)",
                                      retry_after=1.0)
            self._n_waiting += 1
            rid = f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(rid, list(prompt_ids), params, on_output, max_tokens, seed)
        self._inbox.put(("submit", req))
        return rid

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._running_count, waiting=self._n_waiting,
            kv_pages_total=self.pool.total, kv_pages_free=self.pool.free,
            healthy=self._healthy and (not self._started or self._loop.is_alive()),
            device=str(self.device), model=self.model_name, max_model_len=self.max_model_len,
            steps=self._steps, cuda_graphs=bool(self.runner.graphs), error=self._error)

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop admitting; wait up to drain_timeout for running requests, abort the rest, join."""
        self._accepting = False
        if not self._started:
            return
        deadline = time.monotonic() + max(drain_timeout, 0.0)
        while time.monotonic() < deadline and (self._by_id or self._n_waiting):
            time.sleep(0.01)
        self._inbox.put(("abort_all", None))
        self._stop.set()
        self._inbox.put(("wake", None))
        self._loop.join(timeout=30)
        t = time.monotonic() + 10
        while self.poller.inflight and time.monotonic() < t:
            time.sleep(0.005)
        self.poller.stop()
        self.poller.join(timeout=10)

    @property
    def healthy(self) -> bool:
        return self.stats().healthy

    # ------------------------------------------------------------------ metrics snapshot
    def _snapshot(self) -> dict:
        retries = ooms = 0
        if self.device.type == "cuda":
            try:
                ms = torch.cuda.memory_stats(self.device)
                retries, ooms = ms.get("num_alloc_retries", 0), ms.get("num_ooms", 0)
            except Exception:  # noqa: BLE001
                pass
        return dict(requests_running=self._running_count, requests_waiting=self._n_waiting,
                    kv_pages_total=self.pool.total, kv_pages_free=self.pool.free,
                    allocator_retries=retries, allocator_ooms=ooms, stream_errors=self._stream_errors)

    def _on_stream_error(self, exc: BaseException) -> None:
        self._stream_errors += 1
        self._healthy = False
        self._error = f"CUDA stream error: {exc}"
        log.error("CUDA error surfaced by a step event: %s", exc)

    # ------------------------------------------------------------------ step loop
    def _release(self, r: Request) -> None:
        if r.released:
            return
        r.released = True
        self.pool.release(r.pages)
        r.pages = []
        if r.slot >= 0:
            self._free_slots.append(r.slot)
            r.slot = -1
        self._by_id.pop(r.id, None)

    def _drop_running(self, r: Request) -> None:
        if r in self._prefilling:
            self._prefilling.remove(r)
        elif r in self._decoding:
            self._decoding.remove(r)
        self._release(r)

    def _handle(self, msg) -> None:
        kind, x = msg
        if kind == "submit":
            self._waiting.append(x)
            self._by_id[x.id] = x
        elif kind == "stopped":          # the poller saw a stop token / stop string
            if not x.released:
                self._drop_running(x)
        elif kind == "abort":
            r = self._by_id.get(x)
            if r is None:
                return
            if r in self._waiting:
                self._waiting.remove(r)
                with self._lock:
                    self._n_waiting -= 1
                self._by_id.pop(r.id, None)
            else:
                self._drop_running(r)
            self.poller.put(FinishRecord(r, "abort"))
        elif kind == "abort_all":
            for r in list(self._by_id.values()):
                self._handle(("abort", r.id))

    def _admit(self) -> list[Request]:
        out = []
        while self._waiting and self._free_slots:
            r = self._waiting[0]
            pages = self.pool.reserve(self.pool.pages_for(r.prompt_len + r.max_tokens))
            if pages is None:
                break                      # FIFO: nobody overtakes the head of the line
            self._waiting.popleft()
            with self._lock:
                self._n_waiting -= 1
            r.pages = pages
            r.slot = self._free_slots.pop()
            self._prefilling.append(r)
            out.append(r)
        return out

    def _run(self) -> None:
        set_os_thread_name("zerod-step")
        try:
            self._loop_body()
        except BaseException as exc:  # noqa: BLE001 - never die silently: fail health and every request
            msg = f"step loop crashed: {type(exc).__name__}: {exc}"
            log.exception(msg)
            self._healthy = False
            self._error = msg
            self._accepting = False
            for r in list(self._prefilling) + list(self._decoding) + list(self._waiting):
                self.poller.put(FinishRecord(r, "error", error=msg))
            self._running_count = 0

    def _loop_body(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        ring = self.runner.ring
        idle = False
        while True:
            busy = bool(self._waiting or self._prefilling or self._decoding)
            try:
                msg = self._inbox.get(timeout=0.01 if idle else None) if (idle or not busy) \
                    else self._inbox.get_nowait()
            except queue.Empty:
                msg = None
            while msg is not None:
                self._handle(msg)
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if self._stop.is_set():
                break
            admitted = self._admit()
            budget = (self.config.max_num_batched_tokens if self._decoding
                      else self.config.prefill_token_cap)
            chunks: list[Chunk] = []
            for r in self._prefilling:
                if budget <= 0:
                    break
                n = min(r.prompt_len - r.num_prefilled, budget)
                chunks.append(Chunk(r, r.num_prefilled, n))
                budget -= n
            decodes = list(self._decoding)
            self._running_count = len(self._prefilling) + len(self._decoding)
            idle = not chunks and not decodes
            if idle:
                continue
            ring_idx = ring.free.get()
            start = ring.event()
            t0 = time.perf_counter()
            try:
                if start is not None:
                    start.record()
                rows = self.runner.step(ring_idx, admitted, chunks, decodes)
                end = ring.event()
                if end is not None:
                    end.record()
            except Exception as exc:  # noqa: BLE001 - fail the step's requests, keep serving
                ring.free.put(ring_idx)
                self._step_failed(exc, chunks, decodes)
                continue
            self._steps += 1
            self.poller.put(StepRecord(ring_idx, rows, start if start is not None else t0,
                                       end if end is not None else time.perf_counter()))
            # host bookkeeping; the device already holds what the next step needs
            if decodes:
                for r in decodes:
                    r.num_scheduled += 1
                    if r.num_scheduled >= r.max_tokens:
                        self._release(r)
                self._decoding = [r for r in self._decoding if not r.released]
            for c in chunks:
                r = c.req
                r.num_prefilled += c.n
                if c.completes:
                    self._prefilling.remove(r)
                    r.num_scheduled = 1
                    if r.num_scheduled >= r.max_tokens:
                        self._release(r)
                    else:
                        self._decoding.append(r)
            self._running_count = len(self._prefilling) + len(self._decoding)
        self._running_count = 0

    def _step_failed(self, exc: BaseException, chunks: list[Chunk], decodes: list[Request]) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        log.exception("engine step failed: %s", msg)
        if "CUDA error" in str(exc) or "cudaError" in str(exc):
            self._stream_errors += 1
            self._healthy = False
            self._error = msg
        failed = {id(c.req): c.req for c in chunks}
        failed.update({id(r): r for r in decodes})
        for r in failed.values():
            self._drop_running(r)
            self.poller.put(FinishRecord(r, "error", error=msg))
