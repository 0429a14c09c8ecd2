"""`[doctor]` configuration: thresholds, waivers and what may hold the GPU.

Built from plain dicts (the `[doctor]` and `[engine]` tables of zerod.toml) so
that checks need nothing of the daemon. Validated when built.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from zerod.engine.config import EngineConfig


class DoctorConfigError(ValueError):
    """A `[doctor]` key is unknown or has a value that cannot be used."""


# the engine's defaults, read from its dataclass (building one would import its flag table)
_ENGINE = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


@dataclass(frozen=True)
class DoctorConfig:
    # Thresholds the source document names.
    min_compute_capability: float = 8.0
    min_driver_version: str = "525.60.13"
    min_kernel_version: str = "5.10"
    recommended_kernel_version: str = "5.15"
    max_memory_fraction: float = 0.92
    # What the engine will ask for (values from [engine], overridable here; defaults the
    # engine's own, EngineConfig's).
    gpu_memory_utilization: float = _ENGINE["gpu_memory_utilization"]
    gpus: tuple[int, ...] | None = None  # GPU indexes the engine uses; None = all
    model: str | None = None
    tokenizer: str | None = None     # the folder of tokenizer.json when not the model's
    max_model_len: int | None = _ENGINE["max_model_len"]
    max_num_seqs: int = _ENGINE["max_num_seqs"]
    dtype: str = _ENGINE["dtype"]
    load_format: str = _ENGINE["load_format"]  # "dummy": random weights, nothing to find on disk
    quantization: str | None = _ENGINE["quantization"]  # "fp8": quantized at load (compute capability 8.9)
    kv_cache_dtype: str = _ENGINE["kv_cache_dtype"]     # "fp8" / "fp8_e4m3": FP8 KV pages (the same)
    # the rest of what sizes the KV pool (the engine's activation headroom and page size)
    # and what the model must be split over; None: the engine's default
    max_num_batched_tokens: int | None = None
    max_prefill_tokens_idle: int | None = None
    block_size: int | None = None
    tensor_parallel_size: int = 1
    enable_lora: bool = False
    engine_env: dict[str, str] = field(default_factory=dict)  # from [daemon] engine_env: NCCL_* for gpu.p2p
    engine_kind: str = "zerod"       # from [daemon] engine: engine.config reads models as zerod's engine does
    # net.bind_exposure
    bind_address: str = "127.0.0.1"
    api_key_set: bool = False
    # Host expectations.
    memlock_min_bytes: int = 1 << 30
    thp_allowed: tuple[str, ...] = ("madvise", "never")
    cpu_governor: str = "performance"
    xid_window_s: int = 3600
    expected_gpus: int | None = None  # gpu.count: how many GPUs this host should show; None: not checked
    min_free_disk_bytes: int = 10 << 30  # host.disk_space: less free under the model or a cache directory warns
    # Where the last `zerod diag` result is kept (gpu.diag): [daemon] state_dir; None: the default
    # (zerod.checks.state_dir).
    state_dir: str | None = None
    # Processes allowed on the GPU besides zerod: fnmatch patterns matched against
    # the process name, argv[0], the command line, the systemd unit and the container.
    allowed_gpu_processes: tuple[str, ...] = ()
    # check ID -> reason. A waived check still runs and shows what it found, but
    # does not count towards the exit code or the daemon's gate.
    waivers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> DoctorConfigError:
            return DoctorConfigError(f"[doctor] {key}: {why}")

        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 < self.max_memory_fraction <= 1:
            raise bad("max_memory_fraction", f"must be in (0, 1], got {self.max_memory_fraction}")
        if self.min_compute_capability <= 0:
            raise bad("min_compute_capability", "must be positive")
        for key in ("min_driver_version", "min_kernel_version", "recommended_kernel_version"):
            v = getattr(self, key)
            if not all(p.isdigit() for p in str(v).split(".")):
                raise bad(key, f"must be a dotted version like 5.15, got {v!r}")
        if self.memlock_min_bytes < 0 or self.xid_window_s <= 0 or self.max_num_seqs <= 0:
            raise bad("memlock_min_bytes/xid_window_s/max_num_seqs", "must be positive")
        def whole(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.expected_gpus is not None and (not whole(self.expected_gpus) or self.expected_gpus < 1):
            raise bad("expected_gpus", f"must be a whole number >= 1, got {self.expected_gpus!r}")
        if not whole(self.min_free_disk_bytes) or self.min_free_disk_bytes < 0:
            raise bad("min_free_disk_bytes", f"must be a whole number of bytes >= 0, got {self.min_free_disk_bytes!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise bad("max_model_len", "must be positive")
        for cid, reason in self.waivers.items():
            if not isinstance(reason, str) or not reason.strip():
                raise bad(f"waivers.{cid}", "a waiver needs a reason (a non-empty string)")

    # Keys of [engine] that doctor reads, and the doctor field each one sets.
    ENGINE_KEYS = {
        "model": "model",
        "tokenizer": "tokenizer",
        "gpu_memory_utilization": "gpu_memory_utilization",
        "max_model_len": "max_model_len",
        "max_num_seqs": "max_num_seqs",
        "dtype": "dtype",
        "load_format": "load_format",
        "quantization": "quantization",
        "kv_cache_dtype": "kv_cache_dtype",
        "max_num_batched_tokens": "max_num_batched_tokens",
        "max_prefill_tokens_idle": "max_prefill_tokens_idle",
        "block_size": "block_size",
        "tensor_parallel_size": "tensor_parallel_size",
        "enable_lora": "enable_lora",
        "host": "bind_address",
    }

    def engine_config(self):
        """The EngineConfig the engine would be started with: the [engine] keys above that
        are its fields, its defaults for the rest; EngineError when it would refuse a value."""
        from zerod.engine.config import EngineConfig, EngineError   # torch-free, validated when built

        flags = {f.name for f in dataclasses.fields(EngineConfig)}
        kw = {k: getattr(self, k) for k in self.ENGINE_KEYS.values()
              if k in flags and getattr(self, k) is not None}
        try:
            return EngineConfig(**kw)
        except (TypeError, ValueError) as exc:   # a value of the wrong type in [engine]
            raise EngineError(f"invalid engine config: {exc}") from None

    @classmethod
    def from_dict(cls, section: dict[str, Any] | None = None,
                  engine: dict[str, Any] | None = None) -> "DoctorConfig":
        """Build from the `[doctor]` table; `engine` (the `[engine]` table) supplies
        the model, memory fraction and bind address unless `[doctor]` sets them."""
        section = dict(section or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(section) - known)
        if unknown:
            raise DoctorConfigError(
                f"[doctor]: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        kw: dict[str, Any] = {}
        for ekey, dkey in cls.ENGINE_KEYS.items():
            if engine and engine.get(ekey) is not None:
                kw[dkey] = engine[ekey]
        if isinstance(kw.get("max_model_len"), str):   # "32k", "auto": zerod serve's reading
            kw["max_model_len"] = _token_count(kw["max_model_len"])
        if engine and engine.get("api_key"):
            kw["api_key_set"] = True
        kw.update(section)
        for key in ("thp_allowed", "allowed_gpu_processes", "gpus"):
            if key in kw and kw[key] is not None:
                if isinstance(kw[key], (str, int)):
                    kw[key] = [kw[key]]
                kw[key] = tuple(kw[key])
        if "waivers" in kw and not isinstance(kw["waivers"], dict):
            raise DoctorConfigError("[doctor] waivers: must be a table of check ID = \"reason\"")
        for key in ("min_driver_version", "min_kernel_version", "recommended_kernel_version"):
            if key in kw:
                kw[key] = str(kw[key])
        try:
            return cls(**kw)
        except TypeError as exc:
            raise DoctorConfigError(f"[doctor]: {exc}") from None

    @classmethod
    def from_config(cls, config: dict[str, dict[str, Any]] | None) -> "DoctorConfig":
        """From the whole config as `zerod.config.load_config` returns it."""
        config = config or {}
        doctor = dict(config.get("doctor") or {})
        env = (config.get("daemon") or {}).get("engine_env")
        if isinstance(env, dict) and "engine_env" not in doctor:
            doctor["engine_env"] = env
        state = (config.get("daemon") or {}).get("state_dir")
        if isinstance(state, str) and state and "state_dir" not in doctor:
            doctor["state_dir"] = state
        kind = (config.get("daemon") or {}).get("engine")
        if isinstance(kind, str) and "engine_kind" not in doctor:
            doctor["engine_kind"] = kind
        return cls.from_dict(doctor, engine=config.get("engine"))


def _token_count(text: str) -> int | None:
    """[engine] max_model_len as `zerod serve --max-model-len` reads it."""
    from zerod.engine.config import parse_token_count

    try:
        n = parse_token_count(text, auto=True)
    except ValueError as exc:
        raise DoctorConfigError(f"[engine] max_model_len: {exc}") from None
    return n
