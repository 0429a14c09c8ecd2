"""The engines the daemon supervises: `[daemon] engine = "zerod" | "vllm" | "sglang"`.

A preset says how to start the engine from the `[engine]` table (vLLM's flag
names, translated where SGLang names a flag differently), its default port,
where its health answers and whether that answer carries the engine's pid, how
the API key reaches it (never on the command line), and which of its
Prometheus series mean what the daemon reads. zerod.engine.metrics' names are
the daemon's own; the engine metrics watcher reads the others under them, so
supervision, LatencyRegression, the alerts and `zerod top` work the same for
every engine. Where an engine has renamed a series, the newer name comes first.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from zerod.engine import metrics as names

ENGINE_KINDS = ("zerod", "vllm", "sglang")
# [engine] keys that never become flags
NOT_FLAGS = ("api_key",)


def _flags(section: dict[str, Any], renames: dict[str, str],
           negatable: frozenset[str] = frozenset()) -> list[str]:
    """`max_num_seqs = 8` -> `--max-num-seqs 8`, `enforce_eager = true` -> `--enforce-eager`,
    a list -> the flag once per value; false: `--no-KEY` for a `negatable` key (one whose
    default is on), else nothing; absent: nothing."""
    argv: list[str] = []
    for key, value in section.items():
        if value is False and key in negatable:
            argv.append("--no-" + key.replace("_", "-"))
            continue
        if key in NOT_FLAGS or value is None or value is False:
            continue
        flag = renames.get(key) or "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for v in value:
                argv.extend([flag, str(v)])
        else:
            argv.extend([flag, str(value)])
    return argv


@dataclass(frozen=True)
class EnginePreset:
    kind: str
    default_port: int
    reports_pid: bool  # /health says {"pid": …}: another server on the port is told apart
    api_key_env: str | None  # the variable the engine reads its key from; None: it has none
    # the daemon's series name -> this engine's names for it, the first one present wins
    series: dict[str, tuple[str, ...]] = field(default_factory=dict)
    health_path: str = "/health"
    flag_renames: dict[str, str] = field(default_factory=dict)

    def argv(self, engine: dict[str, Any]) -> list[str]:
        section = dict(engine)
        if self.kind == "zerod":
            from zerod.engine.flags import FLAGS

            negatable = frozenset(f.name for f in FLAGS if f.negatable)
            return [sys.executable, "-m", "zerod", "serve", *_flags(section, {}, negatable)]
        if self.kind == "vllm":
            model = section.pop("model", None)
            return ["vllm", "serve", *([str(model)] if model is not None else []), *_flags(section, {})]
        # sglang: its metrics only with --enable-metrics
        return [sys.executable, "-m", "sglang.launch_server", *_flags(section, self.flag_renames),
                "--enable-metrics"]


# the pool's size: its gauge first, its deprecated counter name from an older engine after
_OWN = {names.KV_PAGES_TOTAL: (names.KV_POOL_PAGES, names.KV_PAGES_TOTAL)} | {n: (n,) for n in (
    names.REQUESTS_RUNNING, names.REQUESTS_WAITING, names.KV_PAGES_FREE,
    names.ALLOCATOR_RETRIES_TOTAL, names.ALLOCATOR_OOMS_TOTAL, names.STREAM_ERRORS_TOTAL,
    names.GENERATION_TOKENS_TOTAL, names.PROMPT_TOKENS_TOTAL,
    names.TIME_TO_FIRST_TOKEN_SECONDS, names.INTER_TOKEN_LATENCY_SECONDS,
    names.PREFIX_CACHE_QUERIES_TOTAL, names.PREFIX_CACHE_HITS_TOTAL, names.PREFIX_CACHE_PAGES,
    names.SLOW_STEPS_TOTAL, names.MAX_ITL_SECONDS)}

PRESETS = {
    "zerod": EnginePreset("zerod", 8000, True, "ZEROD_API_KEY", _OWN),
    "vllm": EnginePreset("vllm", 8000, False, "VLLM_API_KEY", {
        names.REQUESTS_RUNNING: ("vllm:num_requests_running",),
        names.REQUESTS_WAITING: ("vllm:num_requests_waiting",),
        names.GENERATION_TOKENS_TOTAL: ("vllm:generation_tokens_total",),
        names.PROMPT_TOKENS_TOTAL: ("vllm:prompt_tokens_total",),
        names.TIME_TO_FIRST_TOKEN_SECONDS: ("vllm:time_to_first_token_seconds",),
        names.INTER_TOKEN_LATENCY_SECONDS: ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        names.PREFIX_CACHE_QUERIES_TOTAL: ("vllm:prefix_cache_queries_total",),
        names.PREFIX_CACHE_HITS_TOTAL: ("vllm:prefix_cache_hits_total",),
    }),
    "sglang": EnginePreset("sglang", 30000, False, None, {
        names.REQUESTS_RUNNING: ("sglang:num_running_reqs",),
        names.REQUESTS_WAITING: ("sglang:num_queue_reqs",),
        names.GENERATION_TOKENS_TOTAL: ("sglang:generation_tokens_total",),
        names.PROMPT_TOKENS_TOTAL: ("sglang:prompt_tokens_total",),
        names.TIME_TO_FIRST_TOKEN_SECONDS: ("sglang:time_to_first_token_seconds",),
        names.INTER_TOKEN_LATENCY_SECONDS: ("sglang:inter_token_latency_seconds",
                                            "sglang:time_per_output_token_seconds"),
    }, flag_renames={
        "model": "--model-path", "tokenizer": "--tokenizer-path", "served_model_name": "--served-model-name",
        "gpu_memory_utilization": "--mem-fraction-static", "max_num_seqs": "--max-running-requests",
        "max_model_len": "--context-length", "tensor_parallel_size": "--tp-size",
    }),
}
