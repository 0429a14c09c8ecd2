"""Run the level's tests on the chosen GPUs and build the report.

GPU indexes are NVML's (CUDA is told to order devices by PCI bus id, as NVML
does). On a host where the tests cannot run (no driver, no GPU, a CPU-only
torch) every test of the level is reported as skipped, with why: the same shape.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
import time
from typing import Any, Callable

from zerod.checks.gpu_specs import GpuSpec, pcie_gb_s, spec_for
from zerod.diag import nvml_health
from zerod.diag.catalogue import BY_ID, TESTS, for_level
from zerod.diag.report import DiagResult, make_report

ORDER = {t.id: i for i, t in enumerate(TESTS)}


def why_not_runnable(torch_loader: Callable[[], Any]) -> tuple[Any, str | None]:
    """(torch, None) when CUDA works here, else (None, the reason)."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # CUDA's indexes = NVML's
    try:
        torch = torch_loader()
    except ImportError as exc:
        return None, f"torch is not installed: {exc}"
    if not torch.cuda.is_available():
        if getattr(torch.version, "cuda", None) is None:
            return None, f"torch {torch.__version__} is a CPU-only build"
        return None, "no CUDA device visible (no NVIDIA GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)"
    return torch, None


def skipped_report(level: str, reason: str, host: dict[str, Any]) -> dict[str, Any]:
    return make_report([DiagResult(t.id, "skip", message=reason) for t in for_level(level)], host)


def _import_torch():
    import torch

    return torch


def _nvlink_links(gpu: int) -> int:
    """Active NVLinks of a GPU (0: none, or NVML cannot say)."""
    from zerod.checks.probe_links import MAX_LINKS
    from zerod.checks.probe_nvml import NvmlUnavailable, session

    try:
        N = session()
        h = N.nvmlDeviceGetHandleByIndex(gpu)
    except (NvmlUnavailable, Exception):  # noqa: BLE001 - no NVLink figure, the PCIe one stands
        return 0
    up = 0
    for link in range(MAX_LINKS):
        try:
            up += int(N.nvmlDeviceGetNvLinkState(h, link)) == 1
        except Exception:  # noqa: BLE001 - past the last link
            break
    return up


def peer_expected(src: dict, dst: dict, spec: GpuSpec | None, links: Callable[[int], int]) -> tuple[float | None, str]:
    """What a copy between two GPUs should reach: their common NVLinks, else PCIe."""
    ls, ld = links(src["index"]), links(dst["index"])
    if spec and spec.nvlink_gb_s_per_link and ls and ld:
        n = min(ls, ld)
        return n * spec.nvlink_gb_s_per_link, f"{n} NVLinks x {spec.nvlink_gb_s_per_link:g} GB/s"
    rates = [pcie_gb_s(g.get("pcie_gen_max"), g.get("pcie_width_max")) for g in (src, dst)]
    if all(rates):
        return min(rates), "PCIe (no NVLink between them)"
    return None, "no link rate known"


def run_diag(level: str, gpus: list[int] | None = None, *, torch_loader: Callable[[], Any] = _import_torch,
             progress: Callable[[str], None] = lambda _msg: None) -> dict[str, Any]:
    from zerod.diag import gpu_tests as T

    started = time.time()
    host: dict[str, Any] = {"hostname": socket.gethostname(), "level": level,
                            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                            "started_at": started}
    facts = nvml_health.read_nvml()
    nvml_gpus = {g["index"]: g for g in facts.value("nvml.gpus") or []}
    nvml_error = facts.get("nvml").error
    if nvml_error:  # no driver or no GPU: say that, not what torch thinks of it
        torch, reason = None, f"no NVIDIA GPU usable here: {nvml_error}"
    else:
        torch, reason = why_not_runnable(torch_loader)
    if reason:
        host.update(gpus=[], duration_s=round(time.time() - started, 3))
        return skipped_report(level, reason, host)
    chosen = list(gpus) if gpus is not None else list(range(torch.cuda.device_count()))
    sizes = T.SIZES[level]
    before = nvml_health.snapshot(facts)
    results: list[DiagResult] = []
    host["gpus"] = []
    host["torch"] = torch.__version__
    host["cuda"] = torch.version.cuda
    for gpu in chosen:
        g = nvml_gpus.get(gpu, {"index": gpu})
        name = g.get("name") or torch.cuda.get_device_name(gpu)
        spec = spec_for(name)
        host["gpus"].append({"index": gpu, "name": name, "uuid": g.get("uuid"),
                             "spec": spec._asdict() if spec else None})
        results += _one_gpu(T, torch, gpu, g, spec, sizes, level, progress)
    results += _peers(T, torch, chosen, nvml_gpus, sizes, progress)
    after = nvml_health.snapshot()
    for gpu in chosen:
        status, msg, ev = nvml_health.judge(gpu, before, after)
        results.append(DiagResult("diag.health_counters", status, gpu, message=msg, evidence=ev))
    results.sort(key=lambda r: (ORDER[r.id], r.gpu if r.gpu is not None else -1,
                                r.peer if r.peer is not None else -1))
    host["duration_s"] = round(time.time() - started, 3)
    return make_report(results, host)


def _guarded(test_id: str, gpu: int, fn, *args, peer: int | None = None) -> DiagResult:
    t0 = time.perf_counter()
    try:
        r = fn(*args)
    except Exception as exc:  # noqa: BLE001 - a test that raises is that test's error, the others run
        r = DiagResult(test_id, "error", gpu, peer, message=f"{type(exc).__name__}: {str(exc)[:300]}")
    r.duration_s = time.perf_counter() - t0
    return r


def _one_gpu(T, torch, gpu: int, g: dict, spec, sizes, level: str, progress) -> list[DiagResult]:
    progress(f"GPU {gpu}: CUDA context")
    ctx = _guarded("diag.cuda_context", gpu, T.cuda_context, torch, gpu)
    out = [ctx]
    plan = [("diag.hbm_bandwidth", T.hbm_bandwidth, (torch, gpu, spec, sizes)),
            ("diag.gemm_bf16", T.gemm_bf16, (torch, gpu, spec, sizes)),
            ("diag.gemm_fp8", T.gemm_fp8, (torch, gpu, spec, sizes)),
            ("diag.pcie_h2d", T.pcie, (torch, gpu, g, sizes, "h2d")),
            ("diag.pcie_d2h", T.pcie, (torch, gpu, g, sizes, "d2h"))]
    if level == "full":
        plan += [("diag.memory_pattern", T.memory_pattern, (torch, gpu, sizes)),
                 ("diag.gemm_stress", T.gemm_stress, (torch, gpu, spec, sizes, lambda: _clock_events(gpu)))]
    for test_id, fn, args in plan:
        if ctx.status != "pass":
            out.append(DiagResult(test_id, "skip", gpu, message="no working CUDA context on this GPU"))
            continue
        progress(f"GPU {gpu}: {BY_ID[test_id].title}")
        out.append(_guarded(test_id, gpu, fn, *args))
        try:
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a context a test broke: the next test reports it
            pass
    return out


def _clock_events(gpu: int) -> list[str]:
    return nvml_health.snapshot_gpu_clock_events(gpu) or []


def _peers(T, torch, chosen: list[int], nvml_gpus: dict, sizes, progress) -> list[DiagResult]:
    if len(chosen) < 2:
        return [DiagResult("diag.p2p_bandwidth", "skip", chosen[0] if chosen else None,
                           message="one GPU: no peer to copy to")]
    out = []
    for src in chosen:
        for dst in chosen:
            if src == dst:
                continue
            gs, gd = nvml_gpus.get(src, {"index": src}), nvml_gpus.get(dst, {"index": dst})
            expected, basis = peer_expected(gs, gd, spec_for(gs.get("name")), _nvlink_links)
            progress(f"GPU {src} -> GPU {dst}: peer copy")
            out.append(_guarded("diag.p2p_bandwidth", src, T.p2p, torch, src, dst, expected, basis, sizes, peer=dst))
    return out
