"""`zerod serve`: the engine alone behind its OpenAI-compatible HTTP server.

Flags take vLLM's names wherever the meaning is the same, so an existing `vllm serve`
command line mostly carries over; their defaults are EngineConfig's own. Errors a user can
cause (a missing model directory, a bad flag value, a taken port, an engine that cannot
start with this model) are printed as one plain line and exit non-zero, never as a
traceback. The port is bound before the model loads, so a taken one fails at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import re
import sys
from pathlib import Path

import click
from zerod import CONTEXT_SETTINGS
from zerod.engine.core.stack_dump import register_from_env as register_stack_dump
from zerod.engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig, EngineError
from zerod.engine.api.tools import PARSERS

# Each engine flag's default is EngineConfig's (one owner).
_DEFAULT = {f.name: f.default for f in dataclasses.fields(EngineConfig)}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


class ByteSize(click.ParamType):
    """An integer of bytes, or with a suffix: 512M, 2G, 2GiB (powers of 1024)."""

    name = "bytes"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        m = _SIZE.match(str(value))
        if not m:
            self.fail(f"{value!r} is not a size (e.g. 4000000000, 512M, 2GiB)", param, ctx)
        mult = 1024 ** " kmgt".index(m.group(2).lower() or " ")
        n = int(float(m.group(1)) * mult)
        if n <= 0:
            self.fail("must be > 0", param, ctx)
        return n


class Device(click.ParamType):
    name = "cpu|cuda|cuda:N|auto"

    def convert(self, value, param, ctx):
        v = str(value).strip().lower()
        if v in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", v):
            return v
        self.fail(f"{value!r} is not cpu, cuda, cuda:N or auto", param, ctx)


class JsonList(click.ParamType):
    """A JSON list of strings, as vLLM's CORS flags take: '["https://a.example"]'."""

    name = "json-list"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        import json

        try:
            v = json.loads(value)
        except ValueError:
            v = None
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            self.fail(f"{value!r} is not a JSON list of strings (e.g. '[\"*\"]')", param, ctx)
        return v


class ServeCommand(click.Command):
    """Takes vLLM's `--lora-modules a=PATH b=PATH` (several values after one flag) as
    well as the flag repeated: click options take one value each."""

    def parse_args(self, ctx, args):
        out, i = [], 0
        while i < len(args):
            a = args[i]
            i += 1
            if a != "--lora-modules":
                out.append(a)
                continue
            values = []
            while i < len(args) and not args[i].startswith("-"):
                values.append(args[i])
                i += 1
            # none: the bare flag, which click refuses naming it
            out += [x for v in values for x in ("--lora-modules", v)] or [a]
        return super().parse_args(ctx, out)


def _lora_modules(ctx, param, values):
    from zerod.engine.lora.manager import parse_lora_module

    try:
        return tuple(parse_lora_module(v) for v in values)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _check_model(ctx, param, value):
    if value == "demo":
        return value
    p = Path(value).expanduser()
    if not p.exists():
        raise click.BadParameter(
            f"no such directory: {value} (give a Hugging Face checkpoint directory with "
            "config.json, or 'demo' for the built-in tiny model)")
    if not p.is_dir():
        raise click.BadParameter(f"{value} is not a directory (give the checkpoint "
                                 "directory that holds config.json)")
    if not (p / "config.json").is_file():
        raise click.BadParameter(f"{value} has no config.json: not a Hugging Face "
                                 "checkpoint directory")
    return str(p)


@click.command("serve", cls=ServeCommand,
               context_settings={**CONTEXT_SETTINGS, "max_content_width": 100})
@click.option("--model", required=True, callback=_check_model,
              help="Checkpoint directory (HF layout: config.json, *.safetensors, "
                   "tokenizer.json), or 'demo' for the built-in tiny random model.")
@click.option("--served-model-name", multiple=True,
              help="Name clients pass as `model` (repeat for aliases). "
                   "Default: the model's name.")
@click.option("--tokenizer", default=None, type=click.Path(exists=True, file_okay=False),
              help="Directory with tokenizer.json (default: the model directory).")
@click.option("--dtype", default=_DEFAULT["dtype"], show_default=True,
              type=click.Choice(["auto", "bfloat16", "float16", "half", "float32", "float"]),
              help="Weights and KV cache dtype; auto = config.json's (float32 on CPU).")
@click.option("--load-format", default=_DEFAULT["load_format"], show_default=True,
              type=click.Choice(["auto", "safetensors", "dummy"]),
              help="dummy: random weights from config.json alone (benchmarks).")
@click.option("--quantization", "-q", default=_DEFAULT["quantization"], type=click.Choice(QUANTIZATIONS),
              help="fp8: quantize an unquantized checkpoint at load (e4m3 weights with a scale per "
                   "output channel, activations per token; compute capability 8.9+). FP8 "
                   "checkpoints are served as published without it.")
@click.option("--kv-cache-dtype", default=_DEFAULT["kv_cache_dtype"], show_default=True,
              type=click.Choice(KV_CACHE_DTYPES),
              help="KV cache pages: auto = the model dtype; fp8 (= fp8_e4m3) halves their bytes "
                   "(the checkpoint's k/v scales, else 1.0; compute capability 8.9+).")
@click.option("--max-model-len", type=click.IntRange(min=2), default=_DEFAULT["max_model_len"],
              help="Context length (prompt + output). Default: the model's, capped by the "
                   "KV pool.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=_DEFAULT["max_num_seqs"],
              show_default=True, help="Most requests running at once.")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1),
              default=_DEFAULT["max_num_batched_tokens"],
              show_default=True, help="Prompt tokens per step (chunked prefill budget).")
@click.option("--max-prefill-tokens-idle", type=click.IntRange(min=1),
              default=_DEFAULT["max_prefill_tokens_idle"],
              show_default=True, help="Prompt tokens per step while nothing decodes (a long "
                                      "prompt then goes in whole, unchunked).")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching",
              default=_DEFAULT["enable_prefix_caching"], show_default=True,
              help="Share the KV of full prompt pages between requests with the same prefix.")
@click.option("--target-itl-ms", type=click.FloatRange(min=0.1, max=1e5),
              default=_DEFAULT["target_itl_ms"], show_default=True,
              help="While streams decode, prompt chunks keep a step within this (from "
                   "measured step costs), down to --min-prefill-chunk.")
@click.option("--target-ttft-ms", type=click.FloatRange(min=0.1, max=1e5),
              default=_DEFAULT["target_ttft_ms"], show_default=True,
              help="While streams decode, prompt chunks grow so that each waiting prompt gets "
                   "its first token within this (plus its own prefill time), up to "
                   "--max-num-batched-tokens.")
@click.option("--min-prefill-chunk", type=click.IntRange(min=1),
              default=_DEFAULT["min_prefill_chunk"], show_default=True,
              help="Prompt tokens a step takes at least while streams decode (prefill is "
                   "never starved).")
@click.option("--max-waiting", type=click.IntRange(min=0), default=_DEFAULT["max_waiting"],
              show_default=True,
              help="Wait line bound; beyond it requests get 429 with Retry-After.")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0.05, 1.0),
              default=_DEFAULT["gpu_memory_utilization"],
              show_default=True, help="CUDA: fraction of the GPU the engine may hold "
                                      "(weights + KV pool + activations).")
@click.option("--kv-pages", type=click.IntRange(min=2), default=_DEFAULT["kv_pages"],
              help="KV pool size in pages of --block-size tokens (CPU budget; on CUDA it "
                   "overrides --gpu-memory-utilization's sizing).")
@click.option("--kv-cache-memory-bytes", type=ByteSize(),
              default=_DEFAULT["kv_cache_memory_bytes"],
              help="CPU: KV pool budget in bytes when --kv-pages is not given (e.g. 2GiB; "
                   "default 256 MiB).")
@click.option("--block-size", type=click.IntRange(min=1), default=_DEFAULT["block_size"],
              show_default=True,
              help="KV page size in tokens (a power of two).")
@click.option("--device", type=Device(), default=_DEFAULT["device"], show_default=True,
              help="cpu, cuda, cuda:N; auto = cuda if available.")
@click.option("--tensor-parallel-size", "-tp", type=click.IntRange(min=1),
              default=_DEFAULT["tensor_parallel_size"], show_default=True,
              help="Split the model over N GPUs (the first N visible: set CUDA_VISIBLE_DEVICES), "
                   "one process per GPU; on the CPU, N processes.")
@click.option("--enforce-eager", is_flag=True, default=_DEFAULT["enforce_eager"],
              help="CUDA: no CUDA graphs.")
@click.option("--seed", type=int, default=_DEFAULT["seed"], show_default=True,
              help="Seeds dummy weights and requests that carry no seed.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Bind address.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", envvar=["ZEROD_API_KEY", "VLLM_API_KEY"], default=None,
              help="Require 'Authorization: Bearer KEY' on /v1/* (env ZEROD_API_KEY or, "
                   "as vLLM, VLLM_API_KEY).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=30.0,
              show_default=True,
              help="On SIGTERM: seconds in-flight requests get to finish before they are "
                   "ended.")
@click.option("--default-max-tokens", type=click.IntRange(min=1), default=None,
              help="Cap for requests that send no max_tokens (chat; completions default to "
                   "16 as OpenAI). Default: what the context leaves, which reserves KV pages "
                   "for the whole context at admission.")
@click.option("--allowed-origins", type=JsonList(), default='["*"]', show_default=True,
              help="CORS: origins allowed (a JSON list, as vLLM's).")
@click.option("--allowed-methods", type=JsonList(), default='["*"]', show_default=True,
              help="CORS: methods allowed (a JSON list).")
@click.option("--allowed-headers", type=JsonList(), default='["*"]', show_default=True,
              help="CORS: request headers allowed (a JSON list).")
@click.option("--allow-credentials", is_flag=True, default=False,
              help="CORS: allow credentials (cookies, Authorization).")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Jinja chat template file served instead of the model's.")
@click.option("--enable-auto-tool-choice", is_flag=True, default=False,
              help='Serve tool_choice "auto" (the default with tools); needs --tool-call-parser.')
@click.option("--tool-call-parser", type=click.Choice(PARSERS), default=None,
              help="How tool calls are read from the output: hermes (Hermes, Qwen) or "
                   "llama3_json (Llama 3.x).")
@click.option("--enable-lora", is_flag=True, default=_DEFAULT["enable_lora"],
              help="Serve LoRA adapters: a request names one in `model`.")
@click.option("--lora-modules", multiple=True, default=_DEFAULT["lora_modules"], callback=_lora_modules,
              metavar="NAME=PATH",
              help="LoRA adapters (PEFT directories) served from the start: name=path or "
                   "vLLM's JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; "
                   "several after one flag, or the flag repeated.")
@click.option("--max-loras", type=click.IntRange(1, 256), default=_DEFAULT["max_loras"],
              show_default=True, help="LoRA adapters on the device at once (fixed slabs; "
                                      "a batch mixes up to this many).")
@click.option("--max-lora-rank", type=click.IntRange(1, 512), default=_DEFAULT["max_lora_rank"],
              show_default=True, help="Largest LoRA rank served (sizes the slabs).")
@click.option("--max-cpu-loras", type=click.IntRange(min=1), default=_DEFAULT["max_cpu_loras"],
              help="LoRA adapters kept in host memory (others are read again from disk when "
                   "asked for). Default: --max-loras.")
@click.option("--allow-runtime-lora", is_flag=True, default=False,
              help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def serve(model, served_model_name, tokenizer, dtype, load_format, quantization, kv_cache_dtype, max_model_len,
          max_num_seqs, max_num_batched_tokens, max_prefill_tokens_idle, enable_prefix_caching,
          target_itl_ms, target_ttft_ms, min_prefill_chunk, max_waiting,
          gpu_memory_utilization, kv_pages,
          kv_cache_memory_bytes, block_size, device, tensor_parallel_size, enforce_eager, seed, host, port, api_key,
          drain_timeout, default_max_tokens, allowed_origins, allowed_methods, allowed_headers,
          allow_credentials, chat_template, enable_auto_tool_choice, tool_call_parser,
          enable_lora, lora_modules, max_loras, max_lora_rank, max_cpu_loras, allow_runtime_lora,
          log_level):
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics)."""
    # flags first: an operator's typo fails before anything is set up
    if block_size & (block_size - 1):
        raise click.BadParameter("must be a power of two", param_hint="--block-size")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise click.UsageError("--enable-auto-tool-choice needs --tool-call-parser")
    if (lora_modules or allow_runtime_lora) and not enable_lora:
        raise click.UsageError("--lora-modules and --allow-runtime-lora need --enable-lora")
    template = None
    if chat_template is not None:
        from zerod.engine.tokenizer import compile_chat_template

        try:  # before loading anything: a broken template fails now
            template = Path(chat_template).read_text()
            compile_chat_template(template)
        except (OSError, UnicodeDecodeError, EngineError) as exc:
            raise click.BadParameter(str(exc), param_hint="--chat-template") from None
    from zerod.engine.logs import setup_logging  # the daemon's format too: one journal, one format

    setup_logging(log_level)
    register_stack_dump()   # ZEROD_STACK_FILE: the daemon's EngineStalled evidence
    from zerod.engine.api.http_edge import PortTaken, bind_socket

    names = list(served_model_name)
    try:
        config = EngineConfig(
            model=model, served_model_name=names[0] if names else None, tokenizer=tokenizer,
            dtype=dtype, load_format=load_format, quantization=quantization,
            kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_prefill_tokens_idle=max_prefill_tokens_idle, max_waiting=max_waiting,
            enable_prefix_caching=enable_prefix_caching, target_itl_ms=target_itl_ms,
            target_ttft_ms=target_ttft_ms, min_prefill_chunk=min_prefill_chunk,
            gpu_memory_utilization=gpu_memory_utilization, kv_pages=kv_pages,
            kv_cache_memory_bytes=kv_cache_memory_bytes, block_size=block_size,
            device=device, tensor_parallel_size=tensor_parallel_size,
            enforce_eager=enforce_eager, seed=seed,
            enable_lora=enable_lora, lora_modules=lora_modules, max_loras=max_loras,
            max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)
    except EngineError as exc:
        raise click.UsageError(str(exc)) from None
    _warn_exposure(host, api_key)
    try:  # before loading anything: a taken port fails now, not after minutes of loading
        sock = bind_socket(host, port)
    except PortTaken as exc:
        click.echo(f"zerod serve: error: {exc.strerror}", err=True)
        sys.exit(1)
    try:
        from zerod.engine.core.engine import Engine

        click.echo(f"zerod serve: loading {model} ...", err=True)
        engine = Engine(config)
        if template is not None:
            engine.tokenizer.set_chat_template(template)
    except (EngineError, ValueError, OSError) as exc:
        click.echo(f"zerod serve: error: {exc}", err=True)
        sys.exit(1)

    from zerod.engine.api.cors import CorsPolicy
    from zerod.engine.api.server import serve_async

    cors = CorsPolicy(tuple(allowed_origins), tuple(allowed_methods), tuple(allowed_headers),
                      allow_credentials)

    def ready(bound: int) -> None:
        st = engine.stats()
        click.echo(f"zerod serve: {engine.model_name} ready on http://{host}:{bound} "
                   f"(pid {os.getpid()}, max_model_len {engine.max_model_len}, "
                   f"{st.kv_pages_total} KV pages)", err=True)
        if model == "demo":
            click.echo("zerod serve: the demo model has random weights: its text is "
                       "meaningless", err=True)

    code = 0
    import threading

    threading.current_thread().name = "zerod-http"  # the event loop's thread, in /health
    try:
        engine.start()
        asyncio.run(serve_async(engine, sock,
                                served_model_names=names or None, api_key=api_key,
                                drain_timeout=drain_timeout,
                                default_max_tokens=default_max_tokens, cors=cors,
                                on_ready=ready,
                                tool_parser=tool_call_parser if enable_auto_tool_choice
                                else None, allow_runtime_lora=allow_runtime_lora))
    except EngineError as exc:
        click.echo(f"zerod serve: error: {exc}", err=True)
        code = 1
    finally:
        try:
            engine.shutdown(0)
        except Exception as exc:  # shutting down must not hide the exit status
            click.echo(f"zerod serve: warning: engine shutdown: {exc}", err=True)
    if code:
        sys.exit(code)
    click.echo("zerod serve: stopped", err=True)


def _warn_exposure(host: str, api_key: str | None) -> None:
    if api_key:
        return
    try:
        loopback = host in ("localhost",) or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        click.echo(f"zerod serve: warning: listening on {host} without --api-key: anyone who "
                   "can reach this address can use the model", err=True)
