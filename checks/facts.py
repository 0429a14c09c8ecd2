"""The facts snapshot: everything the probes read, as plain JSON.

Each fact is `key -> {"value": v, "source": s}` when read, or
`key -> {"error": why, "source": s, "missing": bool}` when it could not be read
(missing: the file or feature does not exist here, as opposed to unreadable).
Checks are pure functions of this snapshot, so a snapshot saved on one host
(`--save-facts`) replays anywhere (`--facts`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = 1


@dataclass(frozen=True)
class Roots:
    """Where the probes find /proc, /sys and / (node_exporter's --path.* flags).

    With only `rootfs` given, procfs and sysfs default to rootfs/proc and rootfs/sys.
    """

    procfs: str = "/proc"
    sysfs: str = "/sys"
    rootfs: str = "/"

    @classmethod
    def make(cls, procfs: str | None = None, sysfs: str | None = None,
             rootfs: str | None = None) -> "Roots":
        root = rootfs or "/"
        return cls(
            procfs=procfs or os.path.join(root, "proc"),
            sysfs=sysfs or os.path.join(root, "sys"),
            rootfs=root,
        )

    @property
    def live(self) -> bool:
        return (self.procfs, self.sysfs, self.rootfs) == ("/proc", "/sys", "/")

    def proc(self, rel: str) -> str:
        return os.path.join(self.procfs, rel.lstrip("/"))

    def sys(self, rel: str) -> str:
        return os.path.join(self.sysfs, rel.lstrip("/"))

    def root(self, rel: str) -> str:
        return os.path.join(self.rootfs, rel.lstrip("/"))


@dataclass(frozen=True)
class Fact:
    key: str
    value: Any = None
    source: str = ""
    error: str | None = None
    missing: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


class Facts:
    def __init__(self, items: dict[str, dict] | None = None, host: dict | None = None,
                 meta: dict | None = None) -> None:
        self.items: dict[str, dict] = dict(items or {})
        self.host: dict[str, Any] = dict(host or {})
        self.meta: dict[str, Any] = dict(meta or {})

    def put(self, key: str, value: Any, source: str) -> Any:
        self.items[key] = {"value": value, "source": source}
        return value

    def fail(self, key: str, error: str, source: str, missing: bool = False) -> None:
        self.items[key] = {"error": error, "source": source, "missing": missing}

    def get(self, key: str) -> Fact:
        d = self.items.get(key)
        if d is None:
            return Fact(key, error=f"{key} was not probed", missing=True)
        return Fact(key, d.get("value"), d.get("source", ""), d.get("error"), bool(d.get("missing")))

    def value(self, key: str, default: Any = None) -> Any:
        f = self.get(key)
        return f.value if f.ok else default

    def __contains__(self, key: str) -> bool:
        return key in self.items

    # -- JSON ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "host": self.host, "meta": self.meta, "facts": self.items}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Facts":
        if not isinstance(d, dict) or not isinstance(d.get("facts"), dict):
            raise ValueError("not a zerod facts snapshot (no \"facts\" object)")
        if d.get("schema", SCHEMA) > SCHEMA:
            raise ValueError(f"facts schema {d.get('schema')} is newer than this zerod ({SCHEMA})")
        return cls(d["facts"], d.get("host"), d.get("meta"))

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> "Facts":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Facts":
        return cls.from_json(Path(path).read_text())


def read_text(path: str, limit: int = 1 << 20) -> str:
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace")


def read_into(facts: Facts, key: str, path: str, parse=lambda s: s.strip()) -> Any:
    """Read one host file into a fact; a missing or unreadable file becomes an error fact."""
    try:
        return facts.put(key, parse(read_text(path)), path)
    except FileNotFoundError:
        facts.fail(key, f"{path} does not exist", path, missing=True)
    except PermissionError:
        facts.fail(key, f"{path} is not readable (permission denied)", path)
    except (OSError, ValueError) as exc:
        facts.fail(key, f"{path}: {exc}", path)
    return None
