"""The CUDA graphs of a runner, captured once at start: decode (embedding -> logits) per
batch-size bucket, and prefill per padded token count (Tuning.prefill_graph_tokens), each
with and without the LoRA path when adapters are on. The runner replays them
(`ModelRunner.decode_logits`, `_prefill_padded`); capturing is here."""

from __future__ import annotations

import logging
import time

import torch

from ..tuning import Tuning
from .decode_sizes import decode_sizes

log = logging.getLogger("zerod.engine")


def prefill_graph_sizes(tuning: Tuning, cap: int, max_model_len: int, decode_rows: int = 0) -> list[int]:
    """The padded token counts prefill graphs are captured for: Tuning's sizes up to the
    step's prompt budget, and the budget plus one page of padding, so a chunk of the full
    budget fits beside the dummy sequence that pads the graph. With decode_rows (one
    forward a step: every decoding request a row of the prefill graph), one more: the full
    budget beside that many decodes."""
    sizes = [t for t in tuning.prefill_graph_tokens if t <= cap]
    if sizes and cap <= max(tuning.prefill_graph_tokens) and cap + 16 not in sizes:
        sizes.append(cap + 16)
    if sizes and decode_rows:
        sizes.append(cap + decode_rows + 16)
    return [t for t in sizes if t < max_model_len]


def prefill_graph_seqs(tuning: Tuning, T: int, max_num_seqs: int) -> int:
    """The prompt chunks a prefill graph of T tokens holds (Tuning.prefill_graph_seqs and
    prefill_graph_chunk_tokens), never more than a step can have (one a request): each
    graph's attention launches a program per sequence slot and head, so a small graph
    keeps few slots and a large one room for a burst's many short chunks."""
    per = tuning.prefill_graph_chunk_tokens
    return min(max(tuning.prefill_graph_seqs, T // per if per else 0), max_num_seqs)


def prefill_graph_slots(tuning: Tuning, sizes: list[int], max_num_seqs: int) -> dict[int, int]:
    """The chunk slots of each prefill graph size (ascending, as prefill_graph_sizes gives)."""
    return {t: prefill_graph_seqs(tuning, t, max_num_seqs) for t in sizes}


def prefill_graph_for(slots: dict[int, int], rows: int, chunks: int) -> int:
    """The smallest prefill graph (slots: its chunk slots per padded token count, in
    ascending order) with a row of padding past `rows` and a slot for each of `chunks`:
    its token count, 0 where none holds them (eager)."""
    return next((t for t, n in slots.items() if t > rows and n >= chunks), 0)


def graph_sets(r, plain: dict, with_lora: dict) -> tuple[tuple[bool, dict], ...]:
    """(LoRA path, where its graphs go) for each set a capture makes: the LoRA one only
    with --enable-lora."""
    return ((False, plain), (True, with_lora)) if r.lora is not None else ((False, plain),)

@torch.inference_mode()
def capture(r) -> None:
    """Capture decode (embedding -> logits) per batch bucket; on failure stay eager."""
    if not r.cuda or r.cfg.enforce_eager:
        return
    if not r.model.ops.has_kernel("decode_attention") and r.W * r.ps > 8192:
        log.warning("no paged decode kernel and max_model_len %d > 8192: decode runs eager",
                    r.max_model_len)
        return
    pool = None
    try:
        t0 = time.perf_counter()
        buckets, costs = decode_sizes(r, min(r.cfg.cuda_graph_max_bs, r.cfg.max_num_seqs))
        if costs is not None:
            log.info("decode graph sizes by cost (%.2fs): the projections' ms at each size %s",
                     time.perf_counter() - t0, {m: round(c * 1e3, 3) for m, c in costs.items()})
        r.g_slots.fill_(r.pad_slot)
        r.g_pos.zero_()
        ways = graph_sets(r, r.graphs, r.lora_graphs)
        # warm up every bucket eagerly first (cuBLAS handles, and each Triton variant a
        # bucket's size selects: batch 1 is its own specialisation, and the FP8 / LoRA
        # kernels pick tiles by rows), so nothing compiles while a graph is captured; one
        # layer of each kind launches every variant (LlamaModel.layer_kinds)
        kinds = r.model.layer_kinds()
        for lora, _ in ways:
            for bs in [buckets[-1]] + buckets:
                r._decode_forward(r.g_slots[:bs], r.g_pos[:bs], r.W, lora, kinds)
        torch.cuda.synchronize()
        for lora, graphs in ways:
            for bs in reversed(buckets):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = r._decode_forward(r.g_slots[:bs], r.g_pos[:bs], r.W, lora)
                pool = g.pool()
                graphs[bs] = (g, out)
        torch.cuda.synchronize()
        r.buckets = buckets
        log.info("captured decode CUDA graphs for batch sizes %s", buckets)
    except Exception as exc:  # noqa: BLE001
        if r.model.tp is not None:   # the ranks must all replay or all run eager
            raise
        log.warning("CUDA graph capture failed (%s); decode runs eager", exc)
        r.graphs.clear()
        r.lora_graphs.clear()
        r.buckets = []
        torch.cuda.synchronize()
        return
    if not r.model.ops.has_kernel("prefill_attention"):
        return  # the padded batch needs the paged prefill kernel (graph-safe, no host sync)
    try:
        capture_prefill(r)
        slots = [r.pgraph_seqs[t] for t in r.pgraphs]
        log.info("captured prefill CUDA graphs for %s padded tokens, up to %d-%d prompt chunks%s",
                 sorted(r.pgraphs), min(slots, default=0), max(slots, default=0),
                 " (and with LoRA rows)" if r.lora_pgraphs else "")
    except Exception as exc:  # noqa: BLE001
        if r.model.tp is not None:
            raise
        log.warning("prefill CUDA graph capture failed (%s); prompts prefill eager", exc)
        r.pgraphs.clear()
        r.lora_pgraphs.clear()
        r.pad_prefill = False
        torch.cuda.synchronize()


def capture_prefill(r) -> None:
    """A graph per padded token count (and per LoRA path), in a memory pool of their
    own, captured on a dummy prompt of one token."""
    pool = None
    ways = graph_sets(r, r.pgraphs, r.lora_pgraphs)
    kinds = r.model.layer_kinds()
    for T in r.pgraph_sizes:
        G = r.pgraph_seqs[T]
        r.p_toks[:T].zero_()
        r.p_pos[:T].copy_(torch.cat([torch.zeros(1, dtype=torch.int64, device=r.device),
                                        torch.arange(T - 1, dtype=torch.int64, device=r.device)]))
        r.p_smap[:T].copy_(r.p_pos[:T] % r.ps)
        r.p_lora[:T].zero_()
        r.p_cu[:G + 2].copy_(torch.tensor([0] + [1] * G + [T], dtype=torch.int32))
        r.p_ctx[:G + 1].copy_(torch.tensor([1] + [0] * (G - 1) + [T - 1], dtype=torch.int32))
        r.p_bt.zero_()
        r.p_dctx.zero_()    # one forward a step: the decode kernel's tail, no decode in it
        for lora, graphs in ways:
            for _ in range(2):  # Triton compiles / autotunes outside the capture
                r._prefill_padded_forward(T, lora, kinds)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                hidden = r._prefill_padded_forward(T, lora)
            pool = g.pool()
            graphs[T] = (g, hidden)
    r.pad_prefill = bool(r.pgraphs)
