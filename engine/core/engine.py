"""Engine: the facade (docs/engine-interface.md) and the step-loop thread.

The step loop is schedule -> run -> update: the scheduler (scheduler.py) picks the step's
prompt chunks and decodes, the model runner launches them (no host sync on CUDA), the
poller thread (output.py) reads the sampled tokens when the step's event fires. A step
that raises is redone in halves so that only the request that makes it fail ends with an
error; a CUDA error (sticky: the context is lost) fails every request and health.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import queue
import random
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch

from ..config import EngineConfig, EngineError, RequestRejected, device_type
from ..spec.hf_config import load_model_config
from ..interface import EngineStats
from .kv_pool import KVPool, kv_torch_dtype
from .first_use import FIRST_USES
from .launch_clock import LaunchClock, LaunchTimes
from ..kernels import gemm_table
from ..model.loader import build_model
from ..lora import LoraAdapter, LoraError, LoraManager
from ..metrics import SLOW_STEP_S, EngineMetrics
from ..runner.model_runner import ModelRunner
from ..runner.warmup import key_triton_cache
from ..tp.parallel import TPGroup, Workers, check_tp
from .faults import FaultInjector
from .step_trace import StepTrace, step_shape, trace_header
from ..prctl import set_os_thread_name
from .output import FinishRecord, OutputPoller, StepRecord
from .request import Request, RequestOutput, SamplingParams
from ..sampling.sampler import row_class
from .scheduler import Batch, Scheduler, ring_window
from ..spec.quant import resolve as resolve_quant
from ..quant.linear import check_device as check_fp8_device
from ..spec.servable import refuse_unservable
from ..spec.sizing import FP8_KV, kv_cache_dtype, plan_kv, serving_dtype, wanted_context
from ..sampling.reasoning_gate import ReasoningGate
from ..sampling.structured import GrammarCompiler, warm as warm_grammars
from ..tuning import Tuning
from ..tokenizer import Tokenizer
from ..tp.tp_channel import StepChannel

__all__ = ["Engine", "EngineConfig", "EngineError", "EngineStats", "RequestOutput",
           "RequestRejected", "SamplingParams"]

log = logging.getLogger("zerod.engine")

SLOW_LAUNCH_S = 0.1   # a step whose host side takes longer is logged (SLOW_STEP_S: counted)


def slow_reason(took: LaunchTimes, kernels_built: int, ahead: int) -> str:
    """What held a slow launch up (metrics.SLOW_STEP_REASONS)."""
    if kernels_built:
        return "kernel_build"
    if took.gc >= took.wall / 2:
        return "garbage_collection"
    if took.waited >= took.wall / 2:
        return "device_queue" if ahead else "waiting"
    return "host"
EXIT_RANK_LOST = 3    # the process's exit status when a tensor-parallel rank is lost


def _resolve_device(name: str) -> torch.device:
    d = torch.device(device_type(name) if name == "auto" else name)
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise EngineError("device cuda asked for, but torch sees no CUDA GPU")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    return d


def _cuda_free_total(dev: torch.device) -> tuple[int, int]:
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(dev)


def tuning_from_env() -> Tuning:
    """ZEROD_TUNING's Tuning; a bad value is the engine's refusal to start."""
    try:
        return Tuning.from_env()
    except ValueError as exc:
        raise EngineError(str(exc)) from None


def build_rank(cfg: EngineConfig, model_dir: Path, dev: torch.device, tp: TPGroup | None,
               eos_ids: list[int] = (), phases: dict[str, float] | None = None,
               tuning: Tuning | None = None) -> tuple[ModelRunner, LoraManager | None]:
    """One rank's device side: weights (its shard under tensor parallelism), the LoRA slabs
    (--enable-lora; one GPU only), the KV pool sized from what they leave (the least any
    rank has left, so every rank gets the same pages), the runner, graphs, warm-up. Every
    rank runs it in the same order: each step of it that communicates does so collectively.
    phases: filled with the seconds each part took (the start log's breakdown). tuning:
    the caller's (a tensor-parallel worker reads ZEROD_TUNING itself)."""
    phases = {} if phases is None else phases
    mark = _PhaseClock(phases)
    mc = load_model_config(model_dir)
    dtype_name = serving_dtype(cfg.dtype, mc.torch_dtype, dev.type)
    dtype = getattr(torch, dtype_name)      # serving_dtype names torch's dtypes
    quant = resolve_quant(mc.quant, cfg.quantization)
    kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, dtype_name)
    refuse_unservable(mc, quant)   # the split was checked by check_tp
    if quant is not None or kv_dtype == FP8_KV:
        check_fp8_device(dev)
    tuning = tuning_from_env() if tuning is None else tuning
    keying = key_triton_cache() if dev.type == "cuda" else None
    model = build_model(mc, model_dir, "dummy" if cfg.load_format == "dummy" else "safetensors",
                        dtype, dev, seed=cfg.seed, quant=quant, tp=tp)
    model.tuning = tuning
    if gemm_table.activate(dev, tuning.skinny_gemm_table):
        log.info("skinny GEMMs: the device's measured Triton tiles where they beat cuBLAS (%s)",
                 gemm_table.device_table_path(gemm_table.TABLE_DIR, dev))
    mark("weights")
    loras = build_loras(cfg, model, mc, dev) if cfg.enable_lora else None   # slabs before the KV pool
    if dev.type == "cuda" and not model.ops.head_dim_kernels:
        log.warning("head_dim %d is not a power of two >= 16: attention runs the torch reference",
                    mc.head_dim)
    mem = _cuda_free_total(dev) if dev.type == "cuda" and cfg.kv_pages is None else None
    if tp is not None and mem is not None:
        mem = tuple(tp.host_min(list(mem)))
    plan = plan_kv(cfg, mc, dtype_name, dev.type, mem)
    if plan.max_model_len < wanted_context(cfg, mc) and (tp is None or tp.rank == 0):
        log.info("max_model_len capped to %d tokens (the KV pool's size)", plan.max_model_len)
    pool = KVPool(model.mc, plan.num_pages, cfg.block_size, kv_torch_dtype(kv_dtype, dtype), dev)  # this rank's KV heads
    runner = ModelRunner(cfg, mc, model, pool, dev, plan.max_model_len, list(eos_ids),
                         lora=loras.batch if loras is not None else None)
    mark("KV pool")
    if keying is not None:
        keying.join()
    runner.capture_graphs()
    mark("graphs")
    if dev.type == "cuda" and model.tuning.warmup:
        try:
            runner.warmup()
        except Exception as exc:  # noqa: BLE001 - a slower first request, not a failed start
            if tp is not None:   # the other ranks are in its collectives
                raise
            log.warning("prefill warm-up failed (%s); kernels compile on first use", exc)
        mark("warm-up")
    return runner, loras


class _PhaseClock:
    """mark(name): the seconds since the last mark, recorded under name."""

    def __init__(self, phases: dict[str, float]) -> None:
        self.phases, self.t = phases, time.monotonic()

    def __call__(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = now - self.t
        self.t = now


def build_loras(cfg: EngineConfig, model, mc, dev: torch.device) -> LoraManager:
    """The LoRA slabs on the device, and the --lora-modules adapters registered (a broken
    one fails the start, naming it)."""
    try:
        loras = LoraManager(model, mc, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras or cfg.max_loras)
    except torch.OutOfMemoryError:
        raise EngineError(f"the LoRA slabs (--max-loras {cfg.max_loras} x --max-lora-rank "
                          f"{cfg.max_lora_rank}) do not fit on {dev}") from None
    for name, path, base in cfg.lora_modules:
        loras.add(name, path, base)
    # the first adapters' device slots written before READY: a first request would write its
    # adapter's slot on the step thread, stalling every stream
    for name, _, _ in cfg.lora_modules[:cfg.max_loras]:
        loras.release(loras.acquire(loras.get(name)))
    return loras


def is_cuda_fatal(exc: BaseException) -> bool:
    """A CUDA error is sticky: the context is unusable, so no redo can succeed."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(exc, accel)) or "CUDA error" in str(exc) or "cudaError" in str(exc)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = cfg = config
        t0 = time.monotonic()
        FIRST_USES.install()
        self._faults = FaultInjector.from_env()   # ZEROD_FAULT: None unless set
        self.model_path = cfg.model
        self.model_dir = self._model_dir(cfg.model)
        self.device = _resolve_device(cfg.device)
        mc = self.model_config = load_model_config(self.model_dir)
        self.start_phases: dict[str, float] = {}   # seconds per part of the start (the ready log)
        t_tok = time.monotonic()
        self.tokenizer = Tokenizer(cfg.tokenizer or self.model_dir, extra_eos_ids=mc.eos_token_ids)
        self.start_phases["tokenizer"] = time.monotonic() - t_tok
        self.model_name = cfg.served_model_name or (
            "demo" if cfg.model == "demo" else self.model_dir.name)
        self.vocab_size = mc.vocab_size
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._tuning = tuning = tuning_from_env()
        # the GIL switch interval for the engine's life, its build included: the step thread's
        # torch calls each give up the GIL, and the interval bounds how long one waits to take
        # it back from a thread busy in Python (Tuning.gil_switch_interval_us)
        self._switch_interval: float | None = sys.getswitchinterval()
        sys.setswitchinterval(tuning.gil_switch_interval_us / 1e6)
        # structured outputs' machinery (xgrammar's import, the tokenizer's vocabulary, its
        # thread pool) warms beside the device side and is ready before READY
        grammars = threading.Thread(target=self._warm_host_side, name="zerod-warmup", daemon=True)
        grammars.start()
        # The step thread builds the device side, then parks until start(): cuDNN keeps its
        # attention plans and cuBLAS its handles per thread, so what the warm-up builds must be
        # built on the thread that serves. The caller's current device stays untouched.
        self._stop = threading.Event()
        self._go = threading.Event()
        self._started = False
        self._trace: StepTrace | None = None   # opened once the device side is built
        built: Future = Future()
        self._loop = threading.Thread(target=self._step_thread, args=(built,), name="zerod-step", daemon=True)
        self._loop.start()
        try:
            built.result()   # the build's own exception, re-raised here
        except BaseException:
            grammars.join()   # a refused engine leaves no warm-up behind (several at once abort xgrammar)
            self._give_back_switch_interval()
            raise
        try:
            self._after_build(cfg, mc, t0, grammars)
        except BaseException:
            # nothing of a refused engine outlives it: the parked step thread holds the
            # device side (and the ranks their processes) until shut down
            grammars.join()
            self.shutdown()
            raise

    def _after_build(self, cfg: EngineConfig, mc, t0: float, grammars: threading.Thread) -> None:
        """The host side around the built device side: scheduler, metrics, poller."""
        self.scheduler = Scheduler(cfg, self.pool, self.loras, ring_window(mc.layer_windows), self._tuning)
        if self.scheduler.ring and cfg.enable_prefix_caching:
            log.info("every layer slides (window %d): each request holds a ring of %d KV pages; "
                     "prefix caching is off for this model", ring_window(mc.layer_windows),
                     self.scheduler.ring)
        self.metrics = EngineMetrics(self._snapshot, self.model_name)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._rng = random.Random(cfg.seed)
        self._accepting = True
        self._healthy = True
        self._error: str | None = None
        self._stream_errors = 0
        self._steps = 0
        self._clock = LaunchClock()   # a slow launch's log line says where its time went
        self._running_count = 0
        # vLLM's lora_requests_info (running, waiting, max_loras, when), written by the step thread
        self._lora_info = ("", "", cfg.max_loras, time.time()) if self.loras is not None else None
        # ZEROD_STEP_TRACE: one line a step (step_trace.py); None unless set
        self._trace = StepTrace.from_env(trace_header(self.model.tuning, cfg, self.model_name, self.max_model_len))
        self.poller = OutputPoller(self.tokenizer, self.runner.ring, self.metrics,
                                   notify_stop=lambda r: self._inbox.put(("stopped", r)),
                                   on_stream_error=self._on_stream_error,
                                   on_step_time=self.scheduler.cost.observe, trace=self._trace)
        t_join = time.monotonic()
        grammars.join()
        self.start_phases["host warm-up wait"] = time.monotonic() - t_join
        self.ready_seconds = time.monotonic() - t0
        log.info("engine ready: %s on %s (%s), %d KV pages of %d tokens, max_model_len %d, graphs %s, %.1fs (%s)",
                 self.model_name, self.device, self.dtype, self.pool.total, cfg.block_size,
                 self.max_model_len, bool(self.runner.graphs), self.ready_seconds,
                 ", ".join(f"{k} {v:.1f}s" for k, v in self.start_phases.items()))

    def _step_thread(self, built: Future) -> None:
        """The engine's one device thread: the build (weights, KV pool, graphs, warm-up),
        then, once start() lets it go, the step loop."""
        set_os_thread_name("zerod-step")
        try:
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                self._build_device_side()
        except BaseException as exc:  # noqa: BLE001 - the constructor raises it
            built.set_exception(exc)
            return
        built.set_result(None)
        self._go.wait()
        if not self._stop.is_set():
            self._run()

    def _build_device_side(self) -> None:
        """The tensor-parallel group if any (parallel.py), then this rank's model runner."""
        cfg = self.config
        self.tp = self.workers = None
        check_tp(self.model_config, cfg.tensor_parallel_size, self.device,
                 quantized=self.model_config.quant is not None or cfg.quantization is not None,
                 lora=cfg.enable_lora)
        for name, _, _ in cfg.lora_modules:
            if name == self.model_name:
                raise EngineError(f"LoRA adapter {name!r} has the base model's name")
        if cfg.tensor_parallel_size > 1:
            self.workers = Workers(cfg, self.model_dir, self.device, on_lost=self._on_rank_lost)
            try:
                self.tp = TPGroup(0, cfg.tensor_parallel_size, self.device, self.workers.init_method)
                self.runner, self.loras = build_rank(cfg, self.model_dir, self.device, self.tp,
                                                     self.tokenizer.eos_token_ids, self.start_phases, self._tuning)
            except BaseException:
                self.workers.kill()
                if self.tp is not None:
                    self.tp.destroy()
                raise
            self.runner.channel = StepChannel(self.tp, self.runner.staging, cfg.max_num_seqs)
        else:
            self.runner, self.loras = build_rank(cfg, self.model_dir, self.device, None,
                                                 self.tokenizer.eos_token_ids, self.start_phases, self._tuning)
        self.model, self.pool = self.runner.model, self.runner.pool
        self.dtype, self.max_model_len = self.model.dtype, self.runner.max_model_len

    def _on_rank_lost(self, why: str) -> None:
        """A rank is gone (or rank 0 left the ranks out of step): the group cannot go on.
        Fail health and exit non-zero so the supervisor restarts the whole group."""
        self._healthy = False
        self._error = why
        log.critical("%s; the tensor-parallel group cannot go on: exiting", why)
        if self.workers is not None:
            self.workers.kill()
        logging.shutdown()
        os._exit(EXIT_RANK_LOST)

    @staticmethod
    def _model_dir(model: str) -> Path:
        if model == "demo":
            from ..demo import demo_model_dir
            d = demo_model_dir()
            log.warning("serving the built-in demo model from %s: random weights, it produces "
                        "meaningless text", d)
        else:
            d = Path(model)
        if not d.is_dir():
            raise EngineError(f"model directory {d} does not exist")
        return d

    # ------------------------------------------------------------------ facade
    def start(self) -> None:
        if self._started:
            return
        self._started = True
        # Everything built so far (torch, the model, the server's modules) lives as long as
        # the process: take it out of the garbage collector's full passes, whose pauses stop
        # every thread (vLLM does the same).
        gc.collect()
        gc.freeze()
        self.poller.start()
        self._go.set()

    def submit(self, prompt_ids: list[int], params: SamplingParams | None,
               on_output: Callable[[RequestOutput], None], after: str | None = None,
               lora: str | None = None) -> str:
        """lora: the name of a LoRA adapter to run the request with (None: the base)."""
        params = params or SamplingParams()
        n = len(prompt_ids)
        if not self._accepting:
            raise RequestRejected(503, "the engine is shutting down", retry_after=5.0)
        if n == 0:
            raise RequestRejected(400, "the prompt is empty")
        if not self._healthy:
            raise RequestRejected(503, f"the engine is not healthy: {self._error}", retry_after=10.0)
        vs = self.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 or t >= vs for t in prompt_ids):
            raise RequestRejected(400, f"prompt token ids must be integers in [0, {vs})")
        try:
            params.check()                 # again: fields may have been set after it was built
            params = params.for_vocab(vs)
        except ValueError as exc:
            raise RequestRejected(400, str(exc)) from None
        if params.prompt_logprobs is not None and self.tp is not None:
            raise RequestRejected(400, "prompt_logprobs (and echo with logprobs) is not supported "
                                       "with --tensor-parallel-size > 1 yet")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if max_tokens < 1 or n + max_tokens > self.max_model_len:
            raise RequestRejected(400, f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the "
                                       f"model's context of {self.max_model_len} tokens")
        if self.pool.pages_for(n + max_tokens) > self.pool.total:
            raise RequestRejected(400, f"prompt + max_tokens ({n + max_tokens} tokens) can never fit in the "
                                       f"KV pool ({self.pool.total * self.pool.page_size} tokens)")
        adapter = self._adapter(lora) if lora is not None else None
        if not self.scheduler.claim_wait_place():
            raise RequestRejected(429, f"the wait line is full ({self.config.max_waiting} requests)",
                                  retry_after=1.0)
        rid = f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(rid, list(prompt_ids), params, on_output, max_tokens, seed,
                      sample_class=row_class(params.temperature, params.top_k, params.top_p,
                                                   params.min_p), after=after, lora=adapter)
        if params.grammar is not None:   # each engine request walks the grammar on its own
            gate = (ReasoningGate(params.reasoning_parser, self.tokenizer, req.prompt_ids,
                                  params.skip_special_tokens)
                    if params.reasoning_parser is not None else None)
            req.grammar = self.grammar_compiler.new_state(params.grammar, gate)
        self._inbox.put(("submit", req))
        if adapter is not None:
            self.metrics.lora_request(adapter.name)
        return rid

    # ------------------------------------------------------------------ LoRA adapters
    def _adapter(self, name: str) -> LoraAdapter:
        adapter = self.loras.get(name) if self.loras is not None else None
        if adapter is None:
            shown = name if len(name) <= 80 else f"{name[:80]}…"   # never echo a client's megabyte
            raise RequestRejected(404, f"The model `{shown}` does not exist: no base model or "
                                       f"LoRA adapter of that name is loaded")
        return adapter

    def lora_adapters(self) -> list[LoraAdapter]:
        """The adapters requests can name now (empty without --enable-lora)."""
        return self.loras.names() if self.loras is not None else []

    def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter (reads its files: call off the event loop). Raises
        LoraError naming what is wrong, EngineError without --enable-lora."""
        if self.loras is None:
            raise EngineError("LoRA is not enabled on this engine (start it with --enable-lora)")
        if name == self.model_name:
            raise LoraError(f"LoRA adapter {name!r} has the base model's name")
        self.loras.add(name, path)

    def unload_lora(self, name: str) -> None:
        """New requests for `name` are refused at once; those already submitted finish on
        its weights. KeyError when no adapter has that name."""
        if self.loras is None:
            raise KeyError(name)
        self.loras.remove(name)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The structured-output compiler (built on first use: xgrammar reads the whole
        vocabulary). Any thread; its compile() blocks, so the server calls it off its loop."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
            return self._grammars

    def _warm_host_side(self) -> None:
        """The chat template compiled (a broken one still fails its first chat request, as
        before, not the start) and the structured-output machinery warmed."""
        try:
            self.tokenizer.compile_chat_template()
        except Exception as exc:  # noqa: BLE001
            log.warning("the chat template does not compile (%s); chat requests will fail", exc)
        try:
            warm_grammars(self.grammar_compiler)
        except Exception as exc:  # noqa: BLE001 - a slower first structured request, not a failed start
            log.warning("structured-output warm-up failed (%s); it runs on first use", exc)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._running_count, waiting=self.scheduler.num_waiting,
            kv_pages_total=self.pool.total, kv_pages_free=self.scheduler.cache.free,
            healthy=self._healthy and (not self._started or self._loop.is_alive()),
            device=str(self.device), model=self.model_name, max_model_len=self.max_model_len,
            steps=self._steps, cuda_graphs=bool(self.runner.graphs), error=self._error,
            last_step=self.poller.last_step)

    def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.metrics.registry)

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop admitting; wait up to drain_timeout for running requests, abort the rest, join."""
        self._accepting = False
        if self._started:
            self._stop_loop(drain_timeout)
        else:   # the step thread parked after the build: let it end
            self._stop.set()
            self._go.set()
            self._loop.join(timeout=30)
        if self.workers is not None:
            self._stop_group()
        if self._trace is not None:
            self._trace.close()
        self._give_back_switch_interval()

    def _give_back_switch_interval(self) -> None:
        """The process's own GIL switch interval again (once)."""
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None

    def _stop_group(self) -> None:
        """STOP to the workers (only from a step loop that is no longer running: the
        channel is its), then wait for them; kill what does not stop."""
        workers, self.workers = self.workers, None
        workers.closing = True
        if not self._loop.is_alive():
            try:
                self.runner.channel.send_stop()
            except Exception as exc:  # noqa: BLE001 - a worker already gone
                log.warning("tensor-parallel stop message failed (%s)", exc)
            workers.stop()
            self.tp.destroy()
        workers.kill()

    def _stop_loop(self, drain_timeout: float) -> None:
        deadline = time.monotonic() + max(drain_timeout, 0.0)
        while time.monotonic() < deadline and (self.scheduler.by_id or self.scheduler.num_waiting):
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
        cache = self.scheduler.cache
        return dict(requests_running=self._running_count, requests_waiting=self.scheduler.num_waiting,
                    kv_pages_total=self.pool.total, kv_pages_free=cache.free,
                    allocator_retries=retries, allocator_ooms=ooms, stream_errors=self._stream_errors,
                    prefix_cache_queries=cache.stats.queries, prefix_cache_hits=cache.stats.hits,
                    prefix_cache_pages=cache.cached_pages, lora_info=self._lora_info)

    def _on_stream_error(self, exc: BaseException) -> None:
        self._stream_errors += 1
        self._healthy = False
        self._error = f"CUDA stream error: {exc}"
        log.error("CUDA error surfaced by a step event: %s", exc)

    # ------------------------------------------------------------------ step loop
    def _run(self) -> None:
        try:
            self._loop_body()
        except BaseException as exc:  # noqa: BLE001 - never die silently: fail health and every request
            msg = f"step loop crashed: {type(exc).__name__}: {exc}"
            log.exception(msg)
            self._healthy = False
            self._error = msg
            self._accepting = False
            for r in list(self.scheduler.by_id.values()):
                self.poller.put(FinishRecord(r, "error", error=msg))
        self._running_count = 0

    def _loop_body(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        free = self.runner.ring.free
        idle = False
        while True:
            self._take_messages(wait=idle or not self.scheduler.has_work, poll=idle)
            if self._stop.is_set():
                return
            # The step's ring slot first, then its batch: a slot frees when the poller is done
            # with an earlier step, so a prompt that arrived meanwhile joins this step rather
            # than waiting behind it (docs/perf.md "Steps in flight").
            ring_idx = free.get()
            self._take_messages(wait=False, poll=False)
            batch = self.scheduler.schedule()
            while self.scheduler.failed:   # refused at admission (an adapter's files went bad)
                r, msg = self.scheduler.failed.pop()
                self.poller.put(FinishRecord(r, "error", error=msg))
            self._running_count = self.scheduler.num_running
            idle = not batch
            if batch:
                self._run_batch(batch, ring_idx)
            else:
                free.put(ring_idx)
            self._publish_counts()
            if self._faults is not None:
                self._faults.after_step(self)

    def _publish_counts(self) -> None:
        """What /metrics and stats() read on other threads after an iteration, each a value
        swapped whole (the running count is also set before a step: it shows the admitted)."""
        self._running_count = self.scheduler.num_running
        if self.loras is not None:   # vLLM's lora_requests_info
            self._lora_info = (*self.scheduler.lora_names(), self.config.max_loras, time.time())

    def _take_messages(self, wait: bool, poll: bool) -> None:
        """Handle every message in the inbox; with wait, block for the first one (up to
        10 ms with poll: work is there, it just cannot be scheduled yet)."""
        try:
            msg = self._inbox.get(timeout=0.01 if poll else None) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg) -> None:
        kind, x = msg
        sched = self.scheduler
        if kind == "submit":
            sched.add(x)
        elif kind == "stopped":          # the poller saw a stop token / stop string
            if not x.released:
                sched.remove(x)
        elif kind == "abort":
            r = sched.by_id.get(x)
            if r is not None:
                sched.remove(r)
                self.poller.put(FinishRecord(r, "abort"))
        elif kind == "abort_all":
            for r in list(sched.by_id.values()):
                self._handle(("abort", r.id))

    def _run_batch(self, batch: Batch, ring_idx: int) -> None:
        """Run one step and count it. If it raises, redo it in halves: the rows that run
        alone fine carry on, the one that fails alone ends with the error. A redo is safe:
        a step's KV writes and sampled tokens depend on its own rows only (each written
        again by the redo), sampling noise is a function of (seed, output index), and the
        only state a step carries over, last_tokens, is written by its final op."""
        try:
            self._launch(batch, ring_idx)   # gives the slot back if it raises
        except Exception as exc:  # noqa: BLE001 - isolate the culprit, keep serving
            if self.tp is not None:   # the other ranks may be inside this step's collectives
                self._fail(batch.requests(), exc, fatal=True)
                self._on_rank_lost(f"rank 0's step failed ({type(exc).__name__}: {exc})")
            elif is_cuda_fatal(exc):
                self._fail(batch.requests(), exc, fatal=True)
            elif len(batch) == 1:
                self._fail(batch.requests(), exc)
            else:
                log.warning("a step of %d rows failed (%s: %s); redoing it in halves",
                            len(batch), type(exc).__name__, exc)
                for half in batch.halves():
                    self._run_batch(half, self.runner.ring.free.get())
            return
        self.scheduler.update(batch)
        if self.runner.masks.broken:   # a token its grammar refused (a bug: the mask allowed it)
            broken, self.runner.masks.broken = self.runner.masks.broken, []
            self._fail(broken, RuntimeError("a sampled token breaks the structured output's grammar"))

    def _launch(self, batch: Batch, ring_idx: int) -> None:
        ring = self.runner.ring
        # steps launched before this one whose slots the poller has not given back: the
        # device is still on them, and a launch that outruns the device's queue of
        # kernels blocks in the driver (spinning: it shows as CPU time)
        ahead = ring.depth - 1 - ring.free.qsize()
        start, end = ring.event(), ring.event()
        clock = self._clock
        built = FIRST_USES.kernels_built
        clock.start()
        try:
            if start is not None:
                start.record()
            rows = self.runner.step(ring_idx, batch, on_staged=clock.staged)
            if end is not None:
                end.record()
        except BaseException:
            try:
                self.runner.settle()     # raises if the failure left a CUDA error behind
            finally:
                ring.free.put(ring_idx)
            raise
        self._steps += 1
        launch_s = clock.elapsed()
        if launch_s > SLOW_STEP_S:  # the host, not the GPU, held this step up
            took = clock.done()   # the breakdown only then: every step pays elapsed() alone
            reason = slow_reason(took, FIRST_USES.kernels_built - built, ahead)
            self.metrics.slow_steps.labels(reason=reason).inc()
            if took.wall > SLOW_LAUNCH_S:
                log.warning("step %d took %.0f ms to launch (%d prompt chunks, %d tokens, %d decodes; %s; "
                            "%d earlier steps unfinished; reason: %s%s)", self._steps, took.wall * 1000,
                            len(batch.chunks), sum(c.n for c in batch.chunks), len(batch.decodes),
                            took.describe(), ahead, reason,
                            f", last kernel built: {FIRST_USES.last_kernel}" if reason == "kernel_build" else "")
        self.poller.put(StepRecord(ring_idx, rows, start if start is not None else clock.started,
                                   end if end is not None else time.perf_counter(),
                                   prefill_tokens=sum(c.n for c in batch.chunks),
                                   decodes=len(batch.decodes),
                                   shape=step_shape(batch, time.monotonic(), self.runner.forward_rows)
                                   if self._trace is not None else None,
                                   launch_s=launch_s))

    def _fail(self, reqs: list[Request], exc: BaseException, fatal: bool = False) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        log.error("engine step failed for %s: %s", ", ".join(r.id for r in reqs), msg,
                  exc_info=exc)
        if fatal:
            self._stream_errors += 1
            self._healthy = False
            self._error = msg
        for r in reqs:
            self.scheduler.remove(r)
            self.poller.put(FinishRecord(r, "error", error=msg))
