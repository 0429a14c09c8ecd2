"""`zerod bench`: a streaming HTTP benchmark client for a running OpenAI-compatible server.

Like `vllm bench serve`: random token-id prompts of set input/output lengths sent to
/v1/completions with `ignore_eos` and `max_tokens` = output length, streamed; a fixed
concurrency and/or a Poisson request rate; warm-up requests excluded from the figures.
Reports request and output-token throughput, TTFT, ITL (gaps between streamed chunks),
TPOT ((e2e - TTFT) / (output tokens - 1)) and e2e latency with mean/p50/p95/p99, and the
server's CPU use over the measured window read from /proc/PID (whole process and per
thread name), and writes JSON (`--out`).

Named scenarios (`--scenario`, repeatable, or `all`):
  hello-ttft    prompt "Hello", max_tokens 1, one request at a time
  streams-200   200 concurrent streams, 24 prompt tokens, 128 output tokens
  long-context  decode after a 16K-token prompt vs after a 1K prompt: ITL percentiles
  decode-b1     batch-1 decode tokens/s (16 prompt tokens, 256 output tokens)
  prefill-16k   time to first token of a 16K-token prompt
  mix           Poisson 25 req/s, prompts 32-4096 and outputs 16-512 tokens, log-uniform
  prefix        Poisson 16 req/s, one of 16 shared 2,000-token prefixes + 48 unique tokens,
                64 output tokens; reports the prefix-cache hit rate
  throughput-table  docs/perf.md's table in one command: streams-200 twice (two bursts,
                no warm-up), decode-b1, prefill-16k
`--goodput ttft:MS --goodput itl:MS` adds the share (and rate) of requests meeting every
SLO given, as vLLM's benchmark counts goodput (itl = a request's mean inter-token gap).
Flags given explicitly override a scenario's values (e.g. smaller shapes on a CPU), except
what defines it: hello-ttft keeps its prompt and max_tokens 1, prefill-16k max_tokens 1.

vLLM's `bench serve` flags: `--backend openai|vllm|openai-chat` (the chat endpoint: a
random prompt is sent as words), `--dataset-name sharegpt --dataset-path FILE`
(bench/datasets.py), `--burstiness` (gamma arrivals), `--save-result --result-dir
--result-filename` (vLLM's result file: bench/vllm_result.py).

Runs with only the standard library, click and aiohttp (no numpy, no psutil, nothing of
the engine): it measures any OpenAI-compatible server from outside.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import click
from zerod import CONTEXT_SETTINGS

from zerod.bench.client import BACKENDS, Client
from zerod.bench.datasets import DatasetError, load_sharegpt
from zerod.bench.scenarios import COMPOSITE, ORDER, SCENARIOS, run_scenario
from zerod.bench.vllm_result import default_filename, save, vllm_result


def _f(v: Any, fmt: str = "{:,.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def table(results: dict[str, dict]) -> str:
    rows = [("scenario", "ok/n", "req/s", "out tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms",
             "max ITL ms", "gaps >100ms", "TPOT p50 ms", "cores")]

    def row(label: str, r: dict) -> tuple:
        cpu = r.get("engine_cpu") or {}
        return (label, f"{r['completed']}/{r['num_requests']}", _f(r["request_throughput"],
                "{:,.2f}"), _f(r["output_throughput"]),
                f"{_f(r['ttft_ms']['p50'])}/{_f(r['ttft_ms']['p99'])}",
                f"{_f(r['itl_ms']['p50'], '{:.2f}')}/{_f(r['itl_ms']['p99'], '{:.2f}')}",
                _f(r["itl_ms"]["max"]), _f(r.get("itl_gaps_over_100ms"), "{:d}"),
                _f(r["tpot_ms"]["p50"], "{:.2f}"), _f(cpu.get("cores"), "{:.2f}"))

    for name, r in results.items():
        if "phases" in r:
            for ph, pr in r["phases"].items():
                rows.append(row(f"{name}:{ph}", pr))
        else:
            rows.append(row(name, r))
    widths = [max(len(str(x[i])) for x in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(rw, widths)) for rw in rows]
    extra = []
    for name, r in results.items():
        if "itl_p99_over_p50" in r:
            q = r["itl_p99_over_p50"]
            extra.append(f"{name}: ITL p99/p50 short {_f(q['short'], '{:.3f}')}, long "
                         f"{_f(q['long'], '{:.3f}')}, long-short "
                         f"{_f(r['long_minus_short'], '{:+.3f}')}")
        elif r.get("decode_tokens_per_s") and name == "decode-b1":
            extra.append(f"{name}: decode {r['decode_tokens_per_s']['mean']:,.1f} tokens/s "
                         "per request")
        if r.get("prefix_cache_hit_rate"):
            extra.append(f"{name}: prefix-cache hit rate {r['prefix_cache_hit_rate']:.1%} of prompt tokens")
        if r.get("goodput"):
            g = r["goodput"]
            slos = ", ".join(f"{k} <= {v:g} ms" for k, v in g["slos_ms"].items())
            extra.append(f"{name}: goodput {g['good']}/{r['num_requests']} requests "
                         f"({g['share']:.1%}, {g['request_throughput']:.2f} req/s) met {slos}")
    return "\n".join(lines + extra)


# --------------------------------------------------------------------------- command


async def _server_info(base_url: str, api_key: str | None) -> tuple[dict, list[str]]:
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        try:
            async with s.get(base_url + "/health") as r:
                try:
                    health = await r.json(content_type=None)
                except ValueError:
                    health = {}
                health["_status"] = r.status
            async with s.get(base_url + "/v1/models", headers=headers) as r:
                models = await r.json(content_type=None) if r.status == 200 else {}
        except aiohttp.ClientError as exc:
            raise click.ClickException(f"cannot reach the server at {base_url}: {exc}")
    names = [m.get("id") for m in (models.get("data") or []) if isinstance(m, dict)]
    return health, names


def _is_local(base_url: str) -> bool:
    from urllib.parse import urlparse

    host = urlparse(base_url).hostname or ""
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")


@click.command("bench", context_settings={**CONTEXT_SETTINGS, "max_content_width": 100})
@click.option("--base-url", default=None, help="Server URL (default http://HOST:PORT).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--model", default=None, help="Model name to send (default: the server's first).")
@click.option("--lora-modules", "lora_modules", multiple=True, metavar="NAME[,NAME...]",
              help="LoRA adapters served by the server (vLLM's flag): each request names one "
                   "of them, chosen at random, as its model.")
@click.option("--api-key", envvar="ZEROD_API_KEY", default=None)
@click.option("--scenario", "scenarios", multiple=True,
              type=click.Choice(list(SCENARIOS) + list(COMPOSITE) + ["all", "random"]),
              help="Named scenario (repeatable); 'all' runs every one; default: 'random' "
                   "with the shapes below.")
@click.option("--input-len", "--random-input-len", "input_len", type=click.IntRange(min=1),
              default=None, help="Prompt tokens (random ids). [random: 128]")
@click.option("--output-len", "--random-output-len", "output_len",
              type=click.IntRange(min=1), default=None,
              help="Output tokens per request (ignore_eos). [random: 128]")
@click.option("--short-input-len", type=click.IntRange(min=1), default=1024,
              show_default=True, help="long-context: the short prompt compared against.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None,
              help="Measured requests. [random: 64]")
@click.option("--max-concurrency", "concurrency", type=click.IntRange(min=0), default=None,
              help="Requests in flight at most (0 = no limit). [random: 16]")
@click.option("--request-rate", type=float, default=None,
              help="Poisson arrivals per second (default inf: all at once, bounded by "
                   "--max-concurrency).")
@click.option("--input-len-range", type=str, default=None, metavar="MIN:MAX",
              help="Prompt tokens drawn log-uniform per request. [mix: 32:4096]")
@click.option("--output-len-range", type=str, default=None, metavar="MIN:MAX",
              help="Output tokens drawn log-uniform per request. [mix: 16:512]")
@click.option("--prefix-len", type=click.IntRange(min=1), default=None,
              help="Tokens of each shared prefix. [prefix: 2000]")
@click.option("--num-prefixes", type=click.IntRange(min=1), default=None,
              help="Distinct shared prefixes. [prefix: 16]")
@click.option("--suffix-len", type=click.IntRange(min=1), default=None,
              help="Unique tokens after the prefix. [prefix: 48]")
@click.option("--goodput", "goodput", multiple=True, metavar="KEY:MS",
              help="An SLO for goodput (repeatable): ttft, itl (or tpot), e2el in ms.")
@click.option("--extra-body", default=None, metavar="JSON",
              help="A JSON object merged into every request (e.g. '{\"logprobs\": 5}'), as "
                   "the openai client's extra_body.")
@click.option("--warmup", "--num-warmups", "warmup", type=click.IntRange(min=0), default=None,
              help="Warm-up requests before measuring (excluded). [random: 2]")
@click.option("--vocab-size", type=click.IntRange(min=2), default=None,
              help="Random prompt ids are drawn below this (default: the server's /health "
                   "vocab_size).")
@click.option("--server-pid", type=int, default=None,
              help="Server process to read CPU use from (default: /health's pid when the "
                   "server is on this host).")
@click.option("--workers", type=click.IntRange(min=0), default=0, show_default=True,
              help="Client processes sharing the load (0 = one per 64 concurrent streams, "
                   "so the client does not bound what it measures).")
@click.option("--backend", type=click.Choice(list(BACKENDS)), default="openai",
              show_default=True, help="openai / vllm: /v1/completions; openai-chat: "
                                      "/v1/chat/completions.")
@click.option("--dataset-name", type=click.Choice(["random", "sharegpt"]), default="random",
              show_default=True, help="random: random prompts of the shapes above; sharegpt: "
                                      "prompts from --dataset-path.")
@click.option("--dataset-path", type=click.Path(dir_okay=False), default=None,
              help="ShareGPT's JSON file (a list of {\"conversations\": [...]}).")
@click.option("--sharegpt-output-len", type=click.IntRange(min=1), default=None,
              help="Output tokens of every sharegpt request (default: its reply's length).")
@click.option("--burstiness", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="With --request-rate: the gamma shape of the gaps "
                                      "between arrivals (1: Poisson; < 1 burstier).")
@click.option("--save-result", is_flag=True, help="Write each run as vLLM's result JSON.")
@click.option("--result-dir", type=click.Path(file_okay=False), default=None,
              help="Where --save-result writes (default: here).")
@click.option("--result-filename", default=None,
              help="--save-result's file name (default: vLLM's; with several runs, each "
                   "gets its scenario's name before .json).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the results as JSON here.")
@click.option("--progress/--no-progress", default=True, show_default=True)
def bench(base_url, host, port, model, lora_modules, api_key, scenarios, input_len, output_len,
          short_input_len, num_prompts, concurrency, request_rate, input_len_range,
          output_len_range, prefix_len, num_prefixes, suffix_len, goodput, extra_body, warmup,
          vocab_size, server_pid, workers, backend, dataset_name, dataset_path,
          sharegpt_output_len, burstiness, save_result, result_dir, result_filename, seed, out,
          progress):
    """Drive a running zerod (or any OpenAI-compatible) server and report TTFT, ITL, TPOT
    and throughput."""
    base_url = (base_url or f"http://{host}:{port}").rstrip("/")
    names = list(scenarios) or ["random"]
    if "all" in names:
        names = ORDER
    overrides = {"input_len": input_len, "output_len": output_len, "num_prompts": num_prompts,
                 "concurrency": concurrency, "warmup": warmup,
                 "request_rate": request_rate if request_rate is not None else None,
                 "input_len_range": _range(input_len_range, "--input-len-range"),
                 "output_len_range": _range(output_len_range, "--output-len-range"),
                 "prefix_len": prefix_len, "num_prefixes": num_prefixes, "suffix_len": suffix_len,
                 "goodput": _slos(goodput), "burstiness": burstiness}
    if request_rate is not None and request_rate <= 0:
        raise click.BadParameter("must be > 0", param_hint="--request-rate")
    extra = _extra(extra_body)
    loras = [n.strip() for item in lora_modules for n in item.split(",") if n.strip()]
    if lora_modules and not loras:
        raise click.BadParameter("no adapter name given", param_hint="--lora-modules")
    dataset = None
    if dataset_name == "sharegpt":
        if dataset_path is None:
            raise click.BadParameter("--dataset-name sharegpt needs --dataset-path FILE",
                                     param_hint="--dataset-path")
        need = max([load_for_count(n, overrides) for n in names])
        try:
            dataset = load_sharegpt(dataset_path, need, seed, sharegpt_output_len)
        except DatasetError as exc:
            raise click.BadParameter(str(exc), param_hint="--dataset-path") from None
    saving = {"backend": backend, "dir": result_dir, "filename": result_filename,
              "burstiness": burstiness} if save_result else None
    results = asyncio.run(_main(base_url, model, api_key, names, overrides, short_input_len,
                                vocab_size, server_pid, seed, progress, out, workers, extra,
                                loras, backend, dataset, saving))
    failed = sum(r.get("failed", 0) for r in results.values())
    sys.exit(1 if failed else 0)


def load_for_count(name: str, overrides: dict[str, Any]) -> int:
    """Requests a scenario sends (warm-up included): how many dataset prompts it takes."""
    from zerod.bench.scenarios import load_for

    shapes = [s for _, s in COMPOSITE[name]] if name in COMPOSITE else [name]
    return sum(load_for(s, overrides).num_prompts + load_for(s, overrides).warmup for s in shapes)


def _range(text: str | None, flag: str) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not MIN:MAX (two integers)", param_hint=flag)
    if not 1 <= lo <= hi:
        raise click.BadParameter(f"{text!r}: need 1 <= MIN <= MAX", param_hint=flag)
    return lo, hi


_SLO_KEYS = ("ttft", "itl", "tpot", "e2el")


def _slos(items: tuple[str, ...]) -> dict[str, float] | None:
    out = {}
    for item in items:
        key, _, ms = item.partition(":")
        try:
            v = float(ms)
        except ValueError:
            v = -1.0
        if key not in _SLO_KEYS or not v > 0:
            raise click.BadParameter(f"{item!r} is not KEY:MS with KEY one of "
                                     f"{', '.join(_SLO_KEYS)} and MS > 0", param_hint="--goodput")
        out[key] = v
    return out or None


def _extra(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--extra-body")
    if not isinstance(obj, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--extra-body")
    return obj


async def _main(base_url, model, api_key, names, overrides, short_input_len, vocab_size,
                server_pid, seed, progress, out, workers=0, extra=None,
                loras=None, backend="openai", dataset=None, saving=None) -> dict[str, dict]:
    health, models = await _server_info(base_url, api_key)
    if health.get("_status") != 200:
        raise click.ClickException(f"the server is not healthy: /health answered "
                                   f"{health.get('_status')} {health}")
    model = model or (models[0] if models else None)
    vocab = vocab_size or health.get("vocab_size") or 1000
    pid = server_pid
    if pid is None and _is_local(base_url) and isinstance(health.get("pid"), int):
        pid = health["pid"]
    if pid is not None and not os.path.exists(f"/proc/{pid}"):
        click.echo(f"bench: no process {pid} here: engine CPU is not measured", err=True)
        pid = None
    client = Client(base_url, model, api_key, vocab, seed, progress, pid)
    client.workers = workers
    client.extra_body = extra or {}
    client.lora_modules = list(loras or [])
    client.backend = backend
    client.dataset = dataset
    if pid is not None and pid == health.get("pid") and isinstance(health.get("threads"), dict):
        threads = {**health["threads"], **(health.get("engine_threads") or {})}
        client.thread_names = {int(tid): name for name, tid in threads.items()
                               if isinstance(tid, int)}
        if isinstance(health.get("engine_pid"), int) and os.path.exists(f"/proc/{health['engine_pid']}"):
            client.engine_pid = health["engine_pid"]
    results: dict[str, dict] = {}
    for name in names:
        results[name] = await run_scenario(client, name, overrides, short_input_len)
        if out:
            _write(out, base_url, model, health, results, client.lora_modules)
    if saving is not None:
        runs = list(_runs(results))
        for label, report in runs:
            res = vllm_result(report, backend=saving["backend"], model=model,
                              burstiness=saving["burstiness"])
            name = saving["filename"]
            if name and len(runs) > 1:
                stem, dot, ext = name.rpartition(".") if "." in name else (name, "", "")
                name = f"{stem}-{label.replace(':', '-')}{dot}{ext}"
            path = save(res, saving["dir"], name or default_filename(saving["backend"], res, label))
            click.echo(f"bench: saved {path}", err=True)
    click.echo(table(results))
    return results


def _runs(results: dict[str, dict]):
    """(label, report) of every measured run, phases of a scenario each on their own."""
    for name, r in results.items():
        if "phases" in r:
            for ph, pr in r["phases"].items():
                yield f"{name}:{ph}", pr
        else:
            yield name, r


def _public(obj: Any) -> Any:
    """The results without their per-request lists (those go to --save-result only)."""
    if isinstance(obj, dict):
        return {k: _public(v) for k, v in obj.items() if k != "_raw"}
    return obj


def _write(path: str, base_url: str, model: str | None, health: dict,
           results: dict[str, dict], lora_modules: list[str] | None = None) -> None:
    doc = {"zerod_bench": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "base_url": base_url, "model": model, "lora_modules": lora_modules or None,
           "server": {k: v for k, v in health.items() if not k.startswith("_")},
           "scenarios": _public(results)}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False, default=str)
    os.replace(tmp, path)


if __name__ == "__main__":
    bench(prog_name="python -m zerod.bench")
