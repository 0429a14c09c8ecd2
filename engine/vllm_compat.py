"""What `zerod serve` does with the `vllm serve` flags it has no option of its own for.

Each is either accepted as a no-op with one info line saying why, mapped onto
zerod's own flag, or refused with one line naming what zerod does instead. A
refused flag whose value changes nothing (`-pp 1`, `--scheduling-policy fcfs`)
is accepted like a no-op. Values of zerod's own flags that only vLLM serves
(`--quantization awq`) are refused the same way. engine/flags.py owns zerod's
own flags; this table owns everything else a vLLM command line may carry.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Foreign:
    """A vLLM flag zerod has no option for."""

    arity: str  # "flag" (no value) | "value" | "optional" (a value may follow) | "many" (nargs +)
    note: str                      # why it is a no-op, or what zerod does instead
    refused: bool = False
    harmless: tuple[str, ...] = () # values of a refused flag that change nothing
    maps_to: str | None = None     # zerod's own flag taking the same value


def _noop(arity: str, note: str) -> Foreign:
    return Foreign(arity, note)


def _refuse(arity: str, note: str, *harmless: str) -> Foreign:
    return Foreign(arity, note, refused=True, harmless=harmless)


_TEXT_ONLY = "zerod serves text models; image and audio inputs are refused per request"
_ONE_PROCESS = ("one zerod serve is one engine; run one per GPU group and let the daemon's "
                "[[engines]] supervise them")
_NO_TLS = "zerod serves plain HTTP: terminate TLS in a proxy in front of it"
_FROM_CONFIG = "zerod reads this from the checkpoint's config.json: edit it there"
_LOCAL_DIR = "zerod serves a local checkpoint directory (download it first, e.g. hf download)"
_NO_PLUGINS = "zerod loads no plugins: its parsers and model families are built in"
_SCHEDULER = ("zerod's scheduler sizes prompt chunks from measured step costs "
              "(--target-itl-ms, --target-ttft-ms)")
_NO_PREEMPTION = "zerod never preempts: a request's KV pages are reserved at admission"

FOREIGN: dict[str, Foreign] = {
    # the frontend
    "--disable-log-requests": _noop("flag", "the per-request detail log is off unless "
                                    "--enable-log-requests"),
    "--disable-log-stats": _noop("flag", "zerod logs no periodic stats lines; /metrics "
                                 "carries them"),
    "--disable-frontend-multiprocessing": _noop("flag", "the HTTP server and the engine "
                                                "share one process"),
    "--enable-request-id-headers": _noop("flag", "every answer carries X-Request-Id"),
    "--enable-prompt-tokens-details": _noop("flag", "usage always carries "
                                            "prompt_tokens_details.cached_tokens"),
    "--enable-server-load-tracking": _noop("flag", "/health and /metrics carry the load"),
    "--enable-log-outputs": _noop("flag", "outputs are never logged"),
    "--disable-fastapi-docs": _noop("flag", "no docs pages are served, only /openapi.json"),
    "--h11-max-incomplete-event-size": _noop("value", "zerod's HTTP edge bounds request "
                                             "lines and headers itself"),
    "--h11-max-header-count": _noop("value", "zerod's HTTP edge bounds request lines and "
                                    "headers itself"),
    "--log-error-stack": _noop("flag", "errors are logged with their cause"),
    "--response-role": _refuse("value", "the reply's role is always assistant", "assistant"),
    "--chat-template-content-format": _refuse("value", "message content is given to the "
                                              "template as the template expects (auto)",
                                              "auto"),
    "--trust-request-chat-template": _refuse("flag", "a request's own chat_template is never "
                                             "rendered; serve one with --chat-template"),
    "--exclude-tools-when-tool-choice-none": _refuse(
        "flag", "tools reach the chat template whatever tool_choice says"),
    "--return-tokens-as-token-ids": _refuse("flag", "logprobs name tokens by their text unless "
                                            "a request sets return_tokens_as_token_ids"),
    "--enable-force-include-usage": _refuse("flag", "usage comes with "
                                            "stream_options.include_usage, per request"),
    "--enable-tokenizer-info-endpoint": _refuse("flag", "/tokenize and /detokenize are "
                                                "served; no tokenizer info endpoint"),
    "--tool-parser-plugin": _refuse("value", _NO_PLUGINS),
    "--reasoning-parser-plugin": _refuse("value", _NO_PLUGINS),
    "--tool-server": _refuse("value", "zerod runs no built-in tools; the client runs them"),
    "--log-config-file": _refuse("value", "zerod's log format is its own (journald "
                                 "priorities under systemd)"),
    "--root-path": _refuse("value", "zerod serves at /; let the proxy strip its prefix", "",
                           "/"),
    "--middleware": _refuse("many", "zerod loads no ASGI middleware"),
    "--ssl-keyfile": _refuse("value", _NO_TLS),
    "--ssl-certfile": _refuse("value", _NO_TLS),
    "--ssl-ca-certs": _refuse("value", _NO_TLS),
    "--ssl-cert-reqs": _refuse("value", _NO_TLS, "0"),
    "--enable-ssl-refresh": _refuse("flag", _NO_TLS),
    "--uds": _refuse("value", "zerod listens on TCP (--host, --port)"),
    "--headless": _refuse("flag", _ONE_PROCESS),
    # the model
    "--trust-remote-code": _noop("flag", "no remote code is ever run: model families are "
                                 "built in"),
    "--runner": _refuse("value", "zerod serves text generation only", "auto", "generate"),
    "--convert": _refuse("value", "zerod serves text generation only", "auto", "none"),
    "--task": _refuse("value", "zerod serves text generation only", "auto", "generate"),
    "--tokenizer-mode": _refuse("value", "zerod reads tokenizer.json with the tokenizers "
                                "library", "auto", "hf"),
    "--revision": _noop("value", _LOCAL_DIR),
    "--code-revision": _noop("value", _LOCAL_DIR),
    "--tokenizer-revision": _noop("value", _LOCAL_DIR),
    "--hf-token": _noop("optional", _LOCAL_DIR),
    "--download-dir": _noop("value", _LOCAL_DIR),
    "--hf-config-path": _refuse("value", _FROM_CONFIG),
    "--rope-scaling": _refuse("value", _FROM_CONFIG),
    "--rope-theta": _refuse("value", _FROM_CONFIG),
    "--hf-overrides": _refuse("value", _FROM_CONFIG, "{}"),
    "--config-format": _refuse("value", "zerod reads Hugging Face's config.json", "auto", "hf"),
    "--logprobs-mode": _refuse("value", "logprobs are the model's raw log-probabilities",
                               "raw_logprobs"),
    "--disable-sliding-window": _refuse("flag", "sliding windows are served as config.json "
                                        "sets them"),
    "--disable-cascade-attn": _noop("flag", "zerod has no cascade attention"),
    "--skip-tokenizer-init": _refuse("flag", "zerod needs the tokenizer (prompts are text)"),
    "--enable-prompt-embeds": _refuse("flag", "prompts are text or token ids"),
    "--pooler-config": _refuse("value", "zerod serves text generation, no pooling"),
    "--override-pooler-config": _refuse("value", "zerod serves text generation, no pooling"),
    "--logits-processor-pattern": _refuse("value", "zerod loads no logits processors"),
    "--logits-processors": _refuse("many", "zerod loads no logits processors"),
    "--enable-sleep-mode": _refuse("flag", "stop the engine to free the GPU (the daemon "
                                   "restarts it)"),
    "--model-impl": _refuse("value", "model families are built in", "auto", "vllm"),
    "--override-attention-dtype": _refuse("value", "attention runs in --dtype"),
    "--io-processor-plugin": _refuse("value", _NO_PLUGINS),
    "--served-model-name-as-lora": _refuse("flag", "LoRA adapters are named in --lora-modules"),
    # loading
    "--safetensors-load-strategy": _noop("value", "zerod reads safetensors its own way"),
    "--model-loader-extra-config": _noop("value", "zerod's loader takes no extra config"),
    "--ignore-patterns": _noop("many", "zerod reads only *.safetensors and config files"),
    "--use-tqdm-on-load": _noop("flag", "loading reports one line"),
    "--no-use-tqdm-on-load": _noop("flag", "loading reports one line"),
    "--pt-load-map-location": _noop("value", "zerod reads safetensors only"),
    "--max-parallel-loading-workers": _noop("value", "zerod reads shards its own way"),
    # structured outputs and reasoning
    "--guided-decoding-backend": _refuse("value", "structured outputs always use xgrammar",
                                         "auto", "xgrammar"),
    "--structured-outputs-config": _refuse("value", "structured outputs always use xgrammar "
                                           "with its defaults", "{}"),
    # parallelism
    "--pipeline-parallel-size": _refuse("value", "zerod splits a model with tensor "
                                        "parallelism only (-tp N)", "1"),
    "-pp": _refuse("value", "zerod splits a model with tensor parallelism only (-tp N)", "1"),
    "--decode-context-parallel-size": _refuse("value", "zerod splits a model with tensor "
                                              "parallelism only (-tp N)", "1"),
    "-dcp": _refuse("value", "zerod splits a model with tensor parallelism only (-tp N)", "1"),
    "--data-parallel-size": _refuse("value", _ONE_PROCESS, "1"),
    "-dp": _refuse("value", _ONE_PROCESS, "1"),
    **{s: _refuse("value", _ONE_PROCESS) for s in (
        "--data-parallel-rank", "-dpn", "--data-parallel-start-rank", "-dpr",
        "--data-parallel-size-local", "-dpl", "--data-parallel-address", "-dpa",
        "--data-parallel-rpc-port", "-dpp", "--data-parallel-backend", "-dpb")},
    "--data-parallel-hybrid-lb": _refuse("flag", _ONE_PROCESS),
    "--data-parallel-external-lb": _refuse("flag", _ONE_PROCESS),
    "--enable-expert-parallel": _refuse("flag", "MoE experts are split with tensor "
                                        "parallelism (-tp N)"),
    "--enable-eplb": _refuse("flag", "MoE experts are split with tensor parallelism (-tp N)"),
    "--eplb-config": _refuse("value", "MoE experts are split with tensor parallelism (-tp N)"),
    "--expert-placement-strategy": _refuse("value", "MoE experts are split with tensor "
                                           "parallelism (-tp N)", "linear"),
    "--distributed-executor-backend": _noop("value", "zerod starts its tensor-parallel "
                                            "ranks as its own processes"),
    "--ray-workers-use-nsight": _noop("flag", "zerod runs no Ray workers"),
    "--disable-custom-all-reduce": _noop("flag", "zerod's all-reduce is NCCL's"),
    "--worker-cls": _refuse("value", "zerod's workers are its own", "auto"),
    "--worker-extension-cls": _refuse("value", "zerod's workers are its own", ""),
    "--enable-multimodal-encoder-data-parallel": _noop("flag", _TEXT_ONLY),
    # the KV cache
    "--num-gpu-blocks-override": Foreign("value", "the KV pool in pages of --block-size "
                                         "tokens", maps_to="--kv-pages"),
    "--swap-space": _noop("value", _NO_PREEMPTION + ": nothing is swapped"),
    "--cpu-offload-gb": _refuse("value", "weights stay on the GPU", "0"),
    "--prefix-caching-hash-algo": _noop("value", "zerod hashes prefix pages its own way"),
    "--calculate-kv-scales": _refuse("flag", "fp8 KV takes the checkpoint's k/v scales, "
                                     "else 1.0"),
    "--kv-sharing-fast-prefill": _refuse("flag", "zerod shares KV through its prefix cache"),
    "--mamba-cache-dtype": _noop("value", "zerod serves no Mamba models"),
    "--mamba-ssm-cache-dtype": _noop("value", "zerod serves no Mamba models"),
    "--kv-offloading-size": _refuse("value", "the KV pool stays on the GPU"),
    # multimodal
    **{s: _noop("value", _TEXT_ONLY) for s in (
        "--allowed-local-media-path", "--limit-mm-per-prompt",
        "--media-io-kwargs", "--mm-processor-kwargs", "--mm-processor-cache-gb",
        "--mm-encoder-tp-mode", "--mm-processor-cache-type")},
    **{s: _noop("flag", _TEXT_ONLY) for s in (
        "--disable-mm-preprocessor-cache", "--interleave-mm-strings", "--skip-mm-profiling")},
    "--allowed-media-domains": _noop("many", _TEXT_ONLY),
    # LoRA
    "--enable-lora-bias": _refuse("flag", "LoRA adapters with biases are not served"),
    "--lora-extra-vocab-size": _noop("value", "adapters with extra vocabulary are refused "
                                     "when loaded"),
    "--lora-dtype": _refuse("value", "LoRA weights run in the model's dtype", "auto"),
    "--fully-sharded-loras": _noop("flag", "LoRA slabs are sharded with tensor parallelism"),
    "--default-mm-loras": _refuse("value", _TEXT_ONLY),
    # observability
    "--show-hidden-metrics-for-version": _noop("value", "zerod hides no metrics"),
    "--otlp-traces-endpoint": _refuse("value", "zerod exports no OpenTelemetry traces; "
                                      "/metrics and the access log carry the timings"),
    "--collect-detailed-traces": _refuse("value", "zerod exports no OpenTelemetry traces"),
    # the scheduler
    "--enable-chunked-prefill": _noop("flag", "chunked prefill is always on here"),
    "--no-enable-chunked-prefill": _noop("flag", "chunked prefill is always on here; a lone "
                                         "prompt goes in whole (--max-prefill-tokens-idle)"),
    "--max-num-partial-prefills": _noop("value", _SCHEDULER),
    "--max-long-partial-prefills": _noop("value", _SCHEDULER),
    "--long-prefill-token-threshold": _noop("value", _SCHEDULER),
    "--num-lookahead-slots": _noop("value", "zerod has no speculative decoding"),
    "--scheduler-delay-factor": _noop("value", _SCHEDULER),
    "--preemption-mode": _noop("value", _NO_PREEMPTION),
    "--num-scheduler-steps": _noop("value", "the step loop keeps several steps in flight "
                                   "itself"),
    "--multi-step-stream-outputs": _noop("flag", "every token is streamed as it comes"),
    "--scheduling-policy": _refuse("value", "requests are served first come first served",
                                   "fcfs"),
    "--disable-chunked-mm-input": _noop("flag", _TEXT_ONLY),
    "--scheduler-cls": _refuse("value", "zerod's scheduler is its own"),
    "--disable-hybrid-kv-cache-manager": _noop("flag", "zerod has one KV pool"),
    "--async-scheduling": _noop("flag", "the step loop already schedules while the GPU "
                                "runs"),
    "--max-seq-len-to-capture": _noop("value", "CUDA graphs capture decode batches; "
                                      "--enforce-eager turns them off"),
    "--cuda-graph-sizes": _noop("many", "CUDA graphs capture decode batches; "
                                "--enforce-eager turns them off"),
    "--disable-async-output-proc": _noop("flag", "outputs are read by the poller thread"),
    "--compilation-config": _noop("value", "zerod compiles nothing at start; CUDA graphs "
                                  "capture decode (--enforce-eager turns them off)"),
    "-O": _noop("value", "zerod compiles nothing at start; CUDA graphs capture decode "
                "(--enforce-eager turns them off)"),
    # what zerod has no engine for
    "--speculative-config": _refuse("value", "zerod has no speculative decoding"),
    "--kv-transfer-config": _refuse("value", "zerod has no disaggregated prefill (KV "
                                    "transfer)"),
    "--kv-events-config": _refuse("value", "zerod publishes no KV events; /metrics carries "
                                  "the prefix cache"),
    "--additional-config": _refuse("value", "zerod takes no platform config", "{}"),
}

# Values of zerod's own flags that vLLM serves and zerod does not: one line saying why.
REFUSED_VALUES: dict[str, str] = {
    "--quantization": "zerod serves bf16/fp16 checkpoints, FP8 checkpoints as published, and "
                      "--quantization fp8 (quantized at load); convert other formats first",
    "-q": "zerod serves bf16/fp16 checkpoints, FP8 checkpoints as published, and "
          "--quantization fp8 (quantized at load); convert other formats first",
    "--load-format": "zerod reads safetensors (auto), or makes random weights (dummy)",
    "--kv-cache-dtype": "zerod's FP8 KV pages are e4m3 (the checkpoint's k/v scales, else 1.0)",
    "--dtype": "zerod computes in bf16, fp16 or fp32",
    "--tool-call-parser": "zerod reads tool calls in its own parsers' formats only",
    "--reasoning-parser": "zerod splits reasoning in its own parsers' formats only",
}


def markdown_table() -> str:
    """docs/engine-server.md's table of vLLM's flags zerod has no option for."""
    rows = ["| vLLM flag | here | why / what zerod does instead |", "|---|---|---|"]
    for flag, f in sorted(FOREIGN.items(), key=lambda kv: kv[0].lstrip("-")):
        if f.maps_to:
            what = f"taken as `{f.maps_to}`"
        elif f.refused:
            what = "refused" + (f" (but {', '.join(f'`{v}`' for v in f.harmless if v)} "
                                "is a no-op)" if any(f.harmless) else "")
        else:
            what = "no-op"
        rows.append(f"| `{flag}` | {what} | {f.note} |")
    return "\n".join(rows)
