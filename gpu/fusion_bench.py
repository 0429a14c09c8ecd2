"""The fused launches of a decode layer against the launches they replace, as a captured
decode step runs them: each op called CALLS times back to back inside one CUDA graph,
the replay's median device time over REPS replays divided by CALLS (launch gaps
included, as in a step). Every pair is checked equal (or within bf16 tolerance) first.

  python3 gpu/fusion_bench.py OUT.json

- rope_write_kv against apply_rope + write_kv (the 8B shape: 32 q heads, 8 KV heads, D 128);
- the MoE router's top k in one launch against torch's softmax / topk / renormalise / casts
  (Mixtral: 8 experts, top 2; Qwen3-MoE: 128, top 8);
- the experts' output pairs of each token added up by one Triton launch against torch's sum
  over the middle dimension (Mixtral: hidden 4096, top 2; Qwen3-MoE-like: 2048, top 8).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # zerod from the checkout

from graph_timing import capture_calls, replay_ms  # noqa: E402

CALLS, REPS = 32, 50
DEV = torch.device("cuda")
BF = torch.bfloat16


def per_call_us(fn) -> float:
    g = capture_calls(torch, fn, CALLS, warmups=3)
    for _ in range(5):
        g.replay()
    return replay_ms(torch, g, REPS) * 1000 / CALLS


def rope_rows(rows):
    from zerod.engine.kernels import CUDA_KERNELS as K

    hq, hk, d, page = 32, 8, 128, 16
    g = torch.Generator().manual_seed(0)
    for t in (1, 32, 200, 2048):
        qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(DEV, BF)
        q, k, v = qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hk) * d].view(t, hk, d), qkv[:, (hq + hk) * d:].view(t, hk, d)
        pos = torch.randint(0, 4096, (t,), generator=g).to(DEV)
        cs = torch.randn(4096, d, generator=g).to(DEV, BF)
        pages = t // page + 8
        kc = torch.zeros(pages, page, hk, d, dtype=BF, device=DEV)
        vc = torch.zeros_like(kc)
        slots = (page + torch.randperm((pages - 1) * page, generator=g)[:t]).to(DEV)
        kc2, vc2 = kc.clone(), vc.clone()

        def two():
            qo, ko = K["apply_rope"](q, k, pos, cs)
            K["write_kv"](ko, v, kc2, vc2, slots)
            return qo, ko

        def one():
            return K["rope_write_kv"](q, k, v, pos, cs, kc, vc, slots)

        a, b = two(), one()
        same = all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
        rows.append(dict(op="rope + KV write", shape=f"T={t}", before_us=per_call_us(two), after_us=per_call_us(one),
                         equal=same))


def router_rows(rows):
    from zerod.engine.kernels.router import route
    from zerod.engine.model.moe import route_reference

    g = torch.Generator().manual_seed(2)
    for e, k in ((8, 2), (128, 8)):
        for t in (1, 200, 224, 2048):
            logits = torch.randn(t, e, generator=g).to(DEV, BF)

            def torch_path():
                w, ids = route_reference(logits, k, True)
                return w.reshape(-1).float().contiguous(), ids.reshape(-1).to(torch.int32)

            w1, i1 = torch_path()
            w2, i2 = route(logits, k, True)
            same = torch.allclose(w1, w2.reshape(-1), rtol=1e-5, atol=1e-6)
            rows.append(dict(op="MoE router", shape=f"E={e} k={k} T={t}", before_us=per_call_us(torch_path),
                             after_us=per_call_us(lambda: route(logits, k, True)), equal=same))


def sum_rows(rows):
    from zerod.engine.kernels.moe import sum_pairs

    g = torch.Generator().manual_seed(3)
    for h, k in ((4096, 2), (2048, 8)):
        for t in (1, 200, 224, 2048):
            out = torch.randn(t * k, h, generator=g).to(DEV, BF)
            want = out.view(t, k, -1).sum(dim=1)
            got = sum_pairs(out, t, k, BF)
            same = torch.equal(want, got) if k == 2 else torch.allclose(want.float(), got.float(), rtol=1e-2, atol=1e-2)
            rows.append(dict(op="MoE pairs' sum", shape=f"H={h} k={k} T={t}",
                             before_us=per_call_us(lambda: out.view(t, k, -1).sum(dim=1)),
                             after_us=per_call_us(lambda: sum_pairs(out, t, k, BF)), equal=same))


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "fusion.json")
    rows: list[dict] = []
    for part in (rope_rows, router_rows, sum_rows):
        part(rows)
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(DEV), "calls_per_graph": CALLS,
                                   "rows": rows}, indent=1))
    print(f"{'op':18} {'shape':32} {'before us':>10} {'after us':>9} {'saved':>7}  equal")
    for r in rows:
        print(f"{r['op']:18} {r['shape']:32} {r['before_us']:10.2f} {r['after_us']:9.2f} "
              f"{r['before_us'] - r['after_us']:7.2f}  {r['equal']}")


if __name__ == "__main__":
    main()
