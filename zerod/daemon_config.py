"""`[daemon]` and `[alerts]`: the daemon's settings, each field with its rule.

Every key is documented in systemd/zerod.toml.example with its range; a test
keeps the two in step. `from_dict` refuses unknown keys, wrong types, values
out of range and the cross-field rules below, all at once, one line each.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from zerod.checks.state_dir import state_dir
from zerod.config_schema import check_table, refusal, setting
from zerod.engines import ENGINE_KINDS

DEFAULT_THROTTLE_REASONS = (
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
)
NUMA_MODES = ("auto", "builtin", "numactl", "off")
NUMA_POLICIES = ("bind", "preferred")
UNIX_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


class DaemonConfigError(ValueError):
    """One or more refusals, one line each."""

    def __init__(self, refusals: list[str]) -> None:
        super().__init__("\n".join(refusals))
        self.refusals = refusals


def default_socket(env: dict[str, str] | None = None, euid: int | None = None) -> str:
    """The control socket `zerod run`, `zerod top` and `zerod install` agree on
    unless told otherwise: systemd's RuntimeDirectory, /run/zerod as root, else
    the user's runtime directory."""
    env = os.environ if env is None else env
    euid = os.geteuid() if euid is None else euid
    rt = env.get("RUNTIME_DIRECTORY")  # systemd's RuntimeDirectory=zerod
    if rt:
        return os.path.join(rt.split(":")[0], "control.sock")
    if euid == 0:
        return "/run/zerod/control.sock"
    base = env.get("XDG_RUNTIME_DIR") or f"/tmp/zerod-{euid}"
    return os.path.join(base, "zerod", "control.sock")


def default_state_dir(env: dict[str, str] | None = None, euid: int | None = None) -> str:
    """Where the events and the flight recorder's bundles are kept (checks/state_dir.py's
    rule, so `zerod events` and `zerod diag` find what `zerod run` wrote)."""
    return state_dir(None, env, euid)


def _socket_path(value: str) -> str | None:
    if not value:
        return "must be a path"
    if len(os.fsencode(value)) > UNIX_PATH_MAX:
        return f"must be at most {UNIX_PATH_MAX} bytes long (the limit of a Unix socket path)"
    return None


def _command(value: list[str]) -> str | None:
    return None if value and value[0] else "must be a non-empty list: the program, then its arguments"


def _factor(value: float) -> str | None:
    return None if value == 0 or value > 1 else "must be 0 (off) or > 1: the p99 against its normal"


def _http_url(value: str) -> str | None:
    return None if value.startswith(("http://", "https://")) else "must start with http:// or https://"


def _optional_http_url(value: str) -> str | None:
    return _http_url(value) if value else None


def _label_names(value: dict[str, str]) -> str | None:
    bad = [k for k in value if not LABEL_NAME.fullmatch(k)]
    return f"label names must match [a-zA-Z_][a-zA-Z0-9_]* ({', '.join(bad)} do not)" if bad else None


@dataclass
class DaemonConfig:
    # outputs
    metrics_host: str = setting("127.0.0.1", check=lambda v: None if v else "must be an address")
    metrics_port: int = setting(9477, ge=-1, le=65535)  # 0: any free port (tests); -1: no /metrics
    control_socket: str = setting(factory=default_socket, check=_socket_path)
    allow_write_actions: bool = setting(False)
    # preflight
    preflight: bool = setting(True)
    recheck_interval_s: float = setting(300.0, ge=1.0)
    diag_on_start: bool = setting(False)  # `zerod diag --level quick` on the engines' GPUs before they start
    # what outlives the daemon (the last diag result); "": zerod.checks.state_dir's default
    state_dir: str = setting("", check=lambda v: None if not v or os.path.isabs(v) else "must be an absolute path")
    # the engine
    engine: str = setting("zerod", choices=ENGINE_KINDS)  # zerod.engines: command line, health, metric names
    engine_command: list[str] | None = setting(None, check=_command)  # default: zerod serve + [engine]
    engine_env: dict[str, str] = setting(factory=dict)
    engine_url: str | None = setting(None, check=_http_url)  # default: from [engine] host/port
    gpu_index: int = setting(0, ge=0)
    exclusive_gpu: bool = setting(False)  # EXCLUSIVE_PROCESS on the engine's GPUs while it serves
    numa: str = setting("auto", choices=NUMA_MODES)
    numa_memory_policy: str = setting("bind", choices=NUMA_POLICIES)
    health_interval_s: float = setting(1.0, ge=0.1)
    health_timeout_s: float = setting(3.0, gt=0)  # one probe's; and > health_interval_s
    # a stalled engine: probed this often, judged after this many failures in a row
    # (Kubernetes' liveness defaults: 3 failures 10 s apart), and when it is still working
    # (slow, not dead: zerod.liveness) restarted only after this long
    health_failure_threshold: int = setting(3, ge=1)
    health_failure_period_s: float = setting(10.0, ge=0.1)
    health_slow_limit_s: float = setting(120.0, ge=0)
    start_timeout_s: float = setting(900.0, gt=0)
    extend_timeout_step_s: float = setting(30.0, ge=1.0)
    restart_backoff_initial_s: float = setting(1.0, ge=0.1)  # and <= restart_backoff_max_s
    restart_backoff_max_s: float = setting(60.0, ge=0.1)
    restart_reset_after_s: float = setting(120.0, ge=0)
    drain_timeout_s: float = setting(30.0, gt=0)
    # watching
    watch_interval_s: float = setting(1.0, ge=0.1)
    full_scan_interval_s: float = setting(5.0, ge=0)  # /proc fd scan of every process; 0: every tick
    nvml_retry_s: float = setting(30.0, ge=1.0)
    netlink: bool = setting(True)  # link/address events: net.bind_exposure re-run, EngineLinkDown
    # LatencyRegression against the learned normal at comparable load (zerod.watchers.latency_baseline)
    latency_regression_factor: float = setting(1.5, ge=0, check=_factor)  # 0: no learned baseline
    latency_baseline_s: float = setting(3600.0, ge=60.0)
    latency_baseline_min_samples: int = setting(200, ge=1)
    latency_baseline_min_s: float = setting(30.0, ge=0)  # a normal of a few seconds is not one
    slo_itl_p99_s: float = setting(0.0, ge=0)  # absolute SLOs, optional; 0: none
    slo_ttft_p99_s: float = setting(0.0, ge=0)
    latency_window_s: float = setting(60.0, ge=1.0)
    # the recent part of the window whose mean is compared (a sustained shift shows there first)
    latency_shift_s: float = setting(10.0, ge=1.0)  # and <= latency_window_s (when set)
    # ITL's sustained shift: each of the last N scrape intervals' means over the factor (0: off)
    latency_sustain_intervals: int = setting(3, ge=0, check=lambda v: None if v != 1 else
                                             "must be 0 (off) or >= 2: one interval is a burst, not a shift")
    latency_min_samples: int = setting(20, ge=0)
    cause_window_s: float = setting(300.0, ge=0)
    temperature_max_celsius: float = setting(85.0, gt=0, le=150)
    # names of docs/control-api.md's clock event reasons (checked in zerod.config)
    throttle_alert_reasons: list[str] = setting(factory=lambda: list(DEFAULT_THROTTLE_REASONS))
    throttle_for_s: float = setting(10.0, ge=0)
    counter_alert_hold_s: float = setting(300.0, ge=0)
    # EngineStalled: requests running and no token produced for this long (0: off)
    stall_after_s: float = setting(10.0, ge=0)
    stall_restart: bool = setting(True)  # restart a stalled engine once its evidence is taken
    # the canary: fixed greedy prompts against the answer recorded at the engine's start (0: off)
    canary_interval_s: float = setting(300.0, ge=0)
    # what lasts: the event store and the flight recorder's bundles (zerod events, zerod bundle)
    state_dir: str = setting(factory=default_state_dir, check=lambda v: None if v else "must be a path")
    events_max_age_s: float = setting(30 * 86400.0, ge=60.0)
    events_max_bytes: int = setting(64 << 20, ge=1 << 16)
    bundle_on_critical: bool = setting(True)
    bundle_min_interval_s: float = setting(900.0, ge=0)  # the flight recorder: one per alert name per this long
    bundles_kept: int = setting(5, ge=1)

    @classmethod
    def from_dict(cls, section: dict[str, Any] | None) -> "DaemonConfig":
        section = section or {}
        values, refusals = check_table(cls, "daemon", section)
        if not refusals:
            cfg = cls(**values)
            refusals = cfg.cross_refusals() + cfg.shift_refusals(section)
        if refusals:
            raise DaemonConfigError(refusals)
        return cfg

    def cross_refusals(self) -> list[str]:
        out = []
        if self.restart_backoff_initial_s > self.restart_backoff_max_s:
            out.append(refusal("daemon", "restart_backoff_initial_s", self.restart_backoff_initial_s,
                               f"must be <= restart_backoff_max_s ({self.restart_backoff_max_s:g})"))
        if self.health_timeout_s <= self.health_interval_s:
            out.append(refusal("daemon", "health_timeout_s", self.health_timeout_s,
                               f"must be > health_interval_s ({self.health_interval_s:g})"))
        return out

    def shift_refusals(self, given: dict[str, Any]) -> list[str]:
        """latency_shift_s is the window's last seconds: one set above the window is a
        typo; the default (10 s) simply fits a shorter window (latency_shift_window_s)."""
        if "latency_shift_s" in given and self.latency_shift_s > self.latency_window_s:
            return [refusal("daemon", "latency_shift_s", self.latency_shift_s,
                            f"must be <= latency_window_s ({self.latency_window_s:g}): "
                            "it is the window's last seconds")]
        return []

    @property
    def latency_shift_window_s(self) -> float:
        return min(self.latency_shift_s, self.latency_window_s)


@dataclass
class AlertsConfig:
    alertmanager_url: str = setting("", check=_optional_http_url)  # e.g. "http://127.0.0.1:9093"; "": no push
    resend_interval_s: float = setting(60.0, ge=1.0)
    timeout_s: float = setting(5.0, gt=0)
    labels: dict[str, str] = setting(factory=dict, check=_label_names)  # added to every pushed alert
    resolved_retention_s: float = setting(3600.0, ge=0)
    log_resolved: bool = setting(True)

    def __post_init__(self) -> None:
        self.alertmanager_url = self.alertmanager_url.rstrip("/")

    @classmethod
    def from_dict(cls, section: dict[str, Any] | None) -> "AlertsConfig":
        values, refusals = check_table(cls, "alerts", section or {})
        if refusals:
            raise DaemonConfigError(refusals)
        return cls(**values)
