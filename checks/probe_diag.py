"""The last `zerod diag` result (checks.state_dir), as a summary fact for gpu.diag:
doctor never runs the active tests itself, it shows what they last found."""

from __future__ import annotations

import json

from .facts import Facts, Roots
from .state_dir import diag_result_path


def probe(facts: Facts, roots: Roots, state_dir: str | None) -> None:
    path = diag_result_path(state_dir)
    where = path if roots.live else roots.root(path)
    try:
        with open(where) as f:
            doc = json.load(f)
    except FileNotFoundError:
        facts.fail("diag.last", f"no `zerod diag` result kept in {where}", where, missing=True)
        return
    except (OSError, ValueError) as exc:
        facts.fail("diag.last", f"cannot read {where}: {exc}", where)
        return
    if not isinstance(doc, dict) or not isinstance(doc.get("tests"), list):
        facts.fail("diag.last", f"{where} is not a `zerod diag --json` report", where)
        return
    host = doc.get("host") or {}
    facts.put("diag.last", {
        "time": host.get("time"), "started_at": host.get("started_at"), "level": host.get("level"),
        "gpus": [{"index": g.get("index"), "uuid": g.get("uuid")} for g in host.get("gpus") or []],
        "tests": [{k: t.get(k) for k in ("id", "gpu", "peer", "status", "message")} for t in doc["tests"]],
    }, where)
