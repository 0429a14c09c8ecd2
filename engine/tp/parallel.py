"""Tensor parallelism: the process group of one engine's ranks and what they share.

Rank 0 is the engine process (scheduler, step loop, poller, HTTP); ranks 1..N-1 are
worker processes it spawns (tp_worker.py), one per GPU (cuda:rank of the visible
devices; NCCL), or N processes on the CPU (gloo, so CI runs TP=2). Each rank holds a
slice of every projection (linear.py's row-parallel and vocab-parallel variants), its
own attention heads and their KV pages. See docs/design.md, "Tensor parallelism".

A worker's life is its parent's: it dies with rank 0 (PR_SET_PDEATHSIG and a parent
watch), and rank 0 calls `on_lost` when a worker exits that it did not stop.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from typing import Callable

import torch
import torch.distributed as dist

from ..config import EngineConfig, EngineError
from ..spec.hf_config import ModelConfig
from ..spec.servable import refuse_gpu_count, refuse_split

log = logging.getLogger("zerod.engine")

WORKER_MODULE = "zerod.engine.tp.tp_worker"
INIT_TIMEOUT_S = 600          # a 70B checkpoint's slices load before the first collective


def check_tp(mc: ModelConfig, n: int, device: torch.device, quantized: bool = False,
             lora: bool = False) -> None:
    """Refuse, naming the reason, a degree this model (spec/servable.py) or host cannot be
    split over."""
    refuse_split(mc, n, quantized=quantized, lora=lora)
    if n == 1:
        return
    if device.type == "cuda":
        if device.index not in (None, 0):
            raise EngineError("--device cuda:N picks one GPU; with --tensor-parallel-size the ranks "
                              "take the first N visible GPUs (set CUDA_VISIBLE_DEVICES to choose them)")
        refuse_gpu_count(n, torch.cuda.device_count())


def kv_head_start(mc: ModelConfig, rank: int, n: int) -> int:
    """The first KV head of the checkpoint that `rank` holds."""
    if mc.num_kv_heads >= n:
        return rank * (mc.num_kv_heads // n)
    return rank * mc.num_kv_heads // n      # replicated: the head its query heads read


# torch 2.13 renamed all_gather_into_tensor (rank r's input at rows r*T of the output)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """This process's membership of the group: rank, world, the collectives the model and
    the step channel use. `host` is a gloo group for small CPU messages (on the CPU it is
    the default group itself)."""

    def __init__(self, rank: int, world: int, device: torch.device, init_method: str):
        self.rank, self.world, self.device = rank, world, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        from datetime import timedelta
        kw = dict(device_id=device) if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=timedelta(seconds=INIT_TIMEOUT_S), **kw)
        self.host = dist.new_group(backend="gloo") if device.type == "cuda" else dist.group.WORLD

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """[T, C] on every rank -> [T, world * C], rank r's columns at r*C."""
        t, c = x.shape
        out = torch.empty(self.world * t, c, dtype=x.dtype, device=x.device)
        _all_gather(out, x.contiguous())
        return out.view(self.world, t, c).permute(1, 0, 2).reshape(t, self.world * c)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=0)
        return x

    def host_broadcast(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=0, group=self.host)
        return x

    def host_min(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host)
        return t.tolist()

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class Workers:
    """Rank 0's side: spawns ranks 1..N-1, watches them, stops them.

    A worker that exits while the group is open is a lost rank: `on_lost(message)` runs
    on the watcher's thread (the engine fails health and exits; the group cannot go on
    without it)."""

    def __init__(self, cfg: EngineConfig, model_dir, device: torch.device,
                 on_lost: Callable[[str], None]):
        self.n = cfg.tensor_parallel_size
        self.on_lost = on_lost
        self.closing = False
        self.init_method = f"tcp://127.0.0.1:{_free_port()}"
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel()).lower()
        spec = json.dumps(dict(config=dataclasses.asdict(cfg), model_dir=str(model_dir),
                               device=device.type, init_method=self.init_method,
                               parent=os.getpid(), log_level=level))
        self.procs = [subprocess.Popen([sys.executable, "-m", WORKER_MODULE, str(r), spec])
                      for r in range(1, self.n)]
        log.info("tensor parallel %d: spawned worker pids %s", self.n, [p.pid for p in self.procs])
        for r, p in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(r, p), name=f"zerod-tp-watch-{r}",
                             daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _watch(self, rank: int, p: subprocess.Popen) -> None:
        code = p.wait()
        if not self.closing:
            self.kill()
            self.on_lost(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {code}")

    def stop(self, timeout: float = 10.0) -> None:
        """After the stop message (or on failure): wait, then kill what is left."""
        self.closing = True
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker %d did not stop in %.0fs; killing it", p.pid, timeout)
                p.kill()
                p.wait(5)

    def kill(self) -> None:
        self.closing = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()
