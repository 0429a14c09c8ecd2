"""`--save-result`: a run's results in the JSON layout `vllm bench serve --save-result`
writes, so the tools that read vLLM's files read zerod bench's; zerod's extras (the
server's CPU use, the longest gap, the prefix-cache hit rate) sit beside them under
"zerod".
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from zerod.bench.stats import percentile

PERCENTILES = (99,)   # vLLM's default --metric-percentiles


def _stats(prefix: str, values_s: list[float]) -> dict[str, float]:
    """mean / median / std / p99 in ms under vLLM's keys (0 where nothing was measured,
    as vLLM writes them)."""
    v = sorted(x * 1000.0 for x in values_s)
    out: dict[str, float] = {}
    mean = sum(v) / len(v) if v else 0.0
    out[f"mean_{prefix}_ms"] = mean
    out[f"median_{prefix}_ms"] = percentile(v, 50) if v else 0.0
    out[f"std_{prefix}_ms"] = math.sqrt(sum((x - mean) ** 2 for x in v) / len(v)) if v else 0.0
    for p in PERCENTILES:
        out[f"p{p}_{prefix}_ms"] = percentile(v, p) if v else 0.0
    return out


def vllm_result(report: dict[str, Any], *, backend: str, model: str | None,
                burstiness: float) -> dict[str, Any]:
    raw = report["_raw"]
    cfg = report["config"]
    duration = report["duration_s"]
    tpots = [(e - t) / (n - 1) for e, t, n in zip(raw["e2els"], raw["ttfts"], raw["output_lens"])
             if n > 1]
    rate = cfg.get("request_rate")
    out: dict[str, Any] = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "backend": backend, "model_id": model, "tokenizer_id": model,
        "num_prompts": report["num_requests"],
        "request_rate": "inf" if rate is None else rate,
        "burstiness": burstiness,
        "max_concurrency": cfg.get("concurrency") or None,
        "duration": duration,
        "completed": report["completed"],
        "failed": report["failed"],
        "total_input_tokens": report["total_input_tokens"],
        "total_output_tokens": report["total_output_tokens"],
        "request_throughput": report["request_throughput"],
        "request_goodput": (raw["good"] / duration if raw["good"] is not None and duration
                            else None),
        "output_throughput": report["output_throughput"],
        "total_token_throughput": report["total_token_throughput"],
        "input_lens": raw["input_lens"], "output_lens": raw["output_lens"],
        "ttfts": raw["ttfts"], "itls": raw["itls"],
        "generated_texts": [""] * len(raw["ttfts"]),   # zerod bench does not keep texts
        "errors": raw["errors"],
    }
    out.update(_stats("ttft", raw["ttfts"]))
    out.update(_stats("tpot", tpots))
    out.update(_stats("itl", [x for gaps in raw["itls"] for x in gaps]))
    out.update(_stats("e2el", raw["e2els"]))
    out["zerod"] = {"scenario": report["scenario"], "engine_cpu": report.get("engine_cpu"),
                    "max_itl_ms": report["itl_ms"]["max"],
                    "itl_gaps_over_100ms": report.get("itl_gaps_over_100ms"),
                    "prefix_cache_hit_rate": report.get("prefix_cache_hit_rate")}
    return out


def default_filename(backend: str, result: dict[str, Any], label: str) -> str:
    """vLLM's name: BACKEND-RATEqps[-concurrencyN]-MODEL-DATE.json, with the scenario."""
    conc = result["max_concurrency"]
    model = str(result["model_id"] or "model").split("/")[-1]
    tail = "" if label == "random" else f"-{label.replace(':', '-')}"
    return (f"{backend}-{result['request_rate']}qps"
            f"{f'-concurrency{conc}' if conc else ''}-{model}{tail}-{result['date']}.json")


def save(result: dict[str, Any], result_dir: str | None, filename: str) -> Path:
    path = Path(result_dir or ".") / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, allow_nan=False, default=str))
    os.replace(tmp, path)
    return path
