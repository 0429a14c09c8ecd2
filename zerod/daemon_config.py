"""`[daemon]` and `[alerts]`: the daemon's settings, validated when built.

Every key is documented in systemd/zerod.toml.example; a test keeps the two in
step. Unknown keys are refused (a typo must not silently become a default).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

DEFAULT_THROTTLE_REASONS = (
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
)
NUMA_MODES = ("auto", "builtin", "numactl", "off")
NUMA_POLICIES = ("bind", "preferred")


class DaemonConfigError(ValueError):
    pass


def default_socket() -> str:
    """The control socket both `zerod run` and `zerod top` use unless told otherwise:
    systemd's RuntimeDirectory, /run/zerod as root, else the user's runtime dir."""
    rt = os.environ.get("RUNTIME_DIRECTORY")  # systemd's RuntimeDirectory=zerod
    if rt:
        return os.path.join(rt.split(":")[0], "control.sock")
    if os.geteuid() == 0:
        return "/run/zerod/control.sock"
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/zerod-{os.geteuid()}"
    return os.path.join(base, "zerod", "control.sock")


@dataclass
class DaemonConfig:
    # outputs
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 9477  # 0: any free port (tests); -1: no /metrics endpoint
    control_socket: str = field(default_factory=default_socket)
    allow_write_actions: bool = False
    # preflight
    preflight: bool = True
    recheck_interval_s: float = 300.0
    # the engine
    engine_command: list[str] | None = None  # default: python -m zerod serve + [engine]
    engine_env: dict[str, str] = field(default_factory=dict)
    engine_url: str | None = None  # default: from [engine] host/port
    gpu_index: int = 0
    numa: str = "auto"
    numa_memory_policy: str = "bind"
    health_interval_s: float = 1.0
    health_timeout_s: float = 3.0
    start_timeout_s: float = 900.0
    extend_timeout_step_s: float = 30.0
    restart_backoff_initial_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    restart_reset_after_s: float = 120.0
    drain_timeout_s: float = 30.0
    # watching
    watch_interval_s: float = 1.0
    full_scan_interval_s: float = 5.0  # /proc fd scan of every process; 0: every tick
    nvml_retry_s: float = 30.0
    slo_itl_p99_s: float = 0.0  # 0: no latency alert
    slo_ttft_p99_s: float = 0.0
    latency_window_s: float = 60.0
    latency_min_samples: int = 20
    cause_window_s: float = 300.0
    temperature_max_celsius: float = 85.0
    throttle_alert_reasons: list[str] = field(default_factory=lambda: list(DEFAULT_THROTTLE_REASONS))
    throttle_for_s: float = 10.0
    counter_alert_hold_s: float = 300.0

    def __post_init__(self) -> None:
        if self.numa not in NUMA_MODES:
            raise DaemonConfigError(f"[daemon] numa must be one of {', '.join(NUMA_MODES)}, not {self.numa!r}")
        if self.numa_memory_policy not in NUMA_POLICIES:
            raise DaemonConfigError(
                f"[daemon] numa_memory_policy must be one of {', '.join(NUMA_POLICIES)}, not {self.numa_memory_policy!r}"
            )
        if not (-1 <= int(self.metrics_port) <= 65535):
            raise DaemonConfigError(f"[daemon] metrics_port {self.metrics_port} is not a port")
        if self.engine_command is not None and (
            not isinstance(self.engine_command, list) or not self.engine_command
            or not all(isinstance(a, str) for a in self.engine_command)
        ):
            raise DaemonConfigError("[daemon] engine_command must be a non-empty list of strings")
        for name in (
            "health_interval_s", "health_timeout_s", "start_timeout_s", "extend_timeout_step_s",
            "restart_backoff_initial_s", "restart_backoff_max_s", "drain_timeout_s",
            "watch_interval_s", "nvml_retry_s", "latency_window_s", "recheck_interval_s",
        ):
            if float(getattr(self, name)) <= 0:
                raise DaemonConfigError(f"[daemon] {name} must be > 0")
        for name in ("slo_itl_p99_s", "slo_ttft_p99_s", "cause_window_s", "counter_alert_hold_s",
                     "throttle_for_s", "restart_reset_after_s", "full_scan_interval_s"):
            if float(getattr(self, name)) < 0:
                raise DaemonConfigError(f"[daemon] {name} must be >= 0")
        if self.health_timeout_s < self.health_interval_s:
            raise DaemonConfigError("[daemon] health_timeout_s must be >= health_interval_s")

    @classmethod
    def from_dict(cls, section: dict[str, Any] | None) -> "DaemonConfig":
        return _build(cls, "daemon", section or {})


@dataclass
class AlertsConfig:
    alertmanager_url: str = ""  # e.g. "http://127.0.0.1:9093"; empty: no push
    resend_interval_s: float = 60.0
    timeout_s: float = 5.0
    labels: dict[str, str] = field(default_factory=dict)  # added to every alert
    resolved_retention_s: float = 3600.0
    log_resolved: bool = True

    def __post_init__(self) -> None:
        url = self.alertmanager_url.rstrip("/")
        if url and not url.startswith(("http://", "https://")):
            raise DaemonConfigError(f"[alerts] alertmanager_url must be http(s)://…, not {url!r}")
        self.alertmanager_url = url
        if self.resend_interval_s <= 0 or self.timeout_s <= 0:
            raise DaemonConfigError("[alerts] resend_interval_s and timeout_s must be > 0")
        self.labels = {str(k): str(v) for k, v in self.labels.items()}

    @classmethod
    def from_dict(cls, section: dict[str, Any] | None) -> "AlertsConfig":
        return _build(cls, "alerts", section or {})


def _build(cls, name: str, section: dict[str, Any]):
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(section) - set(known))
    if unknown:
        raise DaemonConfigError(f"[{name}] unknown key(s): {', '.join(unknown)}")
    kwargs: dict[str, Any] = {}
    for key, value in section.items():
        default = known[key].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise DaemonConfigError(f"[{name}] {key} must be true or false")
        if isinstance(default, float) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise DaemonConfigError(f"[{name}] {key} must be a number")
            value = float(value)
        elif isinstance(default, int) and not isinstance(default, bool):
            if isinstance(value, bool) or not isinstance(value, int):
                raise DaemonConfigError(f"[{name}] {key} must be an integer")
        elif isinstance(default, str) and not isinstance(value, str):
            raise DaemonConfigError(f"[{name}] {key} must be a string")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - defensive
        raise DaemonConfigError(f"[{name}] {exc}") from None
