"""Host probes, the facts snapshot, pure checks over it, and `zerod harden`.

    facts = probe_facts(roots)            # read the host (NVML, /proc, /sys, addresses)
    report = run_checks(facts, config)     # pure: the same facts give the same report
    report.exit_code, report.to_dict()

Nothing here imports torch, the daemon or the dashboard; of the engine only its torch-free
model spec (`zerod.engine.spec`), so doctor reads, refuses and sizes a model as the engine does.
"""

from . import (  # noqa: F401 - register the checks
    checks_gpu, checks_gpu_state, checks_host, checks_inventory, checks_links, checks_platform, checks_service)
from .config import DoctorConfig, DoctorConfigError
from .facts import Fact, Facts, Roots
from .probe import probe_facts
from .report import CATALOGUE, REGISTRY, CheckResult, Report, run_checks

__all__ = [
    "CATALOGUE", "REGISTRY", "CheckResult", "DoctorConfig", "DoctorConfigError", "Fact", "Facts",
    "Report", "Roots", "probe_facts", "run_checks",
]
