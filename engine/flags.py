"""The one table of `zerod serve`'s flags.

Each row says a flag's name (vLLM's where the meaning is the same), the other
spellings vLLM gives it, its type, its bound, its help, and whether it is an
EngineConfig field (whose default it then takes). The click options of
`zerod serve`, the bounds EngineConfig checks, the keys of `--config FILE.yaml`
and of the daemon's `[engine]` table, and the flag table in docs/engine-server.md
are all derived from it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from .reasoning import REASONING_PARSERS
from .api.tools import PARSERS
from zerod.engine.logs import LOG_FORMATS

from .config import (KV_CACHE_DTYPES, MAX_COUNT, MAX_NUM_SEQS, QUANTIZATIONS, EngineConfig,
                     parse_token_count)

_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}

# --------------------------------------------------------------------------- value types

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


class ByteSize(click.ParamType):
    """An integer of bytes, or with a suffix: 512M, 2G, 2GiB (powers of 1024)."""

    name = "bytes"

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        else:
            m = _SIZE.match(str(value))
            if not m:
                self.fail(f"{value!r} is not a size (e.g. 4000000000, 512M, 2GiB)", param, ctx)
            n = int(float(m.group(1)) * 1024 ** " kmgt".index(m.group(2).lower() or " "))
        if n <= 0:
            self.fail("must be > 0", param, ctx)
        return n


class TokenCount(click.ParamType):
    """A token count as vLLM reads one (engine/config.py's parse_token_count); with
    `auto`, also auto / -1 for the model's own value (None). Its bound is the flag's
    (Flag.lo/hi)."""

    def __init__(self, auto: bool = False):
        self.auto = auto
        self.name = "N|32k|1M" + ("|auto" if auto else "")

    def convert(self, value, param, ctx):
        if value is None:
            return None
        try:
            return parse_token_count(value, self.auto)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class OutOfBound(click.BadParameter):
    """A value outside its flag's bound. The message names the flag, the bound and the
    value (the command line shows no value of its own); `allowed` is the bound alone, for
    a config file's refusal line, which names the key and the value already."""

    def __init__(self, message: str, allowed: str, ctx=None, param=None):
        super().__init__(message, ctx, param)
        self.allowed = allowed


class Bounded(click.ParamType):
    """A number within its flag's bound: the base type reads the word, the flag's table
    judges it, so the command line, --config, [engine] and EngineConfig refuse in the
    same words."""

    def __init__(self, base: click.ParamType, flag: "Flag"):
        self.base, self.flag = base, flag
        self.name = base.name

    def convert(self, value, param, ctx):
        v = self.base.convert(value, param, ctx)
        allowed = self.flag.allowed(v)
        if allowed is not None:
            raise OutOfBound(f"{self.flag.name} {allowed}, got {v}", allowed, ctx, param)
        return v


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
        try:
            v = json.loads(value)
        except ValueError:
            v = None
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            self.fail(f"{value!r} is not a JSON list of strings (e.g. '[\"*\"]')", param, ctx)
        return v


class JsonObject(click.ParamType):
    """A JSON object, as vLLM's `--override-generation-config '{"temperature": 0.5}'`."""

    name = "json"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            v = json.loads(value)
        except ValueError:
            v = None
        if not isinstance(v, dict):
            self.fail(f"{value!r} is not a JSON object (e.g. '{{\"temperature\": 0.5}}')",
                      param, ctx)
        return v


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Flag:
    name: str                      # the option's name; --name-with-dashes on the command line
    help: str
    kind: Any = str                # int | float | str | bool | a click.ParamType
    lo: float | None = None        # bounds, inclusive
    hi: float | None = None
    aliases: tuple[str, ...] = ()  # vLLM's other spellings (-tp, --shutdown-timeout)
    field: bool = True             # an EngineConfig field: its default is the field's
    default: Any = None            # the default of a flag that is not a field
    negatable: bool = False        # a bool flag with --no-NAME too (vLLM's BooleanOptionalAction)
    many: bool = False             # several values (vLLM's nargs "+"): after one flag, or repeated
    envvar: tuple[str, ...] = ()
    metavar: str | None = None

    @property
    def opt(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def spellings(self) -> tuple[str, ...]:
        return (self.opt, *self.aliases)

    @property
    def takes_value(self) -> bool:
        return self.kind is not bool

    @property
    def default_value(self) -> Any:
        return _FIELD_DEFAULTS[self.name] if self.field else self.default

    @property
    def bounded(self) -> bool:
        return self.lo is not None or self.hi is not None

    def click_type(self) -> Any:
        if not self.bounded:
            return self.kind
        base = {int: click.INT, float: click.FLOAT}.get(self.kind, self.kind)
        return Bounded(base, self)

    def bound_note(self) -> str:
        """' (in [1, 16384])' after the help of a bounded flag (--help, the docs' table)."""
        return f" ({describe_bound(self.lo, self.hi)})" if self.bounded else ""

    def allowed(self, value: Any) -> str | None:
        """The side of the bound `value` is past ("must be <= 16384"), None within it."""
        if value is None or not self.bounded:
            return None
        if self.lo is not None and value < self.lo:
            return f"must be >= {_num(self.lo)}"
        if self.hi is not None and value > self.hi:
            return f"must be <= {_num(self.hi)}"
        return None

    def bound_problem(self, value: Any) -> str | None:
        """What is wrong with `value` for this flag's bound (None: fine), naming the flag,
        what is allowed and the value; EngineConfig asks this, so the bound has one owner
        whether the value came from a flag, a config file or code."""
        if value is None and self.default_value is None:
            return None
        if self.kind is int or isinstance(self.kind, TokenCount):
            if isinstance(value, bool) or not isinstance(value, int):
                return f"{self.name} must be a whole number, got {value!r}"
        elif self.kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                return f"{self.name} must be a finite number, got {value!r}"
        else:
            return None
        allowed = self.allowed(value)
        return None if allowed is None else f"{self.name} {allowed}, got {value}"

    def option(self) -> click.Option:
        names = [f"{self.opt}/--no-{self.opt[2:]}" if self.negatable else self.opt,
                 *self.aliases, self.name]
        kw: dict[str, Any] = {"help": self.help + self.bound_note(), "default": self.default_value}
        if self.kind is bool and not self.negatable:
            kw["is_flag"] = True
        elif self.kind is not bool:
            kw["type"] = self.click_type()
        if self.many:
            kw["multiple"] = True
            kw["default"] = tuple(self.default_value or ())
        if self.envvar:
            kw["envvar"] = list(self.envvar)
        if self.metavar:
            kw["metavar"] = self.metavar
        kw["show_default"] = kw["default"] not in (None, (), False)
        return click.Option(names, **kw)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def describe_bound(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{_num(lo)}, {_num(hi)}]"
    return f">= {_num(lo)}" if lo is not None else f"<= {_num(hi)}"


_LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "trace")

FLAGS: tuple[Flag, ...] = (
    # the model
    Flag("model", "Checkpoint directory (HF layout: config.json, *.safetensors, tokenizer.json), "
         "or 'demo' for the built-in tiny random model; also the first positional argument "
         "(`zerod serve MODEL`, as `vllm serve MODEL`).", default=None, field=False,
         metavar="DIR"),
    Flag("config", "A YAML file of flags, as vLLM's --config (keys are flag names, with "
         "dashes or underscores); the command line's own flags win.", field=False,
         metavar="FILE.yaml"),
    Flag("served_model_name", "Names clients pass as `model` (several after one flag, or "
         "the flag repeated). Default: the model's name.", field=False, many=True,
         metavar="NAME"),
    Flag("tokenizer", "Directory with tokenizer.json (default: the model directory).",
         click.Path(exists=True, file_okay=False), metavar="DIR"),
    Flag("dtype", "Weights and KV cache dtype; auto = config.json's (float32 on CPU).",
         click.Choice(["auto", "bfloat16", "float16", "half", "float32", "float"])),
    Flag("load_format", "dummy: random weights from config.json alone (benchmarks).",
         click.Choice(["auto", "safetensors", "dummy"])),
    Flag("quantization", "fp8: quantize an unquantized checkpoint at load (e4m3 weights with "
         "a scale per output channel, activations per token; compute capability 8.9+). FP8 "
         "checkpoints are served as published without it.", click.Choice(QUANTIZATIONS),
         aliases=("-q",)),
    Flag("kv_cache_dtype", "KV cache pages: auto = the model dtype; fp8 (= fp8_e4m3) halves "
         "their bytes (the checkpoint's k/v scales, else 1.0; compute capability 8.9+).",
         click.Choice(KV_CACHE_DTYPES)),
    Flag("max_model_len", "Context length (prompt + output): 32768, 32k, 32K, 1M or auto. "
         "Default: the model's, capped by the KV pool.", TokenCount(auto=True),
         metavar="N|32k|auto", lo=2, hi=MAX_COUNT),
    Flag("generation_config", "Request defaults: auto = the model's generation_config.json "
         "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), vllm = "
         "none, or a directory holding a generation_config.json.", default="auto",
         field=False, metavar="auto|vllm|DIR"),
    Flag("override_generation_config", "A JSON object of request defaults laid over "
         "--generation-config's, e.g. '{\"temperature\": 0.5}'.", JsonObject(), field=False,
         metavar="JSON"),
    # the scheduler
    Flag("max_num_seqs", "Most requests running at once.", int, lo=1, hi=MAX_NUM_SEQS),
    Flag("max_num_batched_tokens", "Prompt tokens per step (chunked prefill budget; 2048, "
         "8k ...).", TokenCount(), metavar="N|8k", lo=1, hi=MAX_COUNT),
    Flag("max_prefill_tokens_idle", "Prompt tokens per step while nothing decodes (a long "
         "prompt then goes in whole, unchunked).", TokenCount(), metavar="N|16k",
         lo=1, hi=MAX_COUNT),
    Flag("enable_prefix_caching", "Share the KV of full prompt pages between requests with "
         "the same prefix.", bool, negatable=True),
    Flag("target_itl_ms", "While streams decode, prompt chunks keep a step within this (from "
         "measured step costs), down to --min-prefill-chunk.", float, lo=0.1, hi=1e5),
    Flag("target_ttft_ms", "While streams decode, prompt chunks grow so that each waiting "
         "prompt gets its first token within this (plus its own prefill time), up to "
         "--max-num-batched-tokens.", float, lo=0.1, hi=1e5),
    Flag("min_prefill_chunk", "Prompt tokens a step takes at least while streams decode "
         "(prefill is never starved).", int, lo=1, hi=MAX_COUNT),
    Flag("max_waiting", "Wait line bound; beyond it requests get 429 with Retry-After.",
         int, lo=0, hi=MAX_COUNT),
    # memory
    Flag("gpu_memory_utilization", "CUDA: fraction of the GPU the engine may hold (weights + "
         "KV pool + activations).", float, lo=0.05, hi=1.0),
    Flag("kv_pages", "KV pool size in pages of --block-size tokens (CPU budget; on CUDA it "
         "overrides --gpu-memory-utilization's sizing).", int, lo=2, hi=MAX_COUNT),
    Flag("kv_cache_memory_bytes", "CPU: KV pool budget in bytes when --kv-pages is not given "
         "(e.g. 2GiB; default 256 MiB).", ByteSize(), metavar="BYTES"),
    Flag("block_size", "KV page size in tokens (a power of two).", int, lo=1, hi=MAX_COUNT),
    # the device
    Flag("device", "cpu, cuda, cuda:N; auto = cuda if available.", Device(),
         metavar="auto|cpu|cuda|cuda:N"),
    Flag("tensor_parallel_size", "Split the model over N GPUs (the first N visible: set "
         "CUDA_VISIBLE_DEVICES), one process per GPU; on the CPU, N processes.", int, lo=1,
         aliases=("-tp",)),
    Flag("enforce_eager", "CUDA: no CUDA graphs.", bool),
    Flag("engine_process", "Run the engine (scheduler, step loop, output poller) in a process "
         "of its own beside the HTTP server's, so the two share no GIL (zerod's own flag; "
         "vLLM always splits them). Default: on where the engine runs on a GPU, off on the "
         "CPU.", bool, default=None, field=False, negatable=True,
         envvar=("ZEROD_ENGINE_PROCESS",)),
    Flag("api_server_count", "HTTP server processes on the port, each its own event loop and "
         "GIL, all in front of one engine; above 1 the engine runs in its own process "
         "(--engine-process).", int, lo=1, hi=64, default=1, field=False, aliases=("-asc",)),
    Flag("seed", "Seeds dummy weights and requests that carry no seed.", int),
    # the HTTP server
    Flag("host", "Bind address.", default="127.0.0.1", field=False, metavar="ADDR"),
    Flag("port", "TCP port (0: any free one).", int, lo=0, hi=65535, default=8000, field=False),
    Flag("api_key", "Require 'Authorization: Bearer KEY' on /v1/* (env ZEROD_API_KEY or, as "
         "vLLM, VLLM_API_KEY).", field=False, envvar=("ZEROD_API_KEY", "VLLM_API_KEY"),
         metavar="KEY"),
    Flag("drain_timeout", "On SIGTERM: seconds in-flight requests get to finish before they "
         "are ended.", float, lo=0, default=30.0, field=False, aliases=("--shutdown-timeout",),
         metavar="S"),
    Flag("default_max_tokens", "Cap for requests that send no max_tokens (chat; completions "
         "default to 16 as OpenAI). Default: what the context leaves, which reserves KV pages "
         "for the whole context at admission.", int, lo=1, field=False),
    Flag("max_logprobs", "Most logprobs / top_logprobs / prompt_logprobs a request may ask "
         "for. Default: the engine's cap, MAX_LOGPROBS (vLLM's default).", int, lo=0,
         field=False),
    Flag("allowed_origins", "CORS: origins allowed (a JSON list, as vLLM's).", JsonList(),
         default='["*"]', field=False, metavar="JSON"),
    Flag("allowed_methods", "CORS: methods allowed (a JSON list).", JsonList(),
         default='["*"]', field=False, metavar="JSON"),
    Flag("allowed_headers", "CORS: request headers allowed (a JSON list).", JsonList(),
         default='["*"]', field=False, metavar="JSON"),
    Flag("allow_credentials", "CORS: allow credentials (cookies, Authorization).", bool,
         default=False, field=False),
    Flag("chat_template", "A Jinja chat template served instead of the model's: a file, or "
         "the template itself inline.", field=False, metavar="FILE|TEMPLATE"),
    Flag("enable_auto_tool_choice", 'Serve tool_choice "auto" (the default with tools); needs '
         "--tool-call-parser.", bool, default=False, field=False),
    Flag("tool_call_parser", "How tool calls are read from the output (see "
         "docs/engine-server.md).", click.Choice(PARSERS), field=False),
    Flag("reasoning_parser", "Split chat answers' reasoning (reasoning_content) from their "
         "content: deepseek_r1 (DeepSeek-R1, and templates that open the thinking) or qwen3.",
         click.Choice(REASONING_PARSERS), field=False),
    # LoRA
    Flag("enable_lora", "Serve LoRA adapters: a request names one in `model`.", bool),
    Flag("lora_modules", "LoRA adapters (PEFT directories) served from the start: name=path "
         "or vLLM's JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; several "
         "after one flag, or the flag repeated.", many=True, metavar="NAME=PATH"),
    Flag("max_loras", "LoRA adapters on the device at once (fixed slabs; a batch mixes up to "
         "this many).", int, lo=1, hi=256),
    Flag("max_lora_rank", "Largest LoRA rank served (sizes the slabs).", int, lo=1, hi=512),
    Flag("max_cpu_loras", "LoRA adapters kept in host memory (others are read again from "
         "disk when asked for). Default: --max-loras.", int, lo=1, hi=MAX_COUNT),
    Flag("allow_runtime_lora", "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter.",
         bool, default=False, field=False),
    # logs
    Flag("log_level", "Log level (trace = debug).", click.Choice(_LOG_LEVELS),
         default="info", field=False, aliases=("--uvicorn-log-level",)),
    Flag("log_format", "text: one line per record (journald's own fields under systemd); "
         "json: one JSON object per record.", click.Choice(LOG_FORMATS), default="text",
         field=False),
    Flag("enable_log_requests", "Log each request's prompt and sampling parameters (as "
         "vLLM's; off by default).", bool, default=False, field=False),
    Flag("max_log_len", "--enable-log-requests: the most characters of a prompt it prints "
         "(default: all).", int, lo=0, field=False),
    Flag("disable_uvicorn_access_log", "No access-log line per request (on by default).",
         bool, default=False, field=False),
)

BY_NAME = {f.name: f for f in FLAGS}
# every spelling on the command line -> its flag (--no-X too)
BY_SPELLING = {s: f for f in FLAGS for s in f.spellings} | {
    f"--no-{f.opt[2:]}": f for f in FLAGS if f.negatable}


def field_flags() -> tuple[Flag, ...]:
    return tuple(f for f in FLAGS if f.field)


def config_problems(config: EngineConfig) -> list[str]:
    """The bounds of the table checked on a built EngineConfig."""
    return [p for f in field_flags() if (p := f.bound_problem(getattr(config, f.name)))]


def engine_config_kwargs(values: dict[str, Any]) -> dict[str, Any]:
    """The EngineConfig fields among parsed flag values."""
    return {f.name: values[f.name] for f in field_flags() if f.name in values}


def markdown_table() -> str:
    """The flag table of docs/engine-server.md."""
    rows = ["| Flag | Default | Meaning |", "|---|---|---|"]
    for f in FLAGS:
        spell = ", ".join(f"`{s}`" for s in f.spellings)
        if f.negatable:
            spell += f", `--no-{f.opt[2:]}`"
        d = f.default_value
        default = "" if d in (None, (), False) else f"`{d}`"
        rows.append(f"| {spell} | {default} | {f.help}{f.bound_note()} |")
    return "\n".join(rows)


def usage_block(head: str = "zerod serve   ", width: int = 100) -> str:
    """The README's `zerod serve` lines: every flag, wrapped."""
    words = ["MODEL|demo"]
    for f in FLAGS:
        if f.name == "model":
            words.append("[--model DIR]")
            continue
        value = "" if f.kind is bool else " " + (f.metavar or _metavar(f))
        alt = f" | --no-{f.opt[2:]}" if f.negatable else ""
        words.append(f"[{f.opt}{value}{alt}]" + (" ..." if f.many else ""))
    lines, line = [], head
    for w in words:
        if len(line) + 1 + len(w) > width and line.strip():
            lines.append(line.rstrip())
            line = " " * len(head)
        line += w + " "
    return "\n".join(lines + [line.rstrip()])


def _metavar(f: Flag) -> str:
    choices = getattr(f.kind, "choices", None)
    if choices:
        return "|".join(choices)
    return {int: "N", float: "F"}.get(f.kind, "VALUE")


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it is a template (vLLM
    takes both). A value that is neither is an error naming both readings."""
    p = Path(value).expanduser()
    if p.is_file():
        return p.read_text()
    if any(mark in value for mark in ("{{", "{%", "\n")):
        return value
    raise OSError(f"{value!r} is neither a file nor a Jinja template")
