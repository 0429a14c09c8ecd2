"""Shared helpers for the doctor/harden tests (imported by the other test_checks_*,
test_doctor_* and test_harden_* files; holds no tests of its own)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

from zerod.checks import DoctorConfig, Facts, run_checks

FACTS_DIR = Path(__file__).parent / "fixtures" / "facts"
REPO = Path(__file__).resolve().parent.parent


def load(name: str) -> Facts:
    return Facts.load(FACTS_DIR / f"{name}.json")


def h200() -> Facts:
    return load("h200")


def edit(facts: Facts, key: str, value=None, *, error: str | None = None, missing: bool = False) -> Facts:
    """A copy of `facts` with one fact replaced (or turned into an error)."""
    f = Facts(copy.deepcopy(facts.items), dict(facts.host), dict(facts.meta))
    if error is not None:
        f.fail(key, error, "test", missing=missing)
    else:
        f.put(key, value, "test")
    return f


def edit_gpu0(facts: Facts, **fields) -> Facts:
    gpus = copy.deepcopy(facts.value("nvml.gpus"))
    for k, v in fields.items():
        if v is None:
            gpus[0].pop(k, None)
            gpus[0]["errors"][k] = "Not Supported"
        else:
            gpus[0][k] = v
    return edit(facts, "nvml.gpus", gpus)


def statuses(facts: Facts, config: DoctorConfig | None = None, **kw) -> dict[str, str]:
    return {c.id: c.status for c in run_checks(facts, config, **kw).checks}


def result(facts: Facts, cid: str, config: DoctorConfig | None = None):
    (r,) = run_checks(facts, config, only=[cid]).checks
    return r


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NO_COLOR", None)
    env["PYTHONPATH"] = str(REPO)
    return env


def dump(facts: Facts, path) -> str:
    Path(path).write_text(json.dumps(facts.to_dict()))
    return str(path)
