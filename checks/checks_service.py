"""Service checks: where the engine listens, and whether its model fits."""

from __future__ import annotations

import dataclasses
import ipaddress

from zerod.engine.config import EngineError
# torch-free: the engine's own model spec and sizing formula
from zerod.engine.spec.hf_config import parse_model_config
from zerod.engine.spec.quant import resolve as resolve_quant
from zerod.engine.spec.servable import refuse_gpu_count, refuse_unservable
from zerod.engine.spec.sizing import FP8_KV, KVPlan, kv_cache_dtype, plan_kv, serving_dtype
from zerod.engine.spec.weights import weight_bytes

from .checks_gpu import GiB, field, label
from .report import FAIL, PASS, SKIP, WARN, Ctx, check

SERVABLE_FIX = ("serve a supported checkpoint (docs/engine-interface.md lists the architectures) "
                "with [engine] flags the engine accepts")
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
        return FAIL(m["config_error"], fix_path)
    if not isinstance(m.get("config"), dict):   # a snapshot saved before facts held the config itself
        return SKIP(f"model {path} found; this facts snapshot holds no copy of its config.json to check")
    if ctx.cfg.engine_kind != "zerod":   # what vLLM / SGLang serve and how they size is their own
        return SKIP(f"model {path} found; [daemon] engine = \"{ctx.cfg.engine_kind}\" serves it, and doctor "
                    f"checks a model against zerod's own engine only")
    # the engine's own reading of the checkpoint and its flags: refused here as `serve` refuses
    try:
        cfg = ctx.cfg.engine_config()
        mc = parse_model_config(m["config"], f"{path}/config.json")
        dtype = serving_dtype(cfg.dtype, mc.torch_dtype, "cuda")
        kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, dtype)
        quant = resolve_quant(mc.quant, cfg.quantization)
        refuse_unservable(mc, quant, cfg.tensor_parallel_size, cfg.enable_lora)
        # what the weights take on each GPU as the engine allocates them (dummy weights alike)
        weights = weight_bytes(mc, dtype, quant, cfg.tensor_parallel_size)
    except EngineError as exc:
        return FAIL(f"the engine cannot serve {path}: {exc}", SERVABLE_FIX)
    fp8 = _fp8_uses(mc, quant, kv_dtype)
    if fp8:
        old = _fp8_incapable(ctx)
        if old:
            return FAIL(f"{' and '.join(fp8)} need(s) compute capability 8.9+ (FP8 tensor cores); {old}",
                        "run FP8 on Ada or Hopper (L4, L40S, H100, H200), or serve a bf16 checkpoint "
                        "without --quantization fp8 and with [engine] kv_cache_dtype = \"auto\"")
    if m.get("weights_error") and cfg.load_format != "dummy":
        return FAIL(f"the engine cannot load {path}: {m['weights_error']}",
                    fix_path + " (or `--load-format dummy` for tests)")
    if m.get("tokenizer_error"):
        return FAIL(f"the engine cannot serve {path}: {m['tokenizer_error']}",
                    "put the checkpoint's tokenizer.json beside it, or set [engine] tokenizer to its folder")
    notes = []
    if cfg.max_model_len and cfg.max_model_len > mc.max_position_embeddings:
        notes.append(f"max_model_len {cfg.max_model_len} exceeds the model's {mc.max_position_embeddings}")
    gl = ctx.facts.value("nvml.gpus") or []
    if ctx.cfg.gpus is not None:
        gl = [g for g in gl if g.get("index") in ctx.cfg.gpus]
    totals = [g["memory"]["total"] for g in gl if g.get("memory")]
    if not totals:
        return SKIP(f"model {path} found ({weights / GiB:.1f} GiB of weights); no GPU to size it against")
    try:
        refuse_gpu_count(cfg.tensor_parallel_size, len(gl))
    except EngineError as exc:
        return FAIL(f"the engine cannot serve {path}: {exc}",
                    "lower [engine] tensor_parallel_size to the GPUs it has, or give it more ([doctor] gpus)")
    total = min(totals)     # the pool is the same on every GPU: the least of them sizes it
    fix = ("lower [engine] max_model_len or max_num_seqs, raise gpu_memory_utilization (<= 0.92), "
           "or use a larger GPU / more GPUs")
    try:
        plan, refused = _kv_plan(cfg, mc, dtype, weights, total)
    except EngineError as exc:     # the weights and headroom leave less than two pages
        return FAIL(f"weights {weights / GiB:.1f} GiB on a {total / GiB:.1f} GiB GPU: {exc}", fix)
    tokens = (plan.num_pages - 1) * cfg.block_size     # page 0 is scratch
    ctx.ev("kv_budget", {"gpu_total_bytes": total, "weights_bytes": weights, "dtype": dtype,
                         "kv_cache_dtype": kv_dtype, "kv_bytes_per_token": plan.page_bytes // cfg.block_size,
                         "kv_pages": plan.num_pages, "kv_tokens": tokens,
                         "max_model_len": plan.max_model_len}, "computed (engine/spec/sizing.py)")
    if refused:
        return FAIL(f"the KV pool holds {tokens} tokens, less than one {cfg.max_model_len}-token sequence", fix)
    want = cfg.max_model_len or mc.max_position_embeddings
    msg = (f"weights {weights / GiB:.1f} GiB; KV room for {tokens} tokens"
           f" = {tokens // plan.max_model_len} full {plan.max_model_len}-token sequences")
    if plan.max_model_len < want:
        notes.append(f"max_model_len is capped to {plan.max_model_len} (the pool's size), "
                     f"below the model's {want}")
    if notes:
        return WARN(msg + "; " + "; ".join(notes),
                    "set [engine] max_model_len within the model's limit and the KV pool")
    return PASS(msg)


def _kv_plan(cfg, mc, dtype: str, weights: int, total: int) -> tuple[KVPlan, bool]:
    """The pool the engine sizes on a GPU of `total` bytes holding only these weights
    (sizing.plan_kv, as the engine calls it after loading them), and whether the engine
    refuses it because an explicit max_model_len does not fit (the plan is then the pool
    it would have had)."""
    mem = (total - weights, total)
    try:
        return plan_kv(cfg, mc, dtype, "cuda", mem), False
    except EngineError:
        if not cfg.max_model_len:
            raise
    return plan_kv(dataclasses.replace(cfg, max_model_len=None), mc, dtype, "cuda", mem), True


def _fp8_uses(mc, quant, kv_dtype: str) -> list[str]:
    """What of this configuration runs in FP8: the checkpoint's weights, weights quantized
    at load, the KV cache."""
    uses = []
    if quant is not None:
        uses.append(f"the {quant.source} FP8 weights" if quant.checkpoint_fp8 else "--quantization fp8")
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
