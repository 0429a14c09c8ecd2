"""Tuning: the engine's measured choices (shapes of CUDA graphs, attention backends by
length), one typed object the model and runner read. They are not user configuration:
the defaults are what the H200 measurements chose (docs/perf.md, "Step stalls"); a device
script that compares variants sets `ZEROD_TUNING` to a JSON object of the fields it
changes, and the engine refuses a field it does not know.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields, replace

ENV = "ZEROD_TUNING"
# the least value of each integer field
MINIMUM = {"prefill_graph_seqs": 1, "sdpa_flash_max_len": 0, "steps_in_flight": 1, "gil_switch_interval_us": 50,
           "decode_graphs_by_cost": 0, "long_prompt_slack": 0.0, "fp8_tensorwise_max_m": 0,
           "prefill_graph_chunk_tokens": 0}


@dataclass(frozen=True)
class Tuning:
    # Prompt chunks run from CUDA graphs captured per padded token count (those up to the
    # step's prompt budget, plus the budget itself): an eager forward is ~400-1,000
    # launches (a third of them Triton, tens of microseconds of Python each) whose host time
    # exceeds the device work of a chunk, and every decoding stream waits for it
    # (docs/perf.md "Prefill CUDA graphs", "Step stalls").
    prefill_graph_tokens: tuple[int, ...] = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
    # A prefill graph of T tokens holds up to max(prefill_graph_seqs, T //
    # prefill_graph_chunk_tokens) chunks (0: prefill_graph_seqs at every T), at most
    # max_num_seqs. A burst of short prompts puts 33-150 chunks in a step: with 32 slots
    # those steps run eager, a median 26-38 ms of launch on an H100 against 3-4 ms from a graph;
    # 256 slots at every size cost each smaller step's attention ~0.4-0.8 ms of empty
    # programs (docs/perf.md "Prefill CUDA graphs").
    prefill_graph_seqs: int = 32
    prefill_graph_chunk_tokens: int = 8
    # Whether steps that also decode take the prefill graphs (else only an idle engine's):
    # 8 LoRA adapters at 200 streams ran at 89.8 % of the base with it, 68.2 % without
    # (docs/perf.md "Prefill CUDA graphs").
    prefill_graphs_while_decoding: bool = True
    # Fresh prompts up to this length take SDPA's plan-free backends (flash builds no plan
    # and is as fast there); longer ones the default (cuDNN), whose plans are per length.
    sdpa_flash_max_len: int = 1024
    # Longer fresh prompts padded to ~8 lengths per power of two: a bounded set of cuDNN
    # plans, all built by the warm-up.
    sdpa_pad_lengths: bool = True
    # Run the warm-up of every prefill shape and attention plan before READY.
    warmup: bool = True
    # The warm-up's forwards (and the eager runs before each graph's capture) go through one
    # layer of each kind (LlamaModel.layer_kinds), not all of them: every kernel variant
    # is launched as the whole model would, the weights read once rather than once a
    # layer (71 forwards of up to 16K tokens through 32 layers took 2.8 s of a 10.4 s
    # restart on the H200; docs/perf.md "Step stalls").
    warmup_layer_kinds: bool = True
    # FP8: a one-token product (batch-1 decode) through cuBLASLt's tensorwise FP8 GEMM, the
    # per-channel weight scales on the output after (86.0 us a layer against W8A16's 95.7
    # at M = 1 on the H200; batch-1 293 against 268 tokens/s; docs/perf.md "FP8").
    fp8_one_token_tensorwise: bool = True
    # FP8: products of more rows than W8A16 takes, up to this many, through the same
    # tensorwise GEMM with unit scales, the tokens' and the weights' scales applied after:
    # the row-wise GEMM's product, where cuBLASLt's row-wise kernels run slower. Servers
    # with it served 32 to 200 streams faster, measured on an H100 (no H200 came for those
    # calls; docs/perf.md "FP8"). 0: row-wise above W8A16's rows.
    fp8_tensorwise_max_m: int = 200
    # FP8: per-token activations quantized by the kernel before the projection (the
    # RMSNorm before qkv and gate_up, SiLU·mul before down), not by a launch of their own:
    # at batch 1 those launches take 195 of a step's 3,474 us of kernels (docs/perf.md "FP8").
    fp8_fused_act_quant: bool = True
    # FP8: cuBLASLt's FP8 GEMMs (tensorwise and row-wise) with fast accumulation
    # (`use_fast_accum`): the sums stay in the tensor cores' own accumulator instead of
    # being promoted to float32 every few K steps, as vLLM's CUTLASS FP8 kernels run. The
    # H200 measured 200 streams +3-5 % (two calls) and the 16K prompt -6 %, at twice the promoted
    # error (0.33 % against 0.17 %, relative to float32) (docs/perf.md "FP8").
    fp8_fast_accum: bool = True

    # A step with prompt chunks and decodes runs them in one forward (the weights read
    # once, not twice) when the rows fit a prefill graph: the decodes are its last rows,
    # and their attention is the decode kernel's, the chunks' the prefill kernel's. The
    # H200 measured mixed steps shorter and the streams' gaps beside a long prompt smaller
    # than with two forwards (docs/perf.md "A model of the scheduler").
    one_forward_mixed_steps: bool = True
    # Products whose shape and row count the device's skinny GEMM table lists
    # (engine/kernels/gemm_table.py: measured by gpu/skinny_gemm_bench.py) take that Triton
    # kernel in place of cuBLAS's. Off until a server measures it where its cells win: the
    # H200's FP8 cells beat cuBLAS's row-wise GEMM 1.25-2.35x per projection at 2-64 rows
    # in the sweep, and servers with and without them served batch-1 and 200 streams alike,
    # steps the table does not change (docs/perf.md "FP8").
    skinny_gemm_table: bool = False
    # Steps launched and not yet read back, at most (the ring slots in use, up to
    # EngineConfig.ring_depth). A new prompt's first step runs after every step
    # already in flight, so each one more adds a step's time to its TTFT; the device stays
    # busy with two as long as a launch takes less host time than a step takes device time
    # (docs/perf.md "Steps in flight").
    steps_in_flight: int = 2
    # The process's GIL switch interval (sys.setswitchinterval), in microseconds, for the
    # engine's life, its build included. Every torch call of a launch gives up the GIL;
    # when the HTTP loop (a burst's requests arriving) or the output poller is busy in
    # Python, the step thread may wait up to that long to take it back, call after call:
    # on the CPU a 30-call step took up to 65-103 ms beside a busy thread at Python's
    # 5,000 us, 5-9 ms at 500 (gpu/gil_convoy.py). Python's own until a GPU shows a shorter
    # one helps: a CPU model of a 200-stream wave through the server did not (docs/perf.md
    # "The GIL and the step thread").
    gil_switch_interval_us: int = 5000
    # Decode CUDA graphs: 0 captures the fixed ladder of batch sizes (1, 2, 4, 8, then 16
    # to 128 by 16, then by 32); N captures N graphs at the sizes where the model's
    # projections, timed at start at every multiple of 8, cost least (runner/decode_sizes.py:
    # cuBLAS's GEMM time is not monotone in the rows, and the ladder pads 200 streams to
    # 224 rows, dearer than 200 or 256 in bf16). The H200 measured bf16's 200 streams
    # faster and FP8's alike, for a second or two of the start (docs/perf.md "A decode step
    # against its bounds").
    decode_graphs_by_cost: int = 16
    # The chunk budget's deadline for a waiting prompt: arrival + --target-ttft-ms + this
    # many times the prompt's own prefill time (engine/core/step_cost.py), so a long
    # prompt may take longer than a short one. 0 holds every prompt to the TTFT target
    # alone. Measured, it lowers mixed 10 req/s TTFT p99 and nearly doubles its ITL p99:
    # a trade against the flat ITL line, so 1 (docs/perf.md "A model of the scheduler").
    long_prompt_slack: float = 1.0

    def __post_init__(self) -> None:
        """Every field of its default's type (a count at least MINIMUM's): a value the engine
        could not honour as given is refused, never coerced."""
        for f in fields(self):
            v = getattr(self, f.name)
            if type(f.default) is bool:
                ok, want = type(v) is bool, "true or false"
            elif type(f.default) is int:
                lo = MINIMUM[f.name]
                ok, want = type(v) is int and v >= lo, f"an integer >= {lo}"
            elif type(f.default) is float:
                lo = MINIMUM[f.name]
                ok, want = type(v) in (int, float) and math.isfinite(v) and v >= lo, f"a number >= {lo}"
                if ok:
                    object.__setattr__(self, f.name, float(v))
            else:   # token counts
                ok = type(v) is tuple and bool(v) and all(type(t) is int and t >= 1 for t in v)
                want = "a non-empty list of integers >= 1"
            if not ok:
                raise ValueError(f"{ENV}: {f.name} must be {want}, not {v!r}")

    @classmethod
    def from_env(cls, environ=None) -> "Tuning":
        raw = (environ if environ is not None else os.environ).get(ENV, "").strip()
        if not raw:
            return cls()
        try:
            given = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{ENV} is not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError(f"{ENV} must be a JSON object of Tuning fields")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"{ENV}: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")
        if isinstance(given.get("prefill_graph_tokens"), list):
            given["prefill_graph_tokens"] = tuple(given["prefill_graph_tokens"])
        return replace(cls(), **given)
