"""A tensor-parallel worker: rank 1..N-1 of an engine (`python -m zerod.engine.tp.tp_worker
RANK SPEC`, spawned by rank 0's parallel.Workers; SPEC is JSON: the engine config, the
model directory, the device type, the group's init address, the parent's pid).

It builds its shard of the model, the KV pool of its heads and a model runner exactly as
rank 0 does (same order of collectives: weights, memory agreement, graphs, warm-up), then
runs each step's forward as the step channel delivers it, and writes the ids rank 0
sampled into its `last_tokens`. It never schedules or samples.

Its life is its parent's: PR_SET_PDEATHSIG, a parent-pid watch, SIGINT and SIGTERM
ignored (rank 0 stops it with a STOP header). Any error is printed and exits non-zero,
which rank 0 notices (the engine fails its health and exits).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from ..config import EngineConfig
from ..prctl import kill_with_parent
from ..core.engine import build_rank
from .parallel import TPGroup
from .tp_channel import StepChannel

log = logging.getLogger("zerod.engine")


def _die_with_parent(parent: int) -> None:
    kill_with_parent()   # where it does nothing (not Linux), the watch below still ends it
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C reaches the whole process group:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # rank 0 handles it and stops the workers

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent:   # the parent died before the prctl took effect
        os._exit(1)
    threading.Thread(target=watch, name="zerod-tp-parent", daemon=True).start()


@torch.inference_mode()
def serve(rank: int, cfg: EngineConfig, model_dir: Path, device_type: str, init_method: str) -> None:
    dev = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    tp = TPGroup(rank, cfg.tensor_parallel_size, dev, init_method)
    try:
        runner, _ = build_rank(cfg, model_dir, dev, tp)
        channel = StepChannel(tp, runner.staging, cfg.max_num_seqs)
        log.info("tensor-parallel rank %d ready on %s", rank, dev)
        while (step := channel.recv_step()) is not None:
            if step.block_table is not None:
                rows, cols, pages = step.block_table
                runner.tables.block_table.index_put_((rows, cols), pages)
            if step.prefill is not None:
                runner.prefill_logits(step.prefill)
            if step.decode is not None:
                runner.decode_logits(step.decode)
            if step.sampled:
                ids = channel.recv_tokens(step.sampled)
                s = 0
                if step.prefill is not None:
                    s = step.prefill.sample_idx.numel()
                    runner.tables.last_tokens.index_copy_(0, step.prefill.sample_slots, ids[:s])
                if step.decode is not None:
                    runner.tables.last_tokens.index_copy_(0, step.decode.slots, ids[s:])
    finally:
        tp.destroy()


def main(argv: list[str]) -> int:
    rank, spec = int(argv[1]), json.loads(argv[2])
    _die_with_parent(spec["parent"])
    from zerod.engine.logs import setup_logging

    setup_logging(spec.get("log_level", "info"))
    try:
        serve(rank, EngineConfig(**spec["config"]), Path(spec["model_dir"]), spec["device"],
              spec["init_method"])
    except Exception as exc:  # noqa: BLE001 - printed for the operator, noticed by rank 0
        log.exception("tensor-parallel rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
