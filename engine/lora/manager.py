"""The adapters an engine serves: registered by name, their host copies in an LRU of
--max-cpu-loras, their device slots (1..--max-loras) in an LRU of their own.

Threads: the HTTP side registers, removes and resolves names (under the lock); the step
loop acquires and releases device slots (its own state, no lock but for reading host
weights). A request holds its adapter object from submit to its end, and its device slot
from admission to its end: removing a name refuses new requests at once, while those
already submitted finish on the same weights (the slot is reused only when none holds it).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from pathlib import Path

from ..spec.hf_config import ModelConfig
from .adapter import LoraAdapter, LoraError, read_adapter, read_weights
from .slabs import LoraBatch, attach, write_slot


def parse_lora_module(text: str) -> tuple[str, str, str | None]:
    """One --lora-modules entry: 'name=path' or vLLM's JSON form
    '{"name": ..., "path": ..., "base_model_name": ...}' -> (name, path, base_model_name)."""
    s = text.strip()
    if s.startswith("{"):
        try:
            d = json.loads(s)
        except ValueError as exc:
            raise ValueError(f"{text!r} is not valid JSON ({exc})") from None
        if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
            raise ValueError(f"{text!r}: the JSON form needs string fields \"name\" and \"path\"")
        extra = set(d) - {"name", "path", "base_model_name"}
        if extra:
            raise ValueError(f"{text!r}: unknown field(s) {', '.join(sorted(extra))}")
        base = d.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"{text!r}: base_model_name must be a string")
        name, path = d["name"], d["path"]
    else:
        name, eq, path = s.partition("=")
        base = None
        if not eq:
            raise ValueError(f"{text!r} is not name=path (or vLLM's JSON form)")
    if not name.strip() or not path.strip():
        raise ValueError(f"{text!r}: the name and the path must not be empty")
    return name.strip(), path.strip(), base


class LoraManager:
    def __init__(self, model, mc: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int):
        self.model, self.mc = model, mc
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_rank, max_cpu_loras
        self.batch: LoraBatch = attach(model, mc, max_loras, max_rank)
        self._lock = threading.Lock()
        self._by_name: dict[str, LoraAdapter] = {}
        self._host: OrderedDict[int, LoraAdapter] = OrderedDict()   # uid -> adapter with host weights
        # step-loop side: device slots
        self._slot_of: dict[int, int] = {}                  # uid -> slot
        self._holder: dict[int, LoraAdapter] = {}           # slot -> adapter
        self._refs = [0] * (max_loras + 1)
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident slots no request holds
        self._never_used = list(range(max_loras, 0, -1))

    # ------------------------------------------------------------------ names (any thread)
    def names(self) -> list[LoraAdapter]:
        with self._lock:
            return list(self._by_name.values())

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoraAdapter:
        """Read, check and register an adapter (reads files: not on the event loop)."""
        with self._lock:
            if name in self._by_name:
                raise LoraError(f"LoRA adapter {name!r} is already loaded")
        adapter = read_adapter(name, path, self.mc, self.max_rank, base_model_name)
        with self._lock:
            if name in self._by_name:
                raise LoraError(f"LoRA adapter {name!r} is already loaded")
            self._by_name[name] = adapter
            self._keep_host(adapter)
        return adapter

    def remove(self, name: str) -> None:
        """New requests for `name` are refused from now on; those submitted finish."""
        with self._lock:
            adapter = self._by_name.pop(name, None)
            if adapter is None:
                raise KeyError(name)

    def get(self, name: str) -> LoraAdapter | None:
        with self._lock:
            return self._by_name.get(name)

    def _keep_host(self, adapter: LoraAdapter) -> None:
        """Mark adapter's host copy used; drop the least recently used beyond the limit."""
        self._host[adapter.uid] = adapter
        self._host.move_to_end(adapter.uid)
        while len(self._host) > self.max_cpu_loras:
            _, old = self._host.popitem(last=False)
            old.weights = None

    # ------------------------------------------------------------------ slots (step loop)
    def acquire(self, adapter: LoraAdapter) -> int | None:
        """adapter's device slot, written there first if it is not resident; None when
        every slot is held by running requests (the request waits). Raises LoraError when
        its files, read again, are gone or changed."""
        slot = self._slot_of.get(adapter.uid)
        if slot is None:
            if self._never_used:
                slot = self._never_used.pop()
            elif self._idle:
                slot, _ = self._idle.popitem(last=False)
                del self._slot_of[self._holder.pop(slot).uid]
            else:
                return None
            try:
                write_slot(self.model, slot, self._host_weights(adapter))
            except BaseException:
                self._never_used.append(slot)   # zeroed or half-written: no adapter's now
                raise
            self._slot_of[adapter.uid] = slot
            self._holder[slot] = adapter
        elif self._refs[slot] == 0:
            del self._idle[slot]
        self._refs[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot] == 0:
            self._idle[slot] = None

    def _host_weights(self, adapter: LoraAdapter) -> LoraAdapter:
        with self._lock:
            if adapter.weights is None:
                adapter.weights = read_weights(adapter.name, Path(adapter.path), self.mc,
                                               adapter.rank, adapter.scale)
            self._keep_host(adapter)
            return adapter
