"""`zerod serve`: the engine alone behind its OpenAI-compatible HTTP server.

Its options come from engine/flags.py's table (vLLM's names wherever the meaning is the
same; EngineConfig's defaults); a `vllm serve` command line is turned into them first
(engine/serve_argv.py). Errors a user can
cause (a missing model directory, a bad flag value, a taken port, an engine that cannot
start with this model) are printed as one plain line and exit non-zero, never as a
traceback. The port is bound before the model loads, so a taken one fails at once.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import click
from zerod import CONTEXT_SETTINGS
from zerod.engine.core.stack_dump import register_from_env as register_stack_dump
from zerod.engine.config import EngineConfig, EngineError, device_type
from zerod.engine.flags import FLAGS, engine_config_kwargs, read_chat_template
from zerod.engine.generation_defaults import (describe_defaults, generation_defaults,
                                              split_max_tokens)
from zerod.engine.serve_argv import normalize


class ServeCommand(click.Command):
    """Takes a `vllm serve` command line: serve_argv turns it into zerod's own first
    (the positional MODEL, several values after one flag, --config FILE.yaml, vLLM's
    flags without a zerod option); the no-op flags' info lines wait in ctx.meta."""

    def parse_args(self, ctx, args):
        args, notes = normalize(args)
        ctx.meta[NOTES] = notes
        ctx.meta[ARGV] = list(args)   # zerod's own flags: what --api-server-count's processes get
        return super().parse_args(ctx, args)


NOTES = "zerod.serve.notes"
ARGV = "zerod.serve.argv"


def _lora_modules(ctx, param, values):
    from zerod.engine.lora.manager import parse_lora_module

    try:
        return tuple(parse_lora_module(v) for v in values)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _check_model(ctx, param, value):
    if value is None or value == "demo":
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


_CALLBACKS = {"model": _check_model, "lora_modules": _lora_modules}


def _options(command):
    """zerod serve's click options, one per row of engine/flags.py's table."""
    for flag in reversed(FLAGS):
        opt = flag.option()
        opt.callback = _CALLBACKS.get(flag.name)
        command.params.insert(0, opt)
    return command


@_options
@click.command("serve", cls=ServeCommand, options_metavar="[MODEL] [OPTIONS]",
               context_settings={**CONTEXT_SETTINGS, "max_content_width": 100},
               epilog="A `vllm serve` command line works too: MODEL as the first argument, "
                      "--config FILE.yaml (vLLM's keys), and vLLM's other flags, each honoured, "
                      "a no-op with an info line, or refused with the reason "
                      "(docs/engine-server.md).")
def serve(**opts):
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions,
    /v1/chat/completions, /v1/models, /health, /metrics)."""
    ctx = click.get_current_context()
    o = SimpleNamespace(**opts)
    # flags first: an operator's typo fails before anything is set up
    if o.model is None:
        raise click.UsageError("Missing MODEL: give a checkpoint directory (zerod serve "
                               "MODEL, or --model DIR), or 'demo'")
    if o.block_size & (o.block_size - 1):
        raise click.BadParameter("must be a power of two", param_hint="--block-size")
    if o.enable_auto_tool_choice and o.tool_call_parser is None:
        raise click.UsageError("--enable-auto-tool-choice needs --tool-call-parser")
    if (o.lora_modules or o.allow_runtime_lora) and not o.enable_lora:
        raise click.UsageError("--lora-modules and --allow-runtime-lora need --enable-lora")
    from zerod.engine.process.servers import ServerProcesses, attached, ignore_further_stops

    try:
        place = attached()   # one of --api-server-count's processes after the first
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    engine_process = o.engine_process
    if o.api_server_count > 1 or place is not None:
        if engine_process is False:
            raise click.UsageError("--api-server-count above 1 needs the engine in its own "
                                   "process: drop --no-engine-process (ZEROD_ENGINE_PROCESS=0, "
                                   "engine_process = false)")
        engine_process = True
    elif engine_process is None:
        engine_process = _on_gpu(o.device)
    template = None
    if o.chat_template is not None:
        from zerod.engine.tokenizer import compile_chat_template

        try:  # before loading anything: a broken template fails now
            template = read_chat_template(o.chat_template)
            compile_chat_template(template)
        except (OSError, UnicodeDecodeError, EngineError) as exc:
            raise click.BadParameter(str(exc), param_hint="--chat-template") from None
    try:
        gen_defaults = generation_defaults(o.generation_config, o.model,
                                           o.override_generation_config)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--generation-config") from None
    field_defaults, default_max_tokens = split_max_tokens(gen_defaults, o.default_max_tokens)
    if o.max_logprobs is not None:
        from zerod.engine.sampling.logprobs import MAX_LOGPROBS  # torch: only when asked

        if o.max_logprobs > MAX_LOGPROBS:
            raise click.BadParameter(f"must be <= {MAX_LOGPROBS} (the engine's cap)",
                                     param_hint="--max-logprobs")
    from zerod.engine.logs import setup_logging  # the daemon's format: one journal, one format

    setup_logging("debug" if o.log_level == "trace" else o.log_level, o.log_format,
                  "zerod-serve")
    register_stack_dump()   # ZEROD_STACK_FILE: the daemon's EngineStalled evidence
    for note in ctx.meta.get(NOTES, ()):
        click.echo(f"zerod serve: info: {note}", err=True)
    from zerod.engine.api.http_edge import PortTaken, bind_socket

    names = list(o.served_model_name)
    try:
        config = EngineConfig(**engine_config_kwargs(opts), model=o.model,
                              served_model_name=names[0] if names else None)
    except EngineError as exc:
        raise click.UsageError(str(exc)) from None
    if place is None:
        _warn_exposure(o.host, o.api_key)
        try:  # before loading anything: a taken port fails now, not after minutes of loading
            sock = bind_socket(o.host, o.port)
        except PortTaken as exc:
            click.echo(f"zerod serve: error: {exc.strerror}", err=True)
            sys.exit(1)
    else:
        import socket

        place.die_with_parent()
        sock = socket.socket(fileno=place.listen_fd)
    try:
        if place is None:
            click.echo(f"zerod serve: loading {o.model} ...", err=True)
        if engine_process:
            from zerod.engine.process.client import EngineClient

            engine = EngineClient(config, "debug" if o.log_level == "trace" else o.log_level,
                                  o.log_format, servers=o.api_server_count,
                                  attach=(place.index, place.channel_fd) if place else None)
        else:
            from zerod.engine.core.engine import Engine

            engine = Engine(config)
        if template is not None:
            engine.tokenizer.set_chat_template(template)
    except (EngineError, ValueError, OSError) as exc:
        click.echo(f"zerod serve: error: {exc}", err=True)
        sys.exit(1)

    from zerod.engine.api.cors import CorsPolicy
    from zerod.engine.api.server import serve_async

    cors = CorsPolicy(tuple(o.allowed_origins), tuple(o.allowed_methods),
                      tuple(o.allowed_headers), o.allow_credentials)

    # An engine in its own process that exits ends this server too, as the engine's end
    # ends an in-process server: its requests have failed by then, and the daemon restarts
    # a process that exits at once (one that answers 503 only after its probes fail).
    stop = asyncio.Event()
    loop_of: list[asyncio.AbstractEventLoop] = []

    def engine_lost(why: str) -> None:   # the client's reader thread
        if loop_of:
            loop_of[0].call_soon_threadsafe(stop.set)

    if engine_process:
        engine.on_lost = engine_lost

    def ready(bound: int) -> None:
        loop_of.append(asyncio.get_running_loop())
        if engine_process and engine.lost:
            stop.set()
        if place is not None:
            place.ready()
            click.echo(f"zerod serve: HTTP server {place.index} ready on http://{o.host}:{bound} "
                       f"(pid {os.getpid()})", err=True)
            return
        st = engine.stats()
        click.echo(f"zerod serve: {engine.model_name} ready on http://{o.host}:{bound} "
                   f"(pid {os.getpid()}, max_model_len {engine.max_model_len}, "
                   f"{st.kv_pages_total} KV pages; {_since_process_start():.1f}s after the process "
                   f"started, {engine.ready_seconds:.1f}s of them in the engine)", err=True)
        click.echo(f"zerod serve: request defaults: {describe_defaults(gen_defaults)}",
                   err=True)
        if o.model == "demo":
            click.echo("zerod serve: the demo model has random weights: its text is "
                       "meaningless", err=True)

    code = 0
    import threading

    threading.current_thread().name = "zerod-http"  # the event loop's thread, in /health
    others = None
    try:
        engine.start()
        if o.api_server_count > 1 and place is None:
            others = ServerProcesses(ctx.meta[ARGV], engine.spare_channels, sock)
            others.wait_ready()
        on_stop = others.terminate if others else (ignore_further_stops if place else None)
        asyncio.run(serve_async(engine, sock, on_stop=on_stop,
                                stop_event=stop,
                                served_model_names=names or None, api_key=o.api_key,
                                drain_timeout=o.drain_timeout,
                                default_max_tokens=default_max_tokens, cors=cors,
                                on_ready=ready,
                                tool_parser=o.tool_call_parser if o.enable_auto_tool_choice
                                else None, allow_runtime_lora=o.allow_runtime_lora,
                                generation_defaults=field_defaults,
                                max_logprobs=o.max_logprobs,
                                log_requests=o.enable_log_requests,
                                access_log=not o.disable_uvicorn_access_log,
                                reasoning_parser=o.reasoning_parser,
                                max_log_len=o.max_log_len))
        if engine_process and engine.lost:
            raise EngineError(engine.lost)
    except EngineError as exc:
        click.echo(f"zerod serve: error: {exc}", err=True)
        code = 1
    finally:
        if others is not None:   # their requests drain as this one's did
            others.wait(o.drain_timeout + 10)
        try:
            engine.shutdown(0)
        except Exception as exc:  # shutting down must not hide the exit status
            click.echo(f"zerod serve: warning: engine shutdown: {exc}", err=True)
    if code:
        sys.exit(code)
    click.echo("zerod serve: stopped", err=True)


def _on_gpu(device: str | None) -> bool:
    """Whether the engine will run on a GPU, which is where its own process pays: the HTTP
    server's Python no longer delays the step thread's launches (docs/perf.md, *The engine
    in its own process*). On the CPU the measured gain is none and each start pays a second
    interpreter."""
    return device_type(device or "auto") == "cuda"


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


def _since_process_start() -> float:
    """Seconds since this process started (the kernel's record), imports included: its
    start in clock ticks since boot against CLOCK_BOOTTIME, both exact to a tick.
    psutil's create_time() adds the boot time, which /proc/stat gives in whole seconds, so
    the difference would be off by up to a second."""
    import time

    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rfind(b")") + 2:].split()[19])   # field 22, starttime
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):   # not Linux
        import psutil

        return time.time() - psutil.Process().create_time()
