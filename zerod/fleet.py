"""The engines one daemon supervises: the `[engine]` table alone (one engine,
"default", on `[daemon] gpu_index`), or one `[[engines]]` table per engine on
a multi-GPU host (8 x TP1, 2 x TP4 …):

    [engine]                 # shared: every [[engines]] entry starts from these keys
    model = "/srv/models/llama-3-70b"
    [[engines]]
    name = "a"               # [A-Za-z0-9_.-], unique: the `engine` label and the control API's name
    gpus = [0, 1, 2, 3]      # NVML indexes, each GPU in one engine only; N GPUs: --tensor-parallel-size N
    port = 8001              # its own port (each engine needs one)
    # engine_command = [...], engine_env = {...}: as in [daemon], for this engine alone
    # any other key: a `zerod serve` flag, overriding [engine]'s

`tensor_parallel_size` is accepted here explicitly (it must equal the number of
GPUs; the daemon passes it as --tensor-parallel-size N when N > 1): the
engine's option is not checked against `zerod serve` by `zerod config check`, so
a config may name it before the engine it runs has it.

With `[[engines]]` every engine's alerts are keyed by its name and its series
carry `engine="NAME"`; the one-engine `[engine]` config keeps its unlabelled
series and unkeyed alerts, as they always were.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from zerod.config_schema import refusal

DEFAULT_NAME = "default"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,32}")
# [[engines]] keys the daemon takes for itself; the others are the engine's flags
OWN_KEYS = ("name", "gpus", "engine_command", "engine_env", "tensor_parallel_size")
# [daemon] keys that speak for one engine only: with [[engines]], each entry says it
SINGLE_ENGINE_KEYS = ("gpu_index", "engine_command", "engine_url")


@dataclass(frozen=True)
class EngineSpec:
    name: str
    gpus: tuple[int, ...]
    section: dict[str, Any]  # the engine's flags: [engine] with this entry's keys over it
    command: list[str] | None = None  # replaces the command line built from `section`
    env: dict[str, str] = field(default_factory=dict)
    tagged: bool = False  # one of [[engines]]: alerts keyed and series labelled by name

    def key(self, key: str = "") -> str:
        """An alert key of this engine's: unchanged for the one [engine] engine."""
        if not self.tagged:
            return key
        return f"{self.name}:{key}" if key else self.name

    @property
    def labels(self) -> dict[str, str]:
        return {"engine": self.name} if self.tagged else {}

    def child_env(self) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES for an engine of [[engines]], in NVML's (PCI bus) order."""
        if not self.tagged:
            return dict(self.env)
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(map(str, self.gpus)),
                **self.env}

    def flags(self) -> dict[str, Any]:
        """`section` plus the tensor-parallel degree its GPUs give."""
        if self.tagged and len(self.gpus) > 1:
            return {**self.section, "tensor_parallel_size": len(self.gpus)}
        return dict(self.section)


def engine_specs(config: dict[str, Any], gpu_index: int = 0) -> list[EngineSpec]:
    """The engines of a config that `engine_refusals` found nothing wrong with."""
    shared = dict(config.get("engine") or {})
    entries = config.get("engines") or []
    if not entries:
        return [EngineSpec(DEFAULT_NAME, (gpu_index,), shared)]
    out = []
    for e in entries:
        flags = {**shared, **{k: v for k, v in e.items() if k not in OWN_KEYS}}
        out.append(EngineSpec(str(e["name"]), tuple(e["gpus"]), flags, e.get("engine_command"),
                              dict(e.get("engine_env") or {}), tagged=True))
    return out


def engine_refusals(config: dict[str, Any]) -> list[str]:
    """What is wrong with `[[engines]]` as a whole and with each entry's own keys
    (its flags are checked by the caller, against the engine's options)."""
    entries = config.get("engines")
    if entries is None:
        return []
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        return ["[[engines]] must be one or more tables: [[engines]] name = \"a\" gpus = [0] port = 8001"]
    out: list[str] = []
    daemon = config.get("daemon") or {}
    for key in SINGLE_ENGINE_KEYS:
        if key in daemon:
            out.append(refusal("daemon", key, daemon[key],
                               "speaks for one engine: with [[engines]], set it in each entry"
                               if key != "gpu_index" else "with [[engines]], each entry's gpus say it"))
    names: dict[str, int] = {}
    gpus: dict[int, str] = {}  # GPU -> the entry that has it
    ports: dict[Any, str] = {}
    shared_port = (config.get("engine") or {}).get("port")
    for i, e in enumerate(entries):
        where = f"engines.{i}"
        name = e.get("name")
        if name is None:
            out.append(f"[{where}] name is not set: each engine needs one (its label, 1-32 of A-Z a-z 0-9 _ . -)")
        elif not isinstance(name, str) or not NAME.fullmatch(name):
            out.append(refusal(where, "name", name, "must be 1-32 of A-Z a-z 0-9 _ . - (the engine's label)"))
        elif name in names:
            out.append(refusal(where, "name", name, f"is the name of engines.{names[name]} too: names must differ"))
        else:
            names[name] = i
            where = f"engines.{name}"
        g = e.get("gpus")
        if g is None:
            out.append(f"[{where}] gpus is not set: the GPU indexes this engine runs on, e.g. gpus = [0]")
            g = []
        elif not isinstance(g, list) or not g or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                      for x in g):
            out.append(refusal(where, "gpus", g, "must be a non-empty list of GPU indexes >= 0, e.g. [0, 1]"))
            g = []
        elif len(set(g)) != len(g):
            out.append(refusal(where, "gpus", g, "lists a GPU twice"))
        for x in g:
            if x in gpus and gpus[x] != where:
                out.append(refusal(where, "gpus", g, f"GPU {x} is in [{gpus[x]}] already: a GPU serves one engine"))
            gpus.setdefault(x, where)
        tp = e.get("tensor_parallel_size")
        if tp is not None and tp != len(g) and g:
            out.append(refusal(where, "tensor_parallel_size", tp,
                               f"must equal the number of its GPUs ({len(g)}), or be left out"))
        cmd = e.get("engine_command")
        if cmd is not None and not (isinstance(cmd, list) and cmd and all(isinstance(c, str) for c in cmd)):
            out.append(refusal(where, "engine_command", cmd, "must be a non-empty list of strings"))
        env = e.get("engine_env")
        if env is not None and not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
            out.append(refusal(where, "engine_env", env, 'must be a table of name = "text"'))
        port = e.get("port", shared_port)
        if port is None:
            out.append(f"[{where}] port is not set: each engine listens on a port of its own")
        elif port in ports:
            out.append(refusal(where, "port", port, f"is the port of [{ports[port]}] already"))
        else:
            ports[port] = where
    return out
