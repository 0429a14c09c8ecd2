"""Service checks: where the engine listens, and whether its model fits."""

from __future__ import annotations

import ipaddress

from zerod.engine.config import EngineError
from zerod.engine.spec.sizing import (DTYPE_BYTES, FP8_KV, kv_bytes_per_token, kv_cache_dtype,  # torch-free:
                                 serving_dtype)                                            # the engine's own formula

from .checks_gpu import GiB, field, label
from .report import FAIL, PASS, SKIP, WARN, Ctx, check

BIND_FIX = ("bind to loopback ([engine] host = \"127.0.0.1\") behind a reverse proxy that "
            "authenticates, or set an API key ([engine] api_key / `zerod serve --api-key`)")


@check("net.bind_exposure", "Engine not on a public interface without an API key", "critical")
def bind_exposure(ctx: Ctx):
    host, keyed = ctx.cfg.bind_address, ctx.cfg.api_key_set
    ctx.ev("bind_address", host, "[engine] host / [doctor] bind_address")
    ctx.ev("api_key_set", keyed, "[engine] api_key / [doctor] api_key_set")
    if host in ("localhost", "ip6-localhost"):
        host = "127.0.0.1"
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if keyed:
            return PASS(f"bound to {host} with an API key")
        return WARN(f"cannot tell where {host!r} points without DNS; no API key is set", BIND_FIX)
    if ip.is_loopback:
        return PASS(f"bound to loopback {ip}")
    if keyed:
        return PASS(f"bound to {ip}, requests need the API key")
    if ip.is_unspecified:
        f = ctx.facts.get("net.addresses")
        if not f.ok:
            ctx.ev("net.addresses", None, f.source, error=f.error)
            return WARN(f"bound to {ip} (every interface) without an API key, and the interfaces could "
                        f"not be read ({f.error})", BIND_FIX)
        addrs = ctx.fact("net.addresses")
        reach = [a for a in addrs if a["family"] == ip.version or ip.version == 6]
        exposed = [ipaddress.ip_address(a["address"]) for a in reach]
    else:
        exposed = [ip]
    exposed = [a for a in exposed if not a.is_loopback]
    public = [str(a) for a in exposed if a.is_global]
    lan = [str(a) for a in exposed if not a.is_global]
    if public:
        return FAIL(f"bound to {host} without an API key: reachable on public address(es) "
                    f"{', '.join(public)} - anyone can use the GPU", BIND_FIX)
    if lan:
        return WARN(f"bound to {host} without an API key: reachable from the local network on "
                    f"{', '.join(lan)}", BIND_FIX)
    return PASS(f"bound to {host}: only loopback addresses")


@check("engine.config", "Model present, fits, context within the KV budget", "critical")
def engine_config(ctx: Ctx):
    m = ctx.fact("engine.model")
    if m.get("demo"):
        return PASS("the built-in demo model (meaningless text, for trying zerod out)")
    path = m["model"]
    fix_path = "set [engine] model to a Hugging Face checkpoint folder (config.json + *.safetensors)"
    if not m.get("exists"):
        return FAIL(f"model folder {path} does not exist", fix_path)
    if m.get("config_error"):
        return FAIL(f"cannot read {path}/config.json: {m['config_error']}", fix_path)
    layers, kvh, hd = m.get("num_hidden_layers"), m.get("num_key_value_heads"), m.get("head_dim")
    if not (layers and kvh and hd):
        return FAIL(f"{path}/config.json lacks num_hidden_layers/num_key_value_heads/head_dim", fix_path)
    try:
        dtype = serving_dtype(ctx.cfg.dtype, m.get("torch_dtype"), "cuda")
    except EngineError as exc:
        return FAIL(f"the engine cannot serve {path}: {exc}", "set [engine] dtype to bfloat16, float16 or float32")
    try:
        kv_dtype = kv_cache_dtype(ctx.cfg.kv_cache_dtype, dtype)
    except EngineError as exc:
        return FAIL(str(exc), "set [engine] kv_cache_dtype to auto or fp8")
    fp8 = _fp8_uses(m, ctx.cfg.quantization, kv_dtype)
    if isinstance(fp8, str) and fp8.startswith("refuse:"):
        return FAIL(f"the engine cannot serve {path}: {fp8[7:]}", "use an unquantized or an FP8 checkpoint")
    if fp8:
        old = _fp8_incapable(ctx)
        if old:
            return FAIL(f"{' and '.join(fp8)} need(s) compute capability 8.9+ (FP8 tensor cores); {old}",
                        "run FP8 on Ada or Hopper (L4, L40S, H100, H200), or serve a bf16 checkpoint "
                        "without --quantization fp8 and with [engine] kv_cache_dtype = \"auto\"")
    weights = m.get("weights_bytes") or 0
    dummy = ctx.cfg.load_format == "dummy"
    if not weights and dummy and m.get("params_estimate"):
        # --load-format dummy: random weights of the config's shape, sized from it (FP8: a
        # byte per parameter, the embedding and head stay wider; close enough to size the KV)
        weights = m["params_estimate"] * (1 if ctx.cfg.quantization == "fp8" else DTYPE_BYTES[dtype])
    if not weights:
        return FAIL(f"no *.safetensors weights in {path}", fix_path + " (or `--load-format dummy` for tests)")
    max_len = ctx.cfg.max_model_len or m.get("max_position_embeddings") or 0
    notes = []
    if m.get("max_position_embeddings") and max_len > m["max_position_embeddings"]:
        notes.append(f"max_model_len {max_len} exceeds the model's {m['max_position_embeddings']}")
    gl = ctx.facts.value("nvml.gpus") or []
    if ctx.cfg.gpus is not None:
        gl = [g for g in gl if g.get("index") in ctx.cfg.gpus]
    totals = [g["memory"]["total"] for g in gl if g.get("memory")]
    if not totals:
        return SKIP(f"model {path} found ({weights / GiB:.1f} GiB of weights); no GPU to size it against")
    budget = ctx.cfg.gpu_memory_utilization * min(totals) * len(totals)
    per_token = kv_bytes_per_token(layers, kvh, hd, kv_dtype)
    kv = budget - weights - GiB  # 1 GiB for activations and graphs
    ctx.ev("kv_budget", {"budget_bytes": int(budget), "weights_bytes": weights, "dtype": dtype,
                         "kv_cache_dtype": kv_dtype,
                         "kv_bytes_per_token": per_token, "max_model_len": max_len}, "computed")
    fix = ("lower [engine] max_model_len or max_num_seqs, raise gpu_memory_utilization (<= 0.92), "
           "or use a larger GPU / more GPUs")
    if kv <= 0:
        return FAIL(f"weights ({weights / GiB:.1f} GiB) leave no KV cache room in "
                    f"{budget / GiB:.1f} GiB", fix)
    tokens = int(kv // per_token)
    if max_len and tokens < max_len:
        return FAIL(f"the KV budget holds {tokens} tokens, less than one {max_len}-token sequence", fix)
    seqs = tokens // max_len if max_len else 0
    msg = (f"weights {weights / GiB:.1f} GiB; KV room for {tokens} tokens"
           + (f" = {seqs} full {max_len}-token sequences" if max_len else ""))
    if notes:
        return WARN(msg + "; " + "; ".join(notes), "set [engine] max_model_len within the model's limit")
    return PASS(msg)


def _fp8_uses(m: dict, quantization: str | None, kv_dtype: str) -> list[str] | str:
    """What of this configuration runs in FP8 (the checkpoint's weights, weights
    quantized at load, the KV cache); "refuse:<why>" for a method the engine cannot run."""
    uses = []
    qc = m.get("quantization_config")
    if qc:
        from zerod.engine.quant.config import parse_checkpoint   # no torch: reads the config only

        try:
            parse_checkpoint(qc, "config.json")
        except EngineError as exc:
            return "refuse:" + str(exc)
        uses.append(f"the {m.get('quant_method')} FP8 weights")
    elif quantization == "fp8":
        uses.append("--quantization fp8")
    if kv_dtype == FP8_KV:
        uses.append("the FP8 KV cache")
    return uses


def _fp8_incapable(ctx: Ctx) -> str:
    """The engine's GPUs older than sm_89, named; "" if none (or none known)."""
    old = []
    for g in ctx.facts.value("nvml.gpus") or []:   # no NVML: nothing known, the sizing below says so
        if ctx.cfg.gpus is not None and g.get("index") not in ctx.cfg.gpus:
            continue
        cc = field(ctx, g, "cc", record=False)
        if cc and tuple(cc) < (8, 9):
            old.append(f"{label(g)} is {cc[0]}.{cc[1]}")
    return "; ".join(old)
